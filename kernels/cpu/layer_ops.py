"""Residual add + RMSNorm and SiLU-and-mul on the CPU, one C call each (``csrc/layer_ops.c``).

The CPU counterparts of ``kernels/triton/layer_ops``, with the same contracts; their torch
references are ``kernels/fused_ref.add_rms_norm_ref`` and ``silu_mul_ref`` (float32 math, one
rounding into each output's dtype). At a decode step's few rows a torch add and RMSNorm cost
about 17 us of op dispatch on this repo's 2-core machines, SiLU-and-mul about 10 us; a call
costs about 4 us plus these wrappers' checks.

Rows are float32 or bfloat16 (``T`` tokens, ``N`` hidden size, ``I`` MLP intermediate size),
each tensor in its own dtype: a float32 model whose projections multiply bf16 rows
(``--quantization gguf``) hands their bf16 outputs over as they are and asks for the next
projection's input in bf16, which is what converting around the calls would give.
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
        lib.nb_add_rms_norm.argtypes = [_P, _I64, _I, _P, _I64, _P, _I, _F, _F, _I64, _I64,
                                        _P, _I64, _I, _P, _I64, _I]
        lib.nb_add_rms_norm.restype = _I
        lib.nb_silu_mul.argtypes = [_P, _I64, _P, _I64, _I, _I64, _I64, _P, _I64, _I]
        lib.nb_silu_mul.restype = _I
    return lib


_FNS: list = []      # (nb_add_rms_norm, nb_silu_mul) once loaded: called per layer and step


def _functions() -> tuple:
    if not _FNS:
        lib = _library()
        if lib is None:
            raise KernelInputError("the CPU layer ops are not available (no C compiler?)")
        _FNS.append((lib.nb_add_rms_norm, lib.nb_silu_mul))
    return _FNS[0]


def available() -> bool:
    """The C library is built (or can be) on this machine."""
    return _library() is not None


def _rows(name: str, t: torch.Tensor, shape: tuple[int, int] | None = None) -> None:
    """Raises unless ``t`` is a 2-D float32/bf16 CPU tensor with unit inner stride (and
    ``shape`` where given). Cheap attribute reads only: it runs per call."""
    if not (t.is_cpu and t.dim() == 2 and t.dtype in _DTYPES and t.stride(1) == 1
            and (shape is None or t.shape == shape)):
        raise KernelInputError(
            f"{name} must be a 2-D float32/bfloat16 CPU tensor with unit inner stride"
            + (f" of shape {list(shape)}" if shape is not None else "")
            + f", got {t.dtype} {tuple(t.shape)} {t.stride()} on {t.device}")


def _out_dtype(out_dtype: torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if out_dtype is None:
        return default
    if out_dtype not in _DTYPES:
        raise KernelInputError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    return out_dtype


def _call(fn, *args) -> None:
    if fn(*args) != 0:
        raise KernelInputError(f"{fn.__name__} refused its arguments")


def _weight(weight: torch.Tensor, n: int) -> torch.Tensor:
    """``weight`` as the C call reads it: float32 or bf16, contiguous ``[n]``."""
    if not (weight.is_cpu and weight.dim() == 1 and weight.shape[0] == n
            and weight.is_floating_point()):
        raise KernelInputError(f"weight must be a float CPU [{n}], got {weight.dtype} "
                               f"{tuple(weight.shape)} on {weight.device}")
    return weight if weight.dtype in _DTYPES and weight.is_contiguous() else \
        weight.float().contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, weight_offset: float = 0.0, out_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, N]`` (+ ``residual [T, N]``) -> ``(normed [T, N], s [T, N])``: ``s = x +
    residual`` rounded to ``residual.dtype`` (``x`` itself when ``residual`` is None), the
    next residual, and ``rms_norm(s) * (weight + weight_offset)`` in ``out_dtype`` (default:
    ``s.dtype``). ``weight`` is a float ``[N]``, read as it is when float32 or bfloat16 and
    contiguous."""
    norm, _ = _FNS[0] if _FNS else _functions()
    _rows("x", x)
    t, n = x.shape
    if residual is not None:
        _rows("residual", residual, x.shape)
    w = _weight(weight, n)
    s = x if residual is None else torch.empty((t, n), dtype=residual.dtype)
    out = torch.empty((t, n), dtype=_out_dtype(out_dtype, s.dtype))
    if t:
        _call(norm, x.data_ptr(), x.stride(0), _DTYPES[x.dtype],
              None if residual is None else residual.data_ptr(),
              0 if residual is None else residual.stride(0), w.data_ptr(), _DTYPES[w.dtype],
              weight_offset, eps, t, n, s.data_ptr(), n, _DTYPES[s.dtype], out.data_ptr(), n,
              _DTYPES[out.dtype])
    return out, s


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """``gate``, ``up`` ``[T, I]`` (same dtype; two tensors, or the halves of one fused
    ``[T, 2I]`` output) -> ``silu(gate) * up`` ``[T, I]`` in ``out_dtype`` (default: theirs):
    float32 math, one rounding (``fused_ref.silu_mul_ref`` of the two side by side). The exp
    is a vectorized polynomial on AVX512 CPUs (a few fp32 ulps from torch's), ``expf``
    elsewhere."""
    _, fn = _FNS[0] if _FNS else _functions()
    _rows("gate", gate)
    _rows("up", up, gate.shape)
    if up.dtype != gate.dtype:
        raise KernelInputError(f"gate and up must share a dtype, got {gate.dtype} and {up.dtype}")
    t, n = gate.shape
    out = torch.empty((t, n), dtype=_out_dtype(out_dtype, gate.dtype))
    if t:
        _call(fn, gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
              _DTYPES[gate.dtype], t, n, out.data_ptr(), n, _DTYPES[out.dtype])
    return out
