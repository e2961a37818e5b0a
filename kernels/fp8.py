"""FP8 E4M3 reference quantizer with one FP32 scale per tensor (per layer).

Quantize: ``e4m3(x / scale)``, RNE, saturating at +-448; stored as raw bytes.
Dequantize: ``float(code) * scale``.
"""

from __future__ import annotations

import torch

from .errors import KernelInputError, NonFiniteInputError
from .nvfp4 import E4M3_MAX, _check_global_scale


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``x`` floating ``[...]`` -> uint8 ``[...]`` raw E4M3 bytes."""
    if not x.is_floating_point():
        raise KernelInputError(f"quantize_fp8 expects a floating tensor, got {x.dtype}")
    s = _check_global_scale(scale).to(x.device)
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise NonFiniteInputError("FP8 quantize got NaN or inf input")
    return (xf / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_fp8(data: torch.Tensor, scale: float | torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 raw E4M3 bytes ``[...]`` -> ``dtype`` ``[...]``."""
    if data.dtype != torch.uint8:
        raise KernelInputError(f"FP8 data must be uint8 bytes, got {data.dtype}")
    s = _check_global_scale(scale).to(data.device)
    return (data.view(torch.float8_e4m3fn).float() * s).to(dtype)
