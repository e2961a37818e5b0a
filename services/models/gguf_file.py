"""Reading GGUF files: metadata, and dequantized tensors under HF names.

The header (key/values and tensor directory) is parsed here directly: it is a
simple little-endian layout, and ``gguf.GGUFReader`` spends seconds turning the
~100k vocabulary strings into numpy views. Dequantization uses
``gguf.quants.dequantize`` on zero-copy views of the memory-mapped file.

llama.cpp's converter reorders the rows of the Q and K projections of
llama-architecture models (per head it interleaves the two rotary halves, for
its GPT-J style RoPE). ``iter_weights`` undoes that so the rotate_half RoPE of
``CausalLM`` applies. Qwen2/Qwen3 GGUFs are stored unpermuted.

Gemma 3 GGUFs are unpermuted too, but name the norms differently (``ffn_norm``
is the *pre*-feedforward norm, plus ``post_attention_norm`` and
``post_ffw_norm``) and store every RMSNorm gain as ``1 + w``; ``iter_weights``
maps the names and subtracts the 1, as transformers' GGUF loader does.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value type -> struct format (8 = string, 9 = array are handled apart).
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_NP_DTYPE = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
             6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3: its four per-layer norms (the rest of _BLOCK_NAMES applies unchanged).
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # per-frequency divisors (Llama 3.1 style scaling)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]     # row-major (HF) order: ggml dims reversed
    qtype: int                 # gguf.GGMLQuantizationType value
    raw: np.ndarray            # uint8 view of the mmap, shape (*shape[:-1], bytes per row)


class GGUFFile:
    """A parsed GGUF file: ``metadata`` dict and ``tensors`` (raw views into the mmap)."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata: dict[str, Any] = {}
            self.tensors: list[GGUFTensor] = []
            self._parse()
        except (OSError, ValueError, struct.error, UnicodeDecodeError, KeyError) as e:
            raise ModelLoadError(f"cannot read GGUF file {path}: {e!r}") from e

    def _parse(self) -> None:
        buf = self._mm
        if buf[:4] != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (need >= 2)")
        off = 24
        for _ in range(n_kv):
            key, off = self._string(off)
            (vtype,), off = struct.unpack_from("<I", buf, off), off + 4
            self.metadata[key], off = self._value(vtype, off)
        infos = []
        for _ in range(n_tensors):
            name, off = self._string(off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            qtype, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, dims, qtype, rel))
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align}")
        data_start = -(-off // align) * align
        self.tensors = [self._tensor(n, d, q, data_start + r) for n, d, q, r in infos]

    def _string(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._mm, off)
        return self._mm[off + 8: off + 8 + n].decode("utf-8"), off + 8 + n

    def _value(self, vtype: int, off: int) -> tuple[Any, int]:
        if vtype in _SCALAR_FMT:
            fmt = _SCALAR_FMT[vtype]
            value = struct.unpack_from(fmt, self._mm, off)[0]
            if vtype == 6:  # float32: shortest decimal that rounds to it (1e-06, not 9.99999997e-07)
                value = float(str(np.float32(value)))
            return value, off + struct.calcsize(fmt)
        if vtype == 8:
            return self._string(off)
        if vtype != 9:
            raise ValueError(f"unknown GGUF value type {vtype}")
        etype, count = struct.unpack_from("<IQ", self._mm, off)
        off += 12
        if etype in _NP_DTYPE:
            dt = np.dtype(_NP_DTYPE[etype])
            arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=off)
            return arr.tolist(), off + count * dt.itemsize
        out = []
        for _ in range(count):
            item, off = self._value(etype, off)
            out.append(item)
        return out, off

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: int, start: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        shape = tuple(int(d) for d in reversed(dims))
        row_bytes = shape[-1] // block * type_size
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=rows * row_bytes, offset=start)
        return GGUFTensor(name, shape, qtype, raw.reshape(*shape[:-1], row_bytes))

    def dequantize(self, t: GGUFTensor) -> torch.Tensor:
        """float32 CPU tensor of shape ``t.shape`` (a private copy, writable)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            arr = dequantize(t.raw, GGMLQuantizationType(t.qtype))
        except NotImplementedError as e:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has unsupported type "
                                 f"{GGMLQuantizationType(t.qtype).name}") from e
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(t.shape)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only mmap
            arr = arr.copy()
        return torch.from_numpy(arr)


# GGML block types whose weights keep their codes on the CPU (``weight_quant.py``):
# type -> (bytes per 32-value block, has an fp16 offset after the scale, code bits).
_BLOCK_TYPES = {2: (18, False, 4), 3: (20, True, 4), 8: (34, False, 8)}  # Q4_0, Q4_1, Q8_0
BLOCK = 32


@dataclass(frozen=True)
class BlockCodes:
    """A Q4_0 / Q4_1 / Q8_0 tensor's own codes: ``w = codes * scale (+ offset)`` per group of
    32 along the last dim (``kernels/cpu/int4_linear.py``)."""
    codes: torch.Tensor            # uint8 [rows, K] in 0..15 (4-bit) or int8 [rows, K] (8-bit)
    scale: torch.Tensor            # float32 [rows, K // 32]
    offset: torch.Tensor | None    # float32 [rows, K // 32] (4-bit), None (8-bit)


def is_4bit_block(t: GGUFTensor) -> bool:
    """Whether ``t`` is a Q4_0 or Q4_1 tensor (:func:`block_codes` gives its codes)."""
    spec = _BLOCK_TYPES.get(t.qtype)
    return spec is not None and spec[2] == 4


def block_codes(t: GGUFTensor) -> BlockCodes | None:
    """The codes and group parameters of a 2-D Q4_0, Q4_1 or Q8_0 tensor; None for any other
    type. Q4_0's ``(q - 8) * d`` becomes ``offset = -8 * d``."""
    spec = _BLOCK_TYPES.get(t.qtype)
    if spec is None or len(t.shape) != 2:
        return None
    nbytes, has_min, bits = spec
    rows, k = t.shape
    blocks = t.raw.reshape(rows, k // BLOCK, nbytes)
    head = 4 if has_min else 2
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    body = blocks[..., head:]
    if bits == 8:
        return BlockCodes(torch.from_numpy(body.copy().view(np.int8).reshape(rows, k)), scale, None)
    codes = np.concatenate([body & 15, body >> 4], axis=-1).reshape(rows, k)  # llama.cpp order
    if has_min:
        offset = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]
                                  .astype(np.float32))
    else:
        offset = -8.0 * scale
    return BlockCodes(torch.from_numpy(np.ascontiguousarray(codes)), scale, offset)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF checkpoint name for a GGUF tensor name; None for tensors loaded elsewhere."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block_names = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"
    if gguf_name == ROPE_FREQS:
        return None
    raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row order in ``w [n_heads * D, ...]`` (or a bias ``[n_heads * D]``).

    llama.cpp stores, per head, row ``2 * j + i`` for HF row ``i * D/2 + j``
    (``i`` in {0, 1} selects the rotary half).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_weights(f: GGUFFile, arch: str, num_heads: int, num_kv_heads: int
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every model tensor, Q/K rows restored
    (llama) or norm gains turned back from ``1 + w`` into ``w`` (gemma3)."""
    for t in f.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        w = f.dequantize(t)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0
        elif arch == "llama" and ".attn_q." in t.name:
            w = unpermute_rows(w, num_heads)
        elif arch == "llama" and ".attn_k." in t.name:
            w = unpermute_rows(w, num_kv_heads)
        yield name, w


def rope_freq_factors(f: GGUFFile) -> tuple[float, ...] | None:
    """The ``rope_freqs.weight`` divisors ``[head_dim // 2]`` if the file has them."""
    for t in f.tensors:
        if t.name == ROPE_FREQS:
            return tuple(float(x) for x in f.dequantize(t).reshape(-1).tolist())
    return None
