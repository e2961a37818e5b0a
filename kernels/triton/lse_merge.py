"""Two or three partial attentions over disjoint key sets merged by their log-sum-exp, in
one launch.

The cuDNN prefill route (:mod:`nibble.kernels.ragged_cudnn`) attends a chunk over its
prefix (in one or two unmasked parts) and over its own causal square in dense calls;
:func:`merge_lse_into` combines them and writes the result straight into the step's
``[T, Hq, D]`` output rows, where the torch form (:func:`~nibble.kernels.ragged_cudnn.merge_by_lse`
plus the copy) runs about ten elementwise kernels over fp32 temporaries. Reference:
:func:`~nibble.kernels.ragged_cudnn.merge_into`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ._common import FLOAT_DTYPES

BLOCK_ROWS = 32


@triton.jit
def _merge_kernel(out_ptr, o1_ptr, l1_ptr, o2_ptr, l2_ptr, o3_ptr, l3_ptr, n,
                  so_t, so_h, s1_h, s1_s, s2_h, s2_s, s3_h, s3_s, sl1_h, sl2_h, sl3_h,
                  D: tl.constexpr, BLOCK: tl.constexpr, THREE: tl.constexpr):
    """Program ``(row block, head)``: ``out = sum_i o_i e^(l_i - m) / sum_i e^(l_i - m)``,
    ``m = max_i l_i``, over two parts (three with ``THREE``), in fp32, rounded once to the
    output dtype."""
    h = tl.program_id(1).to(tl.int64)
    s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = s < n
    d = tl.arange(0, D)[None, :]
    a = tl.load(l1_ptr + h * sl1_h + s, mask=m, other=0.0)
    b = tl.load(l2_ptr + h * sl2_h + s, mask=m, other=0.0)
    mx = tl.maximum(a, b)
    if THREE:
        c = tl.load(l3_ptr + h * sl3_h + s, mask=m, other=0.0)
        mx = tl.maximum(mx, c)
    w1 = tl.exp(a - mx)
    w2 = tl.exp(b - mx)
    x1 = tl.load(o1_ptr + h * s1_h + s[:, None] * s1_s + d, mask=m[:, None], other=0.0)
    x2 = tl.load(o2_ptr + h * s2_h + s[:, None] * s2_s + d, mask=m[:, None], other=0.0)
    acc = x1.to(tl.float32) * w1[:, None] + x2.to(tl.float32) * w2[:, None]
    den = w1 + w2
    if THREE:
        w3 = tl.exp(c - mx)
        x3 = tl.load(o3_ptr + h * s3_h + s[:, None] * s3_s + d, mask=m[:, None], other=0.0)
        acc += x3.to(tl.float32) * w3[:, None]
        den += w3
    o = acc / den[:, None]
    tl.store(out_ptr + s[:, None] * so_t + h * so_h + d, o.to(out_ptr.dtype.element_ty),
             mask=m[:, None])


def _check(out: torch.Tensor, parts: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    if out.dim() != 3 or out.dtype not in FLOAT_DTYPES or out.stride(2) != 1:
        raise KernelInputError(f"out must be [n, Hq, D] bf16/fp16/fp32 with unit inner stride, "
                               f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    n, hq, d = out.shape
    if d & (d - 1):
        raise KernelInputError(f"head_dim must be a power of two, got {d}")
    for i, o, lse in parts:
        if (o.dim() != 4 or o.shape[0] != 1 or o.shape[1] != hq or o.shape[2] < n
                or o.shape[3] != d or o.dtype not in FLOAT_DTYPES or o.stride(3) != 1):
            raise KernelInputError(f"o{i} must be [1, {hq}, >= {n}, {d}] float with unit inner "
                                   f"stride, got {o.dtype} {tuple(o.shape)} strides {o.stride()}")
        if (lse.dim() != 3 or lse.shape[:2] != (1, hq) or lse.shape[2] < n
                or lse.dtype != torch.float32 or lse.stride(2) != 1):
            raise KernelInputError(f"lse{i} must be fp32 [1, {hq}, >= {n}] with unit inner "
                                   f"stride, got {lse.dtype} {tuple(lse.shape)}")
        if o.device != out.device or lse.device != out.device:
            raise KernelInputError(f"all tensors must be on {out.device}")


def merge_lse_into(out: torch.Tensor, o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                   lse2: torch.Tensor, o3: torch.Tensor | None = None,
                   lse3: torch.Tensor | None = None) -> torch.Tensor:
    """Writes the merge of two (or three) partial attentions into ``out`` (no host sync).

    Args:
        out: ``[n, Hq, D]`` bf16/fp16/fp32, unit inner stride (a slice of the step's rows).
        o1, o2, o3: ``[1, Hq, S, D]`` (``S >= n``; rows past ``n`` are ignored), any float
            dtype and strides with a unit inner one; each normalised over its own keys.
            ``o3`` optional.
        lse1, lse2, lse3: fp32 ``[1, Hq, S]``, unit inner stride: the log-sum-exp of each
            part's scaled scores (natural log, as cuDNN returns it); ``lse3`` with ``o3``.
    Returns:
        ``out``.
    Raises:
        KernelInputError: a bad shape, dtype, stride or device, or ``o3`` without ``lse3``.
    """
    if (o3 is None) != (lse3 is None):
        raise KernelInputError("o3 and lse3 come together")
    parts = [(1, o1, lse1), (2, o2, lse2)] + ([(3, o3, lse3)] if o3 is not None else [])
    _check(out, parts)
    n, hq, d = out.shape
    if n == 0:
        return out
    three = o3 is not None
    o3, lse3 = (o3, lse3) if three else (o2, lse2)        # unread without THREE
    grid = (triton.cdiv(n, BLOCK_ROWS), hq)
    _merge_kernel[grid](out, o1, lse1, o2, lse2, o3, lse3, n, out.stride(0), out.stride(1),
                        o1.stride(1), o1.stride(2), o2.stride(1), o2.stride(2),
                        o3.stride(1), o3.stride(2), lse1.stride(1), lse2.stride(1),
                        lse3.stride(1), D=d, BLOCK=BLOCK_ROWS, THREE=three)
    return out
