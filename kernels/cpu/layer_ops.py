"""Residual add + RMSNorm on the CPU in one C call (``csrc/layer_ops.c``).

The CPU counterpart of ``kernels/triton/layer_ops.add_rms_norm``, with the same contract; its
torch reference is ``kernels/fused_ref.add_rms_norm_ref`` (float32 math, one rounding into the
row dtype). At a decode step's few rows a torch add and RMSNorm cost about 17 us of op dispatch
on this repo's 2-core machines; the call costs about a third of that.

Rows are float32 or bfloat16 (``T`` tokens, ``N`` hidden size).
"""

from __future__ import annotations

import ctypes

import torch

from ..errors import KernelInputError
from .build import load

_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _library():
    lib = load("layer_ops")
    if lib is not None and lib.nb_add_rms_norm.argtypes is None:
        lib.nb_add_rms_norm.argtypes = [_P, _I64, _P, _I64, _P, _I, _F, _F, _I64, _I64,
                                        _P, _I64, _P, _I64, _I]
        lib.nb_add_rms_norm.restype = _I
    return lib


def available() -> bool:
    """The C library is built (or can be) on this machine."""
    return _library() is not None


def _rows(name: str, t: torch.Tensor, shape: tuple[int, int] | None = None,
          dtype: torch.dtype | None = None) -> None:
    if t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1 or t.dtype not in _DTYPES:
        raise KernelInputError(f"{name} must be a 2-D float32/bfloat16 CPU tensor with unit "
                               f"inner stride, got {t.dtype} {tuple(t.shape)} {t.stride()} "
                               f"on {t.device}")
    if shape is not None and tuple(t.shape) != shape:
        raise KernelInputError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise KernelInputError(f"{name} must be {dtype}, got {t.dtype}")


def _call(fn, *args) -> None:
    if fn(*args) != 0:
        raise KernelInputError(f"{fn.__name__} refused its arguments")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, N]`` (+ ``residual [T, N]``, same dtype) -> ``(normed [T, N], s [T, N])``:
    ``s = x + residual`` rounded to ``x.dtype`` (``x`` itself when ``residual`` is None), the
    next residual, and ``rms_norm(s) * (weight + weight_offset)``. ``weight`` is a float
    ``[N]``, read as it is when float32 or bfloat16 and contiguous."""
    lib = _library()
    if lib is None:
        raise KernelInputError("the CPU layer ops are not available (no C compiler?)")
    _rows("x", x)
    t, n = x.shape
    if residual is not None:
        _rows("residual", residual, (t, n), x.dtype)
    if weight.shape != (n,) or not weight.is_floating_point() or weight.device.type != "cpu":
        raise KernelInputError(f"weight must be a float CPU [{n}], got {weight.dtype} "
                               f"{tuple(weight.shape)} on {weight.device}")
    w = weight if weight.dtype in _DTYPES and weight.is_contiguous() else \
        weight.float().contiguous()
    s = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty((t, n), dtype=x.dtype)
    if t:
        _call(lib.nb_add_rms_norm, x.data_ptr(), x.stride(0),
              None if residual is None else residual.data_ptr(),
              0 if residual is None else residual.stride(0), w.data_ptr(), _DTYPES[w.dtype],
              weight_offset, eps,
              t, n, s.data_ptr(), s.stride(0), out.data_ptr(), n, _DTYPES[x.dtype])
    return out, s
