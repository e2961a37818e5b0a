"""Rotary position embeddings (HF "rotate_half" convention) and their scaling variants.

Scaling follows the semantics of HF ``rope_type``: linear (position
interpolation), llama3 (wavelength-banded interpolation), yarn (NTK-by-parts
plus an attention temperature folded into cos/sin), and ``freq_factors``
(per-frequency divisors as stored in some GGUF files as ``rope_freqs.weight``).
"""

from __future__ import annotations

import math

import torch

from .config import ModelArchConfig


def rope_inv_freq(arch: ModelArchConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` float32 and the cos/sin multiplier."""
    dim, base = arch.head_dim, arch.rope_theta
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base ** exponent)
    s = arch.rope_scaling
    if s is None:
        return inv_freq, 1.0
    kind = s["rope_type"]
    if kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, s), 1.0
    if kind == "yarn":
        return _yarn(base ** exponent, dim, base, s)
    if kind == "freq_factors":
        factors = torch.tensor(s["factors"], dtype=torch.float32)
        return inv_freq / factors, 1.0
    raise ValueError(f"unknown rope_type {kind!r}")  # unreachable: config validates


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(medium, blended, scaled)


def _yarn(pos_freqs: torch.Tensor, dim: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    old_ctx = float(s["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 interpolates fully
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


class RotaryCache:
    """Lazily grown cos/sin tables ``[L, head_dim]`` float32 (halves duplicated, HF layout)."""

    def __init__(self, arch: ModelArchConfig):
        self.inv_freq, self.mscale = rope_inv_freq(arch)
        self.max_positions = arch.max_position_embeddings
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def ensure(self, length: int, device: torch.device) -> None:
        """Make the tables cover positions ``[0, length)`` (grows by doubling)."""
        have = 0 if self.cos is None else self.cos.shape[0]
        if have >= length and self.cos.device == device:
            return
        new_len = max(length, min(max(2 * have, 4096), self.max_positions))
        pos = torch.arange(new_len, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.mscale).to(device)
        self.sin = (emb.sin() * self.mscale).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` in ``dtype`` for int64 ``positions [T]``. ``bound``:
        every position is below it, known on the host (an engine step's); without it the
        tables are sized from ``positions.max()``, a device sync, until they cover the
        model's whole context."""
        if bound is not None:
            self.ensure(bound, positions.device)
        elif self.cos is None or self.cos.shape[0] < self.max_positions or \
                self.cos.device != positions.device:
            need = int(positions.max()) + 1 if positions.numel() else 1
            self.ensure(need, positions.device)
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos/sin [T, 1, D]`` (rotate_half pairing i <-> i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
