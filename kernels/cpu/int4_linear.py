"""Weight-only 4-bit and 8-bit linear layers on the CPU, over GGUF's block-quantized weights.

A weight ``w [N, K]`` (``N`` outputs, ``K`` inputs) is held as unsigned 4-bit codes in groups
of ``GROUP`` = 32 along ``K``, each group with its own scale and offset::

    w[n, k] = codes[n, k] * scale[n, k // 32] + offset[n, k // 32]

which is GGUF's Q4_1 block exactly (Q4_0 is ``offset = -8 * scale``). The product runs on
torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``), which reads 0.5 bytes per
weight plus the group parameters: a single-row GEMV moves a quarter of a bf16 weight's bytes.
That kernel computes ``(code - 8) * s + z`` with ``s``, ``z`` in the activation dtype, so
:func:`pack_int4` hands it ``s = scale`` and ``z = offset + 8 * scale``, both rounded to
bf16 (relative error <= 2**-9 per group, the same order as a bf16 weight's own rounding).

8-bit codes (GGUF's Q8_0: ``w = q * scale``, ``q`` in [-128, 127]) run as two 4-bit planes,
``q + 128 = 16 * hi + lo``: ``w = (16 * scale) * hi - 128 * scale + scale * lo``, two int4
products summed (:func:`pack_int8`, :func:`int8_linear`).

The kernel's cost grows with the number of rows (it is a GEMV, not a GEMM): above a few rows a
dense bf16 GEMM over the dequantized weight is faster (``docs/benchmarks.md``). Callers keep
the dense weight for those and pick per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32              # inputs per scale/offset group (GGUF's Q4_0, Q4_1 and Q8_0 block)
ROW_MULTIPLE = 16       # the kernel's tile of N: out_features must be a multiple of it
_INNER_K_TILES = 1      # torch's int4pack tiling of K on the CPU (the only one it takes)


@dataclass(frozen=True)
class Int4Weight:
    """A packed ``[N, K]`` weight for :func:`int4_linear`."""
    packed: torch.Tensor         # uint8 [N, K // 2]: torch's CPU int4pack layout of the codes
    scales_zeros: torch.Tensor   # bf16 [K // 32, N, 2]: (s, z) of each group, see module doc
    out_features: int            # N
    in_features: int             # K

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()


@dataclass(frozen=True)
class Int8Weight:
    """An 8-bit ``[N, K]`` weight as two 4-bit planes (module doc)."""
    hi: Int4Weight               # codes (q + 128) >> 4, scale 16 * s, offset -128 * s
    lo: Int4Weight               # codes (q + 128) & 15, scale s, offset 0

    @property
    def out_features(self) -> int:
        return self.hi.out_features

    @property
    def in_features(self) -> int:
        return self.hi.in_features

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes


def _check_groups(codes: torch.Tensor, *per_group: torch.Tensor) -> tuple[int, int]:
    if codes.dim() != 2 or codes.device.type != "cpu":
        raise ValueError(f"codes must be a 2-D CPU tensor, got {tuple(codes.shape)} on "
                         f"{codes.device}")
    n, k = codes.shape
    if k % GROUP or k == 0:
        raise ValueError(f"in_features {k} is not a positive multiple of {GROUP}")
    for t in per_group:
        if tuple(t.shape) != (n, k // GROUP):
            raise ValueError(f"group parameters must be [{n}, {k // GROUP}], got "
                             f"{tuple(t.shape)}")
    return n, k


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Int4Weight:
    """Pack ``codes`` (uint8 ``[N, K]``, values 0..15) with fp32 ``scale`` and ``offset``
    ``[N, K // 32]`` into torch's CPU int4 layout."""
    n, k = _check_groups(codes, scale, offset)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if n % ROW_MULTIPLE:
        raise ValueError(f"out_features {n} is not a multiple of {ROW_MULTIPLE}")
    if int(codes.max()) > 15:
        raise ValueError("4-bit codes must lie in 0..15")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).contiguous(), _INNER_K_TILES)
    s = scale.float()
    z = offset.float() + 8.0 * s
    scales_zeros = torch.stack([s.t(), z.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Weight(packed, scales_zeros, n, k)


def pack_int8(codes: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    """Pack ``codes`` (int8 ``[N, K]``) with fp32 ``scale [N, K // 32]`` as two planes."""
    _check_groups(codes, scale)
    if codes.dtype != torch.int8:
        raise ValueError(f"codes must be int8, got {codes.dtype}")
    u = codes.to(torch.int32) + 128
    hi, lo = (u >> 4).to(torch.uint8), (u & 15).to(torch.uint8)
    s = scale.float()
    return Int8Weight(pack_int4(hi, 16.0 * s, -128.0 * s), pack_int4(lo, s, torch.zeros_like(s)))


def _check_x(x: torch.Tensor, in_features: int) -> None:
    if not x.is_cpu or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be a bf16 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [M, {in_features}], got {tuple(x.shape)}")


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` bf16 @ ``w.T`` -> ``[M, N]`` bf16 (fp32 accumulation), plus ``bias``."""
    _check_x(x, w.in_features)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), w.packed, GROUP,
                                                  w.scales_zeros)
    return y if bias is None else y + bias


def int8_linear(x: torch.Tensor, w: Int8Weight, out_dtype: torch.dtype = torch.bfloat16
                ) -> torch.Tensor:
    """``x [M, K]`` bf16 @ ``w.T`` -> ``[M, N]`` in ``out_dtype``: the two planes' bf16
    products summed in float32, rounded once into ``out_dtype``."""
    return (int4_linear(x, w.hi).float() + int4_linear(x, w.lo).float()).to(out_dtype)


def dequant_ref(codes: torch.Tensor, scale: torch.Tensor,
                offset: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[N, K]`` weight of 4-bit (with ``offset``) or 8-bit (without) codes."""
    n, k = codes.shape
    w = codes.float().view(n, k // GROUP, GROUP) * scale.float()[..., None]
    if offset is not None:
        w = w + offset.float()[..., None]
    return w.view(n, k)


def linear_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
               offset: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`int4_linear` (``offset`` given) and :func:`int8_linear`: fp32
    math over the exact weight, ``[M, N]`` float32."""
    return x.float() @ dequant_ref(codes, scale, offset).t()
