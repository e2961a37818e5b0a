"""Quantize-and-store: new tokens' K/V into one layer's pages (portable Triton).

Bit-identical to :func:`nibble.kernels.paged_ref.store_kv_ref` for every format:
NVFP4 rounds the block scale to E4M3 (RNE, saturating at 448), divides each value
by ``scale * global_scale`` with IEEE division, rounds to E2M1 with ties to even
and takes the sign from the IEEE sign bit; FP8 divides by the layer scale and
rounds to E4M3 (RNE, saturating); BF16 rounds to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout
from ._common import (bf16_rne, check_int_vector, check_pages, e4m3_encode, e4m3_to_f16,
                      element_codes, hw_fp8, scale_tensor, typed_data)

ROWS = 16  # token-head rows per program


@triton.jit
def _e2m1_magnitude(mag):
    """fp32 ``mag >= 0`` (value / block scale) -> 3-bit E2M1 magnitude code, RNE, saturating.

    At or above 1 the fp32 mantissa is rounded to one bit (ties to even) and the
    code read off exponent and mantissa; below 1 adding 2^22 rounds to a multiple
    of 0.5 (fp32 addition is RNE), giving codes 0..2.
    """
    bits = mag.to(tl.int32, bitcast=True)
    rounded = bits + 0x1FFFFF + ((bits >> 22) & 1)
    normal = tl.minimum((rounded >> 22) - 252, 7)
    sub = (((mag + 4194304.0) - 4194304.0) * 2.0).to(tl.int32)
    return tl.where(mag < 1.0, sub, normal)


@triton.jit
def _store_nvfp4_rows(x_ptr, xrow, sx_d, d_ptr, drow, s_ptr, srow, gs_ptr, rmask,
                      D: tl.constexpr, HW: tl.constexpr):
    """Quantize ``[ROWS, D]`` rows to NVFP4, tiles ``[ROWS, D // 16, 16]`` (one block per row)."""
    NB: tl.constexpr = D // 16
    blk = tl.arange(0, NB)[None, :, None]
    m3 = rmask[:, None, None]
    col = (blk * 16 + tl.arange(0, 16)[None, None, :]).to(tl.int64) * sx_d
    x = tl.load(x_ptr + xrow[:, None, None] + col, mask=m3, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)  # [ROWS, NB]
    gs = tl.load(gs_ptr)
    sbyte = e4m3_encode(tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)),
                                       tl.full(amax.shape, 1.0, tl.float32) * gs), HW)
    denom = (e4m3_to_f16(sbyte, HW).to(tl.float32) * gs)[:, :, None]
    # div_rn does not broadcast its operands.
    safe = tl.broadcast_to(tl.where(denom > 0, denom, 1.0), x.shape)
    mag = tl.where(denom > 0, tl.math.div_rn(tl.abs(x), safe), 0.0)
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 8
    code = _e2m1_magnitude(mag) | sign
    lo, hi = tl.split(tl.reshape(code, [code.shape[0], NB, 8, 2]))
    byte = (lo | (hi << 4)).to(tl.uint8)
    tl.store(d_ptr + drow[:, None, None] + blk * 8 + tl.arange(0, 8)[None, None, :], byte,
             mask=m3)
    tl.store(s_ptr + srow[:, None] + tl.arange(0, NB)[None, :], sbyte, mask=rmask[:, None])


