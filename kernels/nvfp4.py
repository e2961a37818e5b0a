"""NVFP4 reference quantizer (torch, any device).

Format
------
* Values are grouped in blocks of ``BLOCK = 16`` consecutive elements along the
  last dimension (head_dim for KV).
* Each element is an E2M1 code (1 sign bit, 3 magnitude bits): magnitudes
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``. Two codes share one byte: element ``2i`` in
  the low nibble, element ``2i+1`` in the high nibble.
* Each block has one FP8 E4M3 scale, stored as its raw byte (``uint8``).
* One FP32 ``global_scale`` per tensor (per layer for K and per layer for V).

Quantize: ``scale = e4m3(amax / 6 / global_scale)`` (round to nearest even,
saturating at 448); each value is multiplied by the fp32 reciprocal of
``float(scale) * global_scale`` (one IEEE division per block, as production
quantizers do; an overflowing reciprocal is clamped to the largest finite fp32)
and the fp32 product is rounded to the nearest E2M1 value, ties to even,
saturating at +-6. A block whose rounded scale is 0 (all zeros, or too small
for E4M3) encodes as zeros.
The sign bit is the IEEE sign of the input, so ``-0.0`` and tiny negatives give
code ``0x8`` (negative zero), as the hardware ``cvt.rn.satfinite.e2m1x2`` does.

Dequantize: ``(e2m1 * float(scale)) * global_scale`` in FP32, then cast.
"""

from __future__ import annotations

import math

import torch

from .errors import KernelInputError, NonFiniteInputError

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Magnitude of each 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision points between neighbouring magnitudes. ``strict`` means the tie
# goes down (the lower code is even); otherwise the tie goes up.
_THRESHOLDS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False),
               (2.5, True), (3.5, False), (5.0, True))


def _check_global_scale(global_scale: float | torch.Tensor) -> torch.Tensor:
    if isinstance(global_scale, float) and math.isfinite(global_scale) and global_scale > 0:
        return torch.tensor(global_scale, dtype=torch.float32)
    gs = torch.as_tensor(global_scale, dtype=torch.float32)
    if gs.numel() != 1 or not torch.isfinite(gs).all() or gs.item() <= 0:
        raise KernelInputError(f"global_scale must be one finite value > 0, got {global_scale!r}")
    return gs.reshape(())


_PAIR_LUT: dict[torch.device, torch.Tensor] = {}


def _pair_lut(device: torch.device) -> torch.Tensor:
    """float32 [256, 2]: the two E2M1 values (low nibble, high nibble) of every byte."""
    lut = _PAIR_LUT.get(device)
    if lut is None:
        b = torch.arange(256, dtype=torch.uint8)
        lut = torch.stack((e2m1_decode(b & 0x0F), e2m1_decode(b >> 4)), dim=-1).to(device)
        _PAIR_LUT[device] = lut
    return lut


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round FP32 values to E4M3 (RNE, saturating at +-448); returns float8_e4m3fn."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def block_reciprocal(scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """fp32 ``1 / (float(scale) * gs)`` per block (IEEE division), 0 where that product is 0.

    Args:
        scale: float8_e4m3fn block scales ``[...]``.
        gs: fp32 global scale (0-d, same device).
    Returns:
        float32 ``[...]``. A reciprocal that overflows is clamped to the largest
        finite fp32, so that zeros in its block still encode as (signed) zero.
    """
    denom = scale.float() * gs
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    inv = (torch.ones_like(safe) / safe).clamp(max=torch.finfo(torch.float32).max)
    return torch.where(denom > 0, inv, torch.zeros_like(inv))


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """Round FP32 values (already multiplied by their block reciprocal) to 4-bit E2M1 codes.

    Args:
        q: float32 tensor of any shape, not NaN (+-inf saturates).
    Returns:
        uint8 tensor of the same shape with values 0..15 (bit 3 = sign).
    """
    mag = q.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for threshold, strict in _THRESHOLDS:
        code += (mag > threshold if strict else mag >= threshold).to(torch.uint8)
    sign = torch.signbit(q).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) to their FP32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] uint8 codes -> [..., n] bytes, even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] uint8 codes (inverse of :func:`pack_nibbles`)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def quantize_nvfp4(x: torch.Tensor, global_scale: float | torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4.

    Args:
        x: floating tensor ``[..., D]`` (fp32, bf16, fp16 or fp8), ``D % 16 == 0``.
        global_scale: one positive finite FP32 value.
    Returns:
        ``(codes, scales)``: ``codes`` uint8 ``[..., D // 2]`` (two E2M1 per byte)
        and ``scales`` uint8 ``[..., D // 16]`` (raw E4M3 bytes).
    Raises:
        NonFiniteInputError: ``x`` holds NaN or inf.
        KernelInputError: bad shape, dtype or global scale.
    """
    if not x.is_floating_point():
        raise KernelInputError(f"quantize_nvfp4 expects a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise KernelInputError(f"last dim must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    gs = _check_global_scale(global_scale).to(x.device)
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise NonFiniteInputError("NVFP4 quantize got NaN or inf input")
    blocks = xf.unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(dim=-1)
    scale = e4m3_round(amax / E2M1_MAX / gs)
    q = blocks * block_reciprocal(scale, gs).unsqueeze(-1)
    codes = e2m1_encode(q).flatten(-2)
    return pack_nibbles(codes), scale.view(torch.uint8)


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor,
                     global_scale: float | torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`.

    Args:
        codes: uint8 ``[..., D // 2]``.
        scales: uint8 ``[..., D // 16]`` (raw E4M3 bytes).
        global_scale: the value used to quantize.
        dtype: output dtype.
    Returns:
        ``[..., D]`` tensor of ``dtype``.
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise KernelInputError(f"codes and scales must be uint8, got {codes.dtype}, {scales.dtype}")
    if codes.shape[:-1] != scales.shape[:-1] or codes.shape[-1] != scales.shape[-1] * BLOCK // 2:
        raise KernelInputError(
            f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match")
    gs = _check_global_scale(global_scale).to(codes.device)
    # One table lookup per byte yields both of its values (low nibble first).
    values = _pair_lut(codes.device)[codes.long()].flatten(-2).unflatten(-1, (-1, BLOCK))
    scale = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    return ((values * scale) * gs).flatten(-2).to(dtype)
