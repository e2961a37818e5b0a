"""Fused elementwise kernels of a decoder layer (portable Triton; CPU through the interpreter).

* :func:`add_rms_norm`: the residual add fused with the next RMSNorm (one read of each
  input, one write of each output instead of about eight kernels);
* :func:`silu_mul`: SwiGLU's ``silu(gate) * up`` from the fused gate/up projection.

References: :func:`nibble.kernels.fused_ref.add_rms_norm_ref`,
:func:`~nibble.kernels.fused_ref.silu_mul_ref`. Both compute in float32 and round
once into the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ._common import FLOAT_DTYPES


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, n, eps, w_off,
                         sx, sr, so, sro, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: ``s = x + r`` (rounded to the residual dtype), ``out = s *
    rsqrt(mean(s^2) + eps) * (w + w_off)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        s = x + tl.load(r_ptr + row * sr + cols, mask=m, other=0.0).to(tl.float32)
        s_out = s.to(rout_ptr.dtype.element_ty)
        tl.store(rout_ptr + row * sro + cols, s_out, mask=m)
        x = s_out.to(tl.float32)
    ms = tl.sum(x * x, axis=0) / n
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) + w_off
    y = x * (1.0 / tl.sqrt(ms + eps)) * w
    tl.store(out_ptr + row * so + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    if t.dim() != 2 or t.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"{name} must be a 2-D bf16/fp16/fp32 tensor, got {t.dtype} "
                               f"{tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise KernelInputError(f"{name} must be {list(shape)}, got {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise KernelInputError(f"{name} rows must be contiguous, strides {t.stride()}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, weight_offset: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm in one launch (no host sync).

    Args:
        x: ``[T, N]`` bf16/fp16/fp32, unit inner stride (the sublayer's output).
        residual: ``[T, N]``, same dtype and device, or None (the first layer: no add).
        weight: ``[N]`` RMSNorm gain (any float dtype); the gain is ``weight + weight_offset``
            (1.0 for Gemma's ``1 + w`` norms).
        eps: added to the mean square.
    Returns:
        ``(normed [T, N], s [T, N])`` in ``x.dtype``: ``s = x + residual`` rounded to
        ``x.dtype`` (``x`` itself when ``residual`` is None) is the next residual.
    """
    _check_rows("x", x)
    t, n = x.shape
    if residual is not None:
        _check_rows("residual", residual, (t, n))
        if residual.dtype != x.dtype or residual.device != x.device:
            raise KernelInputError(f"residual must be {x.dtype} on {x.device}, got "
                                   f"{residual.dtype} on {residual.device}")
    if weight.shape != (n,) or weight.device != x.device or not weight.is_floating_point():
        raise KernelInputError(f"weight must be a float [{n}] on {x.device}, got "
                               f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
    if weight.stride(0) != 1:
        raise KernelInputError("weight must be contiguous")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is None:
        s, rr = x, x
    else:
        s, rr = torch.empty_like(out), residual
    if t == 0:
        return out, s
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(t,)](x, rr, weight, out, s, n, float(eps), float(weight_offset),
                               x.stride(0), rr.stride(0), out.stride(0), s.stride(0),
                               HAS_RES=residual is not None, BLOCK=block,
                               num_warps=max(1, min(16, block // 256)))
    return out, s


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, sx, so, BLOCK: tl.constexpr):
    """Program ``(row, chunk)``: ``out[row, c] = silu(x[row, c]) * x[row, inter + c]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * sx + inter + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * so + cols, y.to(out_ptr.dtype.element_ty), mask=m)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2I]`` (bf16/fp16/fp32, unit inner stride; gate columns first) ->
    ``silu(gate) * up`` ``[T, I]`` in the same dtype, one launch."""
    _check_rows("gate_up", gate_up)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise KernelInputError(f"gate_up must have an even number of columns, got {two_i}")
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or inter == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block,
        num_warps=max(1, min(8, block // 256)))
    return out
