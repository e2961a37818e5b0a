"""Torch references for the fused decoder-layer kernels (any device).

The ground truth that :mod:`nibble.kernels.triton.layer_ops` and
:mod:`nibble.kernels.triton.qkv` are tested against. Every reference computes in
float32 and rounds once, into the output dtype; the model's unfused torch path
rounds its intermediates to the model dtype as well, which the fused kernels do
not (they are at least as precise).

Shapes: ``T`` tokens, ``N`` hidden size, ``I`` MLP intermediate size, ``Hq``
query heads, ``H`` KV heads (``G = Hq // H`` per group), ``D`` head_dim.
"""

from __future__ import annotations

import torch

from .errors import KernelInputError
from .layout import LayerPages, PageLayout
from .paged_ref import store_kv_ref


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, weight_offset: float = 0.0,
                     out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (``x`` alone when ``residual`` is None), rounded to
    ``residual.dtype``; returns ``(rms_norm(s) * (weight + weight_offset), s)``, both
    ``[T, N]``, the first in ``out_dtype`` (default ``s.dtype``).

    The statistics are float32 over the rounded sum (what the unfused model computes).
    """
    s = x if residual is None else (x.float() + residual.float()).to(residual.dtype)
    sf = s.float()
    normed = sf * torch.rsqrt(sf.square().mean(-1, keepdim=True) + eps)
    return (normed * (weight.float() + weight_offset)).to(out_dtype or s.dtype), s


def silu_mul_ref(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[T, 2I]`` (gate columns first, then up) -> ``silu(gate) * up`` ``[T, I]`` in
    ``out_dtype`` (default: the input's)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(out_dtype or gate_up.dtype)


def _norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, offset: float) -> torch.Tensor:
    if w is None:
        return x
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (w.float() + offset)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half: ``x [T, n, D]``, ``cos``/``sin`` ``[T, D]`` float32."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def qkv_transform_ref(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                      cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float, norm_offset: float = 0.0,
                      k_shift: torch.Tensor | None = None, k_map: torch.Tensor | None = None,
                      q_map: torch.Tensor | None = None, v_shift: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention inputs from the QKV projection's output, all float32.

    Args:
        qkv: ``[T, (Hq + 2H) * D]``: the q, k and v columns of each token.
        cos, sin: ``[T, D]`` RoPE tables of each token's position (HF layout).
        q_norm, k_norm: ``[D]`` QK-norm gains (RMSNorm per head, gain ``w + norm_offset``),
            or None (no QK-norm).
        k_shift: ``[H, D]`` or None; k_map, q_map: ``[H, D, D]`` or None (identity);
            v_shift: ``[H, D]`` or None: a K recipe (``recipes.RecipeParams`` of one layer).
    Returns:
        ``q [T, Hq, D]`` = ``rope(norm(q)) @ q_map``, ``k [T, H, D]`` =
        ``(rope(norm(k)) - k_shift) @ k_map``, ``v [T, H, D]`` = ``v - v_shift``.
    """
    t = qkv.shape[0]
    if qkv.dim() != 2 or num_heads % num_kv_heads or qkv.shape[1] % (num_heads + 2 * num_kv_heads):
        raise KernelInputError(f"qkv must be [T, (Hq + 2H) * D], got {tuple(qkv.shape)} for "
                               f"Hq={num_heads}, H={num_kv_heads}")
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    x = qkv.float()
    q = x[:, :num_heads * d].reshape(t, num_heads, d)
    k = x[:, num_heads * d:(num_heads + num_kv_heads) * d].reshape(t, num_kv_heads, d)
    v = x[:, (num_heads + num_kv_heads) * d:].reshape(t, num_kv_heads, d)
    cos, sin = cos.reshape(t, d).float(), sin.reshape(t, d).float()
    q = _rope(_norm(q, q_norm, eps, norm_offset), cos, sin)
    k = _rope(_norm(k, k_norm, eps, norm_offset), cos, sin)
    if k_shift is not None:
        k = k - k_shift.float()
    if k_map is not None:
        k = torch.einsum("thd,hde->the", k, k_map.float())
    if q_map is not None:
        g = num_heads // num_kv_heads
        q = torch.einsum("thgd,hde->thge", q.reshape(t, num_kv_heads, g, d),
                         q_map.float()).reshape(t, num_heads, d)
    if v_shift is not None:
        v = v - v_shift.float()
    return q, k, v


def qkv_store_ref(layout: PageLayout, pages: LayerPages, qkv: torch.Tensor, num_heads: int,
                  cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: float | torch.Tensor, v_scale: float | torch.Tensor,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                  norm_offset: float = 0.0, k_shift: torch.Tensor | None = None,
                  k_map: torch.Tensor | None = None, q_map: torch.Tensor | None = None,
                  v_shift: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`qkv_transform_ref`, then K and V quantized into their slots (a negative slot
    skips its token); returns q ``[T, Hq, D]`` in ``qkv.dtype``."""
    q, k, v = qkv_transform_ref(qkv, num_heads, layout.num_kv_heads, cos, sin, q_norm, k_norm,
                                eps, norm_offset, k_shift, k_map, q_map, v_shift)
    keep = (slot_mapping >= 0).nonzero().flatten().to(k.device)
    store_kv_ref(layout, pages, k[keep], v[keep], slot_mapping[keep], k_scale, v_scale)
    return q.to(qkv.dtype)