@triton.jit
def _store_rows(x_ptr, xrow, sx_d, d_ptr, drow, s_ptr, srow, gs_ptr, rmask,
                D: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    """Quantize ``[ROWS, D]`` rows of ``x`` and store them at ``drow``/``srow`` offsets."""
    if FMT == 2:
        _store_nvfp4_rows(x_ptr, xrow, sx_d, d_ptr, drow, s_ptr, srow, gs_ptr, rmask, D, HW)
    else:
        col = tl.arange(0, D)[None, :]
        m2 = rmask[:, None]
        x = tl.load(x_ptr + xrow[:, None] + col.to(tl.int64) * sx_d, mask=m2, other=0.0)
        x = x.to(tl.float32)
        if FMT == 0:
            tl.store(d_ptr + drow[:, None] + col, bf16_rne(x, HW), mask=m2)
        else:
            gs = tl.full(x.shape, 1.0, tl.float32) * tl.load(gs_ptr)
            tl.store(d_ptr + drow[:, None] + col, e4m3_encode(tl.math.div_rn(x, gs), HW),
                     mask=m2)


@triton.jit
def _store_kv_kernel(k_ptr, sk_t, sk_h, sk_d, v_ptr, sv_t, sv_h, sv_d, slot_ptr, n_rows,
                     kd_ptr, kd_p, kd_h, kd_t, ks_ptr, ks_p, ks_h, ks_t,
                     vd_ptr, vd_p, vd_h, vd_t, vs_ptr, vs_p, vs_h, vs_t,
                     kgs_ptr, vgs_ptr, H, PAGE,
                     D: tl.constexpr, ROWS: tl.constexpr, K_FMT: tl.constexpr,
                     V_FMT: tl.constexpr, HW: tl.constexpr):
    """One program quantizes ``ROWS`` (token, head) rows of K and of V."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t = r // H
    h = (r % H).to(tl.int64)
    slot = tl.load(slot_ptr + t, mask=r < n_rows, other=-1).to(tl.int64)
    rmask = (r < n_rows) & (slot >= 0)
    slot = tl.maximum(slot, 0)
    page = slot // PAGE
    off = slot % PAGE
    t = t.to(tl.int64)
    _store_rows(k_ptr, t * sk_t + h * sk_h, sk_d, kd_ptr, page * kd_p + h * kd_h + off * kd_t,
                ks_ptr, page * ks_p + h * ks_h + off * ks_t, kgs_ptr, rmask, D, K_FMT, HW)
    _store_rows(v_ptr, t * sv_t + h * sv_h, sv_d, vd_ptr, page * vd_p + h * vd_h + off * vd_t,
                vs_ptr, page * vs_p + h * vs_h + off * vs_t, vgs_ptr, rmask, D, V_FMT, HW)


def _check_inputs(layout: PageLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    shape = (layout.num_kv_heads, layout.head_dim)
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or tuple(x.shape[1:]) != shape:
            raise KernelInputError(f"{name} must be [T, {shape[0]}, {shape[1]}], got "
                                   f"{tuple(x.shape)}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
            raise KernelInputError(f"{name} must be bf16/fp16/fp32/float8_e4m3fn, got {x.dtype}")
    if k.shape[0] != v.shape[0]:
        raise KernelInputError(f"k and v token counts differ: {k.shape[0]} vs {v.shape[0]}")
    if k.device != v.device:
        raise KernelInputError(f"k is on {k.device}, v on {v.device}")


def store_kv(layout: PageLayout, pages: LayerPages, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float | torch.Tensor = 1.0,
             v_scale: float | torch.Tensor = 1.0) -> None:
    """Quantize ``k``/``v`` and write each token to its slot (one launch, no host sync).

    Args:
        layout: the page geometry; ``pages`` = ``layout.layer_view(pool, layer)``.
        k, v: ``[T, H, D]`` bf16, fp16, fp32 or float8_e4m3fn, any strides.
        slot_mapping: int32/int64 ``[T]``, ``page_id * page_size + offset``; a
            negative slot skips its token (padding). Slots are not range-checked.
        k_scale, v_scale: global scales (float, or a one-element fp32 tensor on the
            device, which avoids a host-to-device copy under CUDA graphs).

    NaN/inf inputs are not checked (that would need a host sync); their codes are
    unspecified.
    """
    _check_inputs(layout, k, v)
    device = k.device
    check_pages(layout, pages, device)
    check_int_vector(slot_mapping, "slot_mapping", k.shape[0], device)
    t, h, d = k.shape
    if t == 0:
        return
    kf, vf = element_codes(layout)
    hw = hw_fp8(device)
    kgs = scale_tensor(k_scale, device, "k_scale")
    vgs = scale_tensor(v_scale, device, "v_scale")
    kd, vd = typed_data(pages.k_data, kf), typed_data(pages.v_data, vf)
    ks = pages.k_scale if pages.k_scale is not None else pages.k_data
    vs = pages.v_scale if pages.v_scale is not None else pages.v_data
    grid = (triton.cdiv(t * h, ROWS),)
    _store_kv_kernel[grid](
        k, *k.stride(), v, *v.stride(), slot_mapping, t * h,
        kd, *kd.stride()[:3], ks, *ks.stride()[:3], vd, *vd.stride()[:3], vs, *vs.stride()[:3],
        kgs, vgs, h, layout.page_size,
        D=d, ROWS=ROWS, K_FMT=kf, V_FMT=vf, HW=hw, num_warps=4)
