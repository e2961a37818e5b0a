"""Dequant-gather for the extend path: cached pages -> packed K/V workspace (portable Triton).

One launch covers the whole batch: program ``(tile, head, seq)`` dequantizes
``BLOCK_T`` tokens of one KV head of one sequence and writes them at row
``cu_seqlens[seq] + token`` of the workspace. Values equal
:func:`nibble.kernels.paged_ref.gather_kv_ref` bit for bit (FP8 outputs saturate
at +-448 where the reference would give NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout
from ._common import (bf16_rne, check_block_tables, check_int_vector, check_pages, e2m1_hi_f16,
                      e2m1_lo_f16, e4m3_encode, e4m3_to_f16, element_codes, hw_fp8,
                      scale_tensor, typed_data)

BLOCK_T = 32  # tokens per program
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}


@triton.jit
def _convert_out(x, OUT: tl.constexpr, HW: tl.constexpr):
    """fp32 -> the workspace element type (raw bytes for FP8)."""
    if OUT == 0:
        return x
    elif OUT == 1:
        return bf16_rne(x, HW)
    elif OUT == 2:
        return x.to(tl.float16)
    else:
        return e4m3_encode(x, HW)


@triton.jit
def _gather_rows(d_ptr, row, s_ptr, srow, gs_ptr, o_ptr, orow, tmask,
                 D: tl.constexpr, FMT: tl.constexpr, OUT: tl.constexpr, HW: tl.constexpr):
    """Dequantize ``[BLOCK_T, D]`` rows at ``row``/``srow`` into ``o_ptr + orow``."""
    gs = tl.load(gs_ptr)
    if FMT == 2:
        NB: tl.constexpr = D // 16
        blk = tl.arange(0, NB)[None, :, None]
        i = tl.arange(0, 8)[None, None, :]
        m3 = tmask[:, None, None]
        b = tl.load(d_ptr + row[:, None, None] + blk * 8 + i, mask=m3, other=0)
        sc = tl.load(s_ptr + srow[:, None] + tl.arange(0, NB)[None, :], mask=tmask[:, None],
                     other=0)
        s = e4m3_to_f16(sc, HW).to(tl.float32)[:, :, None]
        lo = (e2m1_lo_f16(b).to(tl.float32) * 16384.0 * s) * gs
        hi = (e2m1_hi_f16(b).to(tl.float32) * 16384.0 * s) * gs
        vals = tl.reshape(tl.join(lo, hi), [lo.shape[0], D])
    else:
        col = tl.arange(0, D)[None, :]
        x = tl.load(d_ptr + row[:, None] + col, mask=tmask[:, None], other=0)
        if FMT == 0:
            vals = x.to(tl.float32)
        else:
            vals = e4m3_to_f16(x, HW).to(tl.float32) * gs
    tl.store(o_ptr + orow[:, None] + tl.arange(0, D)[None, :], _convert_out(vals, OUT, HW),
             mask=tmask[:, None])


# bt_b (the block table's row stride: the step's widest table) changes from step to step;
# specialized, each new "multiple of 16 or not" class compiled a variant inside a serving
# step (1.3-1.8 s of host time, docs/benchmarks.md).
@triton.jit(do_not_specialize=["bt_b"])
def _gather_kv_kernel(bt_ptr, bt_b, seq_ptr, cu_ptr,
                      kd_ptr, kd_p, kd_h, kd_t, ks_ptr, ks_p, ks_h, ks_t,
                      vd_ptr, vd_p, vd_h, vd_t, vs_ptr, vs_p, vs_h, vs_t,
                      kgs_ptr, vgs_ptr, ko_ptr, ko_t, ko_h, vo_ptr, vo_t, vo_h, PAGE,
                      D: tl.constexpr, BLOCK_T: tl.constexpr, K_FMT: tl.constexpr,
                      V_FMT: tl.constexpr, OUT: tl.constexpr, HW: tl.constexpr):
    """Program ``(tile, head, seq)``: ``BLOCK_T`` tokens of one head of one sequence."""
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    seq_len = tl.load(seq_ptr + b)
    tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < seq_len
    page = tl.load(bt_ptr + b.to(tl.int64) * bt_b + tok // PAGE, mask=tmask, other=0)
    page = page.to(tl.int64)
    off = (tok % PAGE).to(tl.int64)
    out_tok = tl.load(cu_ptr + b).to(tl.int64) + tok
    _gather_rows(kd_ptr, page * kd_p + h * kd_h + off * kd_t, ks_ptr,
                 page * ks_p + h * ks_h + off * ks_t, kgs_ptr, ko_ptr, out_tok * ko_t + h * ko_h,
                 tmask, D, K_FMT, OUT, HW)
    _gather_rows(vd_ptr, page * vd_p + h * vd_h + off * vd_t, vs_ptr,
                 page * vs_p + h * vs_h + off * vs_t, vgs_ptr, vo_ptr, out_tok * vo_t + h * vo_h,
                 tmask, D, V_FMT, OUT, HW)


def _check_out(out: torch.Tensor, name: str, shape: tuple, dtype: torch.dtype,
               device: torch.device) -> None:
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise KernelInputError(f"{name} must be {dtype} {shape} on {device}, got {out.dtype} "
                               f"{tuple(out.shape)} on {out.device}")
    if out.stride(2) != 1:
        raise KernelInputError(f"{name} must have a unit stride on head_dim")


def gather_kv(layout: PageLayout, pages: LayerPages, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, k_scale: float | torch.Tensor = 1.0,
              v_scale: float | torch.Tensor = 1.0, dtype: torch.dtype = torch.bfloat16, *,
              cu_seqlens: torch.Tensor | None = None, total_tokens: int | None = None,
              out: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize the first ``seq_lens[b]`` tokens of each sequence, back to back.

    Args:
        block_tables: int32 ``[B, M]`` page ids; seq_lens: int ``[B]``, each ``<= M * S``
            (not checked on the device: that would need a host sync).
        dtype: workspace dtype: bf16, fp16, fp32 or float8_e4m3fn (saturating).
        cu_seqlens: optional int ``[B]`` start row of each sequence (exclusive prefix
            sum of ``seq_lens``); computed on the device when absent.
        total_tokens: ``sum(seq_lens)``; read from the device (a sync) when absent
            and ``out`` is not given.
        out: optional preallocated ``(k, v)`` workspaces ``[>= total, H, D]``.
    Returns:
        ``(k, v)`` each ``[total_tokens, H, D]`` of ``dtype``.
    """
    device = block_tables.device
    check_block_tables(block_tables, seq_lens, device)
    check_pages(layout, pages, device)
    if dtype not in _OUT_KINDS:
        raise KernelInputError(f"workspace dtype must be one of {list(_OUT_KINDS)}, got {dtype}")
    nb, h, d = block_tables.shape[0], layout.num_kv_heads, layout.head_dim
    if cu_seqlens is None:
        cu_seqlens = torch.cumsum(seq_lens, 0) - seq_lens
    check_int_vector(cu_seqlens, "cu_seqlens", nb, device)
    if out is None:
        total = int(seq_lens.sum()) if total_tokens is None else int(total_tokens)
        out = (torch.empty((total, h, d), dtype=dtype, device=device),
               torch.empty((total, h, d), dtype=dtype, device=device))
    for name, o in zip(("out[0]", "out[1]"), out):
        _check_out(o, name, (o.shape[0], h, d), dtype, device)
    max_tokens = block_tables.shape[1] * layout.page_size
    if nb == 0 or max_tokens == 0 or out[0].shape[0] == 0:
        return out
    kf, vf = element_codes(layout)
    hw = hw_fp8(device)
    kd, vd = typed_data(pages.k_data, kf), typed_data(pages.v_data, vf)
    ks = pages.k_scale if pages.k_scale is not None else pages.k_data
    vs = pages.v_scale if pages.v_scale is not None else pages.v_data
    ko, vo = (o.view(torch.uint8) if dtype == torch.float8_e4m3fn else o for o in out)
    grid = (triton.cdiv(max_tokens, BLOCK_T), h, nb)
    _gather_kv_kernel[grid](
        block_tables, block_tables.stride(0), seq_lens, cu_seqlens,
        kd, *kd.stride()[:3], ks, *ks.stride()[:3], vd, *vd.stride()[:3], vs, *vs.stride()[:3],
        scale_tensor(k_scale, device, "k_scale"), scale_tensor(v_scale, device, "v_scale"),
        ko, ko.stride(0), ko.stride(1), vo, vo.stride(0), vo.stride(1), layout.page_size,
        D=d, BLOCK_T=BLOCK_T, K_FMT=kf, V_FMT=vf, OUT=_OUT_KINDS[dtype], HW=hw, num_warps=4)
    return out
