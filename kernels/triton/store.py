"""Quantize-and-store: new tokens' K/V into one layer's pages (portable Triton).

Bit-identical to :func:`nibble.kernels.paged_ref.store_kv_ref` for every format:
NVFP4 rounds the block scale to E4M3 (RNE, saturating at 448), multiplies each
value by the block's fp32 reciprocal of ``scale * global_scale`` (one IEEE
division per block), rounds the product to E2M1 with ties to even and takes the
sign from the IEEE sign bit; FP8 divides by the layer scale and rounds to E4M3
(RNE, saturating); BF16 rounds to nearest even.

NVFP4 work is split so that one thread holds whole 16-value blocks (tiles
``[ROWS, D // 16, 8]`` of even and of odd values, each block read with 16-byte
loads): a block's amax, its one division for the reciprocal, the per-value
encoding (one multiply, three fp32 roundings and a ``min``, no conversion
instruction) and the nibble pairing all stay in registers, and each block's 8
code bytes leave in one 8-byte store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout
from ._common import (bf16_rne, check_int_vector, check_pages, e4m3_encode, e4m3_to_f16,
                      element_codes, hw_fp8, scale_tensor, typed_data)

# Launch shape (``.devrun/store_sweep.py`` times alternatives). ROWS: (token, head) rows
# per tile, a power of 2; None gives one 16-value block of K (and of V) per thread.
ROWS: int | None = None
NUM_WARPS = 2
TILES = 1       # tiles per program
FP32_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite fp32


@triton.jit
def _e2m1_nibbles(x, inv):
    """fp32 values times their block's reciprocal ``inv`` (broadcast) -> uint32 whose low
    4 bits are the E2M1 code (bit 3 = the IEEE sign of ``x``); the bits above are garbage.

    The fp32 product ``m`` is rounded three ways at magnitude 2^22, where the fp32
    ulp is 0.5 and addition rounds to nearest even: to multiples of 0.5 (code
    ``2m``, right below 2), of 1 (code ``m + 2``, right on [2, 4)) and of 2 (code
    ``m / 2 + 4``, right from 4). Every candidate is >= the right code and the
    right one is the smallest, so ``min`` (and 7 for saturation) picks it; the
    code is then the low bits of the result (2^22 = 0x4A800000). No conversion
    instruction, no division per value.
    """
    q = x * inv
    m = tl.abs(q)
    # Launched with fp fusion off: q must be rounded before the adds (no fma(|x|, inv, 2^22)).
    s1 = m + 4194304.0
    s2 = tl.fma(m, 0.5, 4194305.0)
    s3 = tl.fma(m, 0.25, 4194306.0)
    u = tl.minimum(tl.minimum(s1, s2), tl.minimum(s3, 4194307.5))
    return u.to(tl.uint32, bitcast=True) | ((q.to(tl.uint32, bitcast=True) >> 28) & 8)


@triton.jit
def _pair_bytes(even, odd, inv):
    """fp32 even/odd values of blocks ``[R, NB, 8]`` -> uint8 code bytes (even value in the
    low nibble)."""
    return (_e2m1_nibbles(even, inv) + _e2m1_nibbles(odd, inv) * 16).to(tl.uint8)


@triton.jit
def _concat(a, b):
    """``[R, NB, n]`` twice -> ``[R, NB, 2n]``, ``a`` first (a register renaming per thread)."""
    ab = tl.permute(tl.join(a, b), (0, 1, 3, 2))
    return tl.reshape(ab, [a.shape[0], a.shape[1], 2 * a.shape[2]])


@triton.jit
def _load_blocks(x_ptr, xrow, sx_d, m3, NB: tl.constexpr, LOAD: tl.constexpr):
    """fp32 ``(even, odd)`` ``[ROWS, NB, 8]``: values ``2j`` and ``2j + 1`` of every block.

    Each thread holds whole blocks; rows masked off load nothing (their values are
    never stored). ``LOAD`` 1: bf16 read as 32-bit pairs (even value in
    the low half), two 16-byte loads per block; 2: 1-byte values, one 16-byte load per
    block; 0: any dtype or stride, two loads of 8 values per block.
    """
    blk = tl.arange(0, NB)[None, :, None]
    if LOAD == 1:
        ptr = x_ptr.to(tl.pointer_type(tl.uint32)) + (xrow >> 1)[:, None, None] + blk * 8
        col = tl.arange(0, 4)[None, None, :]
        w = _concat(tl.load(ptr + col, mask=m3), tl.load(ptr + col + 4, mask=m3))
        return (w << 16).to(tl.float32, bitcast=True), (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        ptr = x_ptr + xrow[:, None, None] + (blk * 16).to(tl.int64) * sx_d
        if LOAD == 2:
            x = tl.load(ptr + tl.arange(0, 16)[None, None, :].to(tl.int64) * sx_d, mask=m3)
        else:
            col = tl.arange(0, 8)[None, None, :].to(tl.int64) * sx_d
            x = _concat(tl.load(ptr + col, mask=m3), tl.load(ptr + col + 8 * sx_d, mask=m3))
        return tl.split(tl.reshape(x.to(tl.float32), [xrow.shape[0], NB, 8, 2]))


@triton.jit
def _load_rows(x_ptr, xrow, sx_d, rmask, D: tl.constexpr, FMT: tl.constexpr,
               LOAD: tl.constexpr):
    """Load ``ROWS`` rows as fp32: NVFP4 ``(even, odd)`` (see :func:`_load_blocks`); other
    formats ``(x, x)`` with ``x`` ``[ROWS, D]``."""
    if FMT == 2:
        return _load_blocks(x_ptr, xrow, sx_d, rmask[:, None, None], D // 16, LOAD)
    else:
        col = tl.arange(0, D)[None, :]
        x = tl.load(x_ptr + xrow[:, None] + col.to(tl.int64) * sx_d, mask=rmask[:, None],
                    other=0.0).to(tl.float32)
        return x, x


@triton.jit
def _store_nvfp4(even, odd, d_ptr, drow, s_ptr, srow, s_blk, gs_ptr, rmask, HW: tl.constexpr):
    """Quantize blocks given as fp32 ``(even, odd)`` ``[ROWS, NB, 8]``; store codes and scales."""
    NB: tl.constexpr = even.shape[1]
    amax = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=2)  # [ROWS, NB]
    gs = tl.full(amax.shape, 1.0, tl.float32) * tl.load(gs_ptr)  # div_rn does not broadcast
    sbyte = e4m3_encode(tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)),
                                       gs), HW)
    denom = e4m3_to_f16(sbyte, HW).to(tl.float32) * gs
    inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(denom > 0, denom, 1.0))
    inv = tl.where(denom > 0, tl.minimum(inv, FP32_MAX), 0.0)
    ptr = d_ptr + drow[:, None, None] + (tl.arange(0, NB)[None, :, None] * 8
                                         + tl.arange(0, 8)[None, None, :])
    tl.store(ptr, _pair_bytes(even, odd, inv[:, :, None]), mask=rmask[:, None, None])
    # s_blk (1, not specialized) hides the scales' contiguity: a thread holding several
    # blocks then stores each scale byte from where it is, without a layout shuffle.
    tl.store(s_ptr + srow[:, None] + tl.arange(0, NB)[None, :] * s_blk, sbyte,
             mask=rmask[:, None])


@triton.jit
def _store_rows(x, d_ptr, drow, s_ptr, srow, s_blk, gs_ptr, rmask,
                D: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    """Quantize rows loaded by :func:`_load_rows` and store them at ``drow``/``srow`` offsets."""
    if FMT == 2:
        _store_nvfp4(x[0], x[1], d_ptr, drow, s_ptr, srow, s_blk, gs_ptr, rmask, HW)
    else:
        lo = x[0]
        col = tl.arange(0, D)[None, :]
        m2 = rmask[:, None]
        if FMT == 0:
            tl.store(d_ptr + drow[:, None] + col, bf16_rne(lo, HW), mask=m2)
        else:
            gs = tl.full(lo.shape, 1.0, tl.float32) * tl.load(gs_ptr)
            tl.store(d_ptr + drow[:, None] + col, e4m3_encode(tl.math.div_rn(lo, gs), HW),
                     mask=m2)


@triton.jit
def _load_tile(k_ptr, v_ptr, slot_ptr, n_rows, tile, SK_T: tl.constexpr, SK_H: tl.constexpr,
               SK_D: tl.constexpr, SV_T: tl.constexpr, SV_H: tl.constexpr, SV_D: tl.constexpr,
               H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, K_FMT: tl.constexpr,
               V_FMT: tl.constexpr, K_LOAD: tl.constexpr, V_LOAD: tl.constexpr):
    """(token, head) rows ``tile * ROWS ..``: ``(k, v, slot, h, rmask)`` with ``k``/``v``
    from :func:`_load_rows` and ``slot``, ``h``, ``rmask`` ``[ROWS]``."""
    r = tile * ROWS + tl.arange(0, ROWS)
    t = r // H
    h = r % H
    slot = tl.load(slot_ptr + t, mask=r < n_rows, other=-1)
    rmask = (r < n_rows) & (slot >= 0)
    t = t.to(tl.int64)
    kx = _load_rows(k_ptr, t * SK_T + h * SK_H, SK_D, rmask, D, K_FMT, K_LOAD)
    vx = _load_rows(v_ptr, t * SV_T + h * SV_H, SV_D, rmask, D, V_FMT, V_LOAD)
    return kx, vx, slot, h, rmask


@triton.jit
def _store_tile(x, kd_ptr, ks_ptr, vd_ptr, vs_ptr, s_blk, kgs_ptr, vgs_ptr,
                KD_P: tl.constexpr, KD_H: tl.constexpr, KD_T: tl.constexpr,
                KS_P: tl.constexpr, KS_H: tl.constexpr, KS_T: tl.constexpr,
                VD_P: tl.constexpr, VD_H: tl.constexpr, VD_T: tl.constexpr,
                VS_P: tl.constexpr, VS_H: tl.constexpr, VS_T: tl.constexpr,
                PAGE: tl.constexpr, D: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
                HW: tl.constexpr):
    """Quantize and store a tile ``x`` from :func:`_load_tile`."""
    kx, vx, slot, h, rmask = x
    # A slot indexes a pool that fits in memory: 32 bits, and offsets within a page too.
    slot = tl.maximum(slot, 0).to(tl.uint32)
    page = (slot // PAGE).to(tl.int64)
    off = (slot % PAGE).to(tl.int32)
    _store_rows(kx, kd_ptr, page * KD_P + (h * KD_H + off * KD_T),
                ks_ptr, page * KS_P + (h * KS_H + off * KS_T), s_blk, kgs_ptr, rmask, D, K_FMT, HW)
    _store_rows(vx, vd_ptr, page * VD_P + (h * VD_H + off * VD_T),
                vs_ptr, page * VS_P + (h * VS_H + off * VS_T), s_blk, vgs_ptr, rmask, D, V_FMT, HW)


@triton.jit(do_not_specialize=["s_blk"])
def _store_kv_kernel(k_ptr, v_ptr, slot_ptr, n_rows, kd_ptr, ks_ptr, vd_ptr, vs_ptr, s_blk,
                     kgs_ptr, vgs_ptr, SK_T: tl.constexpr, SK_H: tl.constexpr,
                     SK_D: tl.constexpr, SV_T: tl.constexpr, SV_H: tl.constexpr,
                     SV_D: tl.constexpr, KD_P: tl.constexpr, KD_H: tl.constexpr,
                     KD_T: tl.constexpr, KS_P: tl.constexpr, KS_H: tl.constexpr,
                     KS_T: tl.constexpr, VD_P: tl.constexpr, VD_H: tl.constexpr,
                     VD_T: tl.constexpr, VS_P: tl.constexpr, VS_H: tl.constexpr,
                     VS_T: tl.constexpr, H: tl.constexpr, PAGE: tl.constexpr,
                     D: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
                     K_FMT: tl.constexpr, V_FMT: tl.constexpr, HW: tl.constexpr,
                     K_LOAD: tl.constexpr, V_LOAD: tl.constexpr):
    """One program quantizes ``TILES`` tiles of ``ROWS`` (token, head) rows of K and of V.

    A tile's K and V are loaded before anything is stored (the compiler may not move
    loads past stores), and the next tile's loads are issued before this tile's
    stores, so loads stay in flight while a thread computes. Strides, ``H`` and
    ``PAGE`` are compile-time constants (fixed for a model and pool): row and slot
    arithmetic needs no division, and K and V share it where their strides agree.
    """
    first = tl.program_id(0) * TILES
    cur = _load_tile(k_ptr, v_ptr, slot_ptr, n_rows, first, SK_T, SK_H, SK_D, SV_T, SV_H, SV_D,
                     H, D, ROWS, K_FMT, V_FMT, K_LOAD, V_LOAD)
    for i in tl.static_range(TILES):
        if i + 1 < TILES:
            nxt = _load_tile(k_ptr, v_ptr, slot_ptr, n_rows, first + i + 1, SK_T, SK_H, SK_D,
                             SV_T, SV_H, SV_D, H, D, ROWS, K_FMT, V_FMT, K_LOAD, V_LOAD)
        _store_tile(cur, kd_ptr, ks_ptr, vd_ptr, vs_ptr, s_blk, kgs_ptr, vgs_ptr, KD_P, KD_H,
                    KD_T, KS_P, KS_H, KS_T, VD_P, VD_H, VD_T, VS_P, VS_H, VS_T, PAGE, D, K_FMT,
                    V_FMT, HW)
        if i + 1 < TILES:
            cur = nxt


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
    check_pages(layout, pages, k.device)
    check_int_vector(slot_mapping, "slot_mapping", k.shape[0], k.device)
    if k.shape[0] == 0:
        return
    k, v = _token_major(k), _token_major(v)
    rows = ROWS or 1 << (max(1, 32 * NUM_WARPS * 16 // k.shape[2]).bit_length() - 1)
    _launch(layout, pages, k, v, slot_mapping, k_scale, v_scale, rows, NUM_WARPS, TILES)


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with strides that do not depend on ``T``: the kernel takes strides as
    compile-time constants, so a head-major view (``[H, T, D]`` transposed, as the K
    recipe's batched matmul returns) would compile a new kernel for every token count:
    about a second per new prompt length on a GPU. Such a view is copied once instead."""
    if x.shape[0] > 1 and x.shape[1] > 1 and x.stride(1) > x.stride(0):
        return x.contiguous()
    return x


def _launch(layout: PageLayout, pages: LayerPages, k: torch.Tensor, v: torch.Tensor,
            slot_mapping: torch.Tensor, k_scale: float | torch.Tensor,
            v_scale: float | torch.Tensor, rows: int, num_warps: int, tiles: int = 1) -> None:
    """Launch the store kernel: tiles of ``rows`` rows (a power of 2), ``tiles`` tiles per
    program of ``num_warps`` warps; arguments already checked by :func:`store_kv`."""
    device = k.device
    t, h, d = k.shape
    kf, vf = element_codes(layout)
    kgs = scale_tensor(k_scale, device, "k_scale")
    vgs = scale_tensor(v_scale, device, "v_scale")
    kd, vd = typed_data(pages.k_data, kf), typed_data(pages.v_data, vf)
    ks = pages.k_scale if pages.k_scale is not None else pages.k_data
    vs = pages.v_scale if pages.v_scale is not None else pages.v_data
    # Strides are compile-time constants; a size-1 dimension's stride is irrelevant.
    strides = [st if n > 1 else 0 for x in (k, v) for n, st in zip(x.shape, x.stride())]
    for view in (kd, ks, vd, vs):
        strides += view.stride()[:3]
    names = ("SK_T", "SK_H", "SK_D", "SV_T", "SV_H", "SV_D", "KD_P", "KD_H", "KD_T", "KS_P",
             "KS_H", "KS_T", "VD_P", "VD_H", "VD_T", "VS_P", "VS_H", "VS_T")
    _store_kv_kernel[(triton.cdiv(t * h, rows * tiles),)](
        k, v, slot_mapping, t * h, kd, ks, vd, vs, 1, kgs, vgs, **dict(zip(names, strides)),
        H=h, PAGE=layout.page_size, D=d, ROWS=rows, TILES=tiles, K_FMT=kf, V_FMT=vf,
        HW=hw_fp8(device), K_LOAD=_load_mode(k), V_LOAD=_load_mode(v), num_warps=num_warps,
        enable_fp_fusion=False)


def _load_mode(x: torch.Tensor) -> int:
    """How the NVFP4 path reads ``x`` (see ``_load_blocks``): 1 for bf16 readable as aligned
    32-bit pairs, 2 for 1-byte values, else 0."""
    if (x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(0) % 2 == 0
            and x.stride(1) % 2 == 0 and x.data_ptr() % 4 == 0):
        return 1
    return 2 if x.element_size() == 1 else 0
