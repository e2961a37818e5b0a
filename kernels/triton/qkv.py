"""From the QKV projection's output to the attention inputs, in one launch (portable Triton).

:func:`qkv_rope_store` does, per token, what the unfused path spreads over about
thirty kernels: the per-head QK-norm (RMSNorm), RoPE (HF rotate_half), a K
recipe's ``k' = (k - c) @ M`` and ``q' = q @ M^-T`` (``recipes.RecipeParams``;
``v - v_shift`` too where the recipe centers V), the quantization of K and V
(NVFP4, FP8 E4M3 or BF16 pages, the same bytes as :func:`~.store.store_kv`
would write from the transformed values) and their store into the pages. It
returns q', which the attention reads, and optionally writes K' and V' (a prefill's
fresh keys and values) into ``k_out``/``v_out``.

Work is split in halves of a head (``lo`` = channels ``[0, D/2)``, ``hi`` = ``[D/2, D)``):
RoPE pairs channel ``i`` with ``i + D/2``, so each half is computed from the two
loads without a shuffle, a D x D map is four ``[D/2, D/2]`` MMAs, and each half
is quantized as its own ``D/2 / 16`` NVFP4 blocks. The grid is
``(token tiles of 16, KV heads, G + 1)``: program ``z < G`` transforms query head
``h * G + z``, program ``G`` the K and V of KV head ``h``.

Numerics: float32 throughout (the maps' MMAs take bf16 operands with float32
accumulation on a GPU, float32 in the interpreter); the reference is
:func:`nibble.kernels.fused_ref.qkv_store_ref`. Launched with fp fusion off,
which the E2M1 rounding of :mod:`.store` relies on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout
from ._common import (FLOAT_DTYPES, check_int_vector, check_pages, element_codes, hw_fp8,
                      scale_tensor, typed_data)
from .store import _store_rows

TOKENS = 16          # tokens per program for short inputs (the MMA's M dimension)
# Long inputs (prefill chunks) take more tokens per program: every program loads its head's
# D x D map (64 KB in fp32 at D 128), so 16-token programs re-read it from L2 once per 16
# tokens; (tokens per program, warps) by the input's token count.
LONG_INPUT = 512
TILE_CHOICES = {16: 4, 32: 4, 64: 8}
LONG_TOKENS = 64


@triton.jit
def _load_halves(ptr, row, rmask, HALF: tl.constexpr):
    """fp32 ``(lo, hi)`` ``[BT, HALF]`` of rows starting at offsets ``row``."""
    col = tl.arange(0, HALF)[None, :]
    p = ptr + row[:, None] + col
    lo = tl.load(p, mask=rmask[:, None], other=0.0).to(tl.float32)
    hi = tl.load(p + HALF, mask=rmask[:, None], other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _vec_halves(ptr, HALF: tl.constexpr):
    """fp32 ``(lo, hi)`` ``[1, HALF]`` of a ``[2 * HALF]`` vector."""
    col = tl.arange(0, HALF)[None, :]
    return tl.load(ptr + col).to(tl.float32), tl.load(ptr + HALF + col).to(tl.float32)


@triton.jit
def _norm_rope(lo, hi, w_ptr, eps, w_off, rope, HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """RMSNorm over the whole head (gain ``w + w_off``), then RoPE with ``rope`` =
    ``(cos_lo, cos_hi, sin_lo, sin_hi)``."""
    if HAS_NORM:
        ss = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)
        r = (1.0 / tl.sqrt(ss / (2 * HALF) + eps))[:, None]
        wlo, whi = _vec_halves(w_ptr, HALF)
        lo = lo * r * (wlo + w_off)
        hi = hi * r * (whi + w_off)
    c_lo, c_hi, s_lo, s_hi = rope
    return lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi


@triton.jit
def _dot(a, b, acc, DOT_BF16: tl.constexpr):
    if DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _map(lo, hi, m_ptr, HALF: tl.constexpr, DOT_BF16: tl.constexpr):
    """``[lo | hi] @ M`` for this head's row-major ``[2 * HALF, 2 * HALF]`` map, in halves."""
    r = tl.arange(0, HALF)[:, None] * (2 * HALF)
    c = tl.arange(0, HALF)[None, :]
    zero = tl.zeros(lo.shape, tl.float32)
    out_lo = _dot(hi, tl.load(m_ptr + HALF * 2 * HALF + r + c),
                  _dot(lo, tl.load(m_ptr + r + c), zero, DOT_BF16), DOT_BF16)
    out_hi = _dot(hi, tl.load(m_ptr + HALF * 2 * HALF + r + HALF + c),
                  _dot(lo, tl.load(m_ptr + r + HALF + c), zero, DOT_BF16), DOT_BF16)
    return out_lo, out_hi


@triton.jit
def _store_half(x, d_ptr, drow, s_ptr, srow, gs_ptr, rmask, HALF: tl.constexpr,
                FMT: tl.constexpr, HW: tl.constexpr):
    """Quantize and store one half-head ``x [BT, HALF]`` at the row offsets given."""
    if FMT == 2:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], HALF // 16, 8, 2]))
        _store_rows((even, odd), d_ptr, drow, s_ptr, srow, 1, gs_ptr, rmask, HALF, FMT, HW)
    else:
        _store_rows((x, x), d_ptr, drow, s_ptr, srow, 1, gs_ptr, rmask, HALF, FMT, HW)


@triton.jit
def _store_head(lo, hi, d_ptr, s_ptr, gs_ptr, page, off, h, rmask, D_P, D_H, D_T, S_P, S_H,
                S_T, HALF: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    """Both halves of one head's rows into their page slots (data offsets in elements of
    the typed view: NVFP4 code bytes hold two values, FP8 one byte, BF16 one element)."""
    drow = page * D_P + (h * D_H + off * D_T)
    srow = page * S_P + (h * S_H + off * S_T)
    _store_half(lo, d_ptr, drow, s_ptr, srow, gs_ptr, rmask, HALF, FMT, HW)
    if FMT == 2:        # NVFP4: two values per code byte, one scale byte per 16 values
        _store_half(hi, d_ptr, drow + HALF // 2, s_ptr, srow + HALF // 16, gs_ptr, rmask,
                    HALF, FMT, HW)
    else:
        _store_half(hi, d_ptr, drow + HALF, s_ptr, srow, gs_ptr, rmask, HALF, FMT, HW)


@triton.jit(do_not_specialize=["n_tok"])
def _qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, qn_ptr, kn_ptr, eps, w_off,
                kshift_ptr, kmap_ptr, qmap_ptr, vshift_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr,
                kgs_ptr, vgs_ptr, kout_ptr, vout_ptr, n_tok, SX: tl.constexpr, SC: tl.constexpr,
                SS: tl.constexpr, SO_T: tl.constexpr, SO_H: tl.constexpr,
                KD_P: tl.constexpr, KD_H: tl.constexpr, KD_T: tl.constexpr,
                KS_P: tl.constexpr, KS_H: tl.constexpr, KS_T: tl.constexpr,
                VD_P: tl.constexpr, VD_H: tl.constexpr, VD_T: tl.constexpr,
                VS_P: tl.constexpr, VS_H: tl.constexpr, VS_T: tl.constexpr,
                HQ: tl.constexpr, H: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                HAS_QN: tl.constexpr, HAS_KN: tl.constexpr, HAS_KSHIFT: tl.constexpr,
                HAS_KMAP: tl.constexpr, HAS_QMAP: tl.constexpr, HAS_VSHIFT: tl.constexpr,
                K_FMT: tl.constexpr, V_FMT: tl.constexpr, HW: tl.constexpr,
                DOT_BF16: tl.constexpr, HAS_KV_OUT: tl.constexpr, SKO_T: tl.constexpr,
                SKO_H: tl.constexpr, SVO_T: tl.constexpr, SVO_H: tl.constexpr,
                BT: tl.constexpr):
    """Program ``(tile of BT tokens, h, z)``: query head ``h * G + z`` (``z < G``), or K and V of head ``h``
    (and, with ``HAS_KV_OUT``, their transformed rows into ``kout``/``vout``)."""
    D = 2 * HALF
    G = HQ // H
    h = tl.program_id(1)
    z = tl.program_id(2)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < n_tok
    t = t.to(tl.int64)
    c_lo, c_hi = _load_halves(cos_ptr, t * SC, tmask, HALF)
    s_lo, s_hi = _load_halves(sin_ptr, t * SS, tmask, HALF)
    rope = (c_lo, c_hi, s_lo, s_hi)
    if z < G:
        hq = h * G + z
        lo, hi = _load_halves(qkv_ptr, t * SX + hq * D, tmask, HALF)
        lo, hi = _norm_rope(lo, hi, qn_ptr, eps, w_off, rope, HAS_QN, HALF)
        if HAS_QMAP:
            lo, hi = _map(lo, hi, qmap_ptr + h * D * D, HALF, DOT_BF16)
        col = tl.arange(0, HALF)[None, :]
        o = q_out_ptr + (t * SO_T + hq * SO_H)[:, None] + col
        tl.store(o, lo.to(q_out_ptr.dtype.element_ty), mask=tmask[:, None])
        tl.store(o + HALF, hi.to(q_out_ptr.dtype.element_ty), mask=tmask[:, None])
    else:
        lo, hi = _load_halves(qkv_ptr, t * SX + (HQ + h) * D, tmask, HALF)
        lo, hi = _norm_rope(lo, hi, kn_ptr, eps, w_off, rope, HAS_KN, HALF)
        if HAS_KSHIFT:
            c0, c1 = _vec_halves(kshift_ptr + h * D, HALF)
            lo, hi = lo - c0, hi - c1
        if HAS_KMAP:
            lo, hi = _map(lo, hi, kmap_ptr + h * D * D, HALF, DOT_BF16)
        v_lo, v_hi = _load_halves(qkv_ptr, t * SX + (HQ + H + h) * D, tmask, HALF)
        if HAS_VSHIFT:
            c0, c1 = _vec_halves(vshift_ptr + h * D, HALF)
            v_lo, v_hi = v_lo - c0, v_hi - c1
        if HAS_KV_OUT:
            col = tl.arange(0, HALF)[None, :]
            ko = kout_ptr + (t * SKO_T + h * SKO_H)[:, None] + col
            vo = vout_ptr + (t * SVO_T + h * SVO_H)[:, None] + col
            tl.store(ko, lo.to(kout_ptr.dtype.element_ty), mask=tmask[:, None])
            tl.store(ko + HALF, hi.to(kout_ptr.dtype.element_ty), mask=tmask[:, None])
            tl.store(vo, v_lo.to(vout_ptr.dtype.element_ty), mask=tmask[:, None])
            tl.store(vo + HALF, v_hi.to(vout_ptr.dtype.element_ty), mask=tmask[:, None])
        slot = tl.load(slot_ptr + t, mask=tmask, other=-1)
        rmask = tmask & (slot >= 0)
        slot = tl.maximum(slot, 0).to(tl.uint32)
        page = (slot // PAGE).to(tl.int64)
        off = (slot % PAGE).to(tl.int32)
        _store_head(lo, hi, kd_ptr, ks_ptr, kgs_ptr, page, off, h, rmask, KD_P, KD_H, KD_T,
                    KS_P, KS_H, KS_T, HALF, K_FMT, HW)
        _store_head(v_lo, v_hi, vd_ptr, vs_ptr, vgs_ptr, page, off, h, rmask, VD_P, VD_H,
                    VD_T, VS_P, VS_H, VS_T, HALF, V_FMT, HW)


def _check_float(name: str, t: torch.Tensor | None, shape: tuple[int, ...],
                 device: torch.device) -> None:
    if t is None:
        return
    if tuple(t.shape) != shape or t.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"{name} must be bf16/fp16/fp32 {list(shape)}, got {t.dtype} "
                               f"{tuple(t.shape)}")
    if t.device != device:
        raise KernelInputError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous")


def _rope_rows(name: str, x: torch.Tensor, t: int, d: int, device: torch.device) -> torch.Tensor:
    """``cos``/``sin`` ``[T, D]`` or ``[T, 1, D]`` -> a ``[T, D]`` view with unit inner stride."""
    if x.numel() != t * d or x.shape[0] != t or x.shape[-1] != d:
        raise KernelInputError(f"{name} must be [T, D] or [T, 1, D] = [{t}, {d}], got "
                               f"{tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES or x.device != device:
        raise KernelInputError(f"{name} must be a float tensor on {device}, got {x.dtype} on "
                               f"{x.device}")
    x = x.reshape(t, d)
    if d > 1 and x.stride(1) != 1:
        raise KernelInputError(f"{name} rows must be contiguous")
    return x


def _check_qkv(layout: PageLayout, qkv: torch.Tensor, num_heads: int) -> None:
    h, d = layout.num_kv_heads, layout.head_dim
    if d not in (32, 64, 128, 256):
        raise KernelInputError(f"qkv_rope_store supports head_dim 32/64/128/256, got {d}")
    if num_heads < h or num_heads % h:
        raise KernelInputError(f"num_heads must be a multiple of the {h} KV heads, got "
                               f"{num_heads}")
    width = (num_heads + 2 * h) * d
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"qkv must be bf16/fp16/fp32 [T, {width}], got {qkv.dtype} "
                               f"{tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise KernelInputError(f"qkv rows must be contiguous, strides {qkv.stride()}")


def qkv_rope_store(layout: PageLayout, pages: LayerPages, qkv: torch.Tensor, num_heads: int,
                   cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6, norm_offset: float = 0.0,
                   k_shift: torch.Tensor | None = None, k_map: torch.Tensor | None = None,
                   q_map: torch.Tensor | None = None, v_shift: torch.Tensor | None = None,
                   *, out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
                   v_out: torch.Tensor | None = None,
                   tokens_per_program: int | None = None) -> torch.Tensor:
    """QK-norm, RoPE, the K recipe and the K/V store from ``qkv`` in one launch; returns q'.

    Args:
        layout: the page geometry (``H`` KV heads, head_dim ``D`` in 32/64/128/256);
            ``pages`` = ``layout.layer_view(pool, layer)`` on ``qkv``'s device.
        qkv: ``[T, (Hq + 2H) * D]`` bf16/fp16/fp32, unit inner stride: each token's q heads,
            then k heads, then v heads (the fused projection's output).
        num_heads: ``Hq``, a multiple of ``H``.
        cos, sin: ``[T, D]`` or ``[T, 1, D]`` RoPE tables of each token's position
            (HF rotate_half layout; any float dtype).
        slot_mapping: int32/int64 ``[T]`` page slots; a negative slot stores nothing.
        k_scale, v_scale: global scales (float or one-element fp32 device tensor).
        q_norm, k_norm: ``[D]`` QK-norm gains (gain ``w + norm_offset``) or None.
        k_shift, v_shift: ``[H, D]`` or None; k_map, q_map: ``[H, D, D]`` (row-major, rows =
            input channels) or None: one layer's K recipe (``RecipeParams``), any float dtype.
        out: optional ``[T, Hq, D]`` float output (unit inner stride); default ``qkv.dtype``.
        k_out, v_out: optional ``[T, H, D]`` float tensors (unit inner stride, both or
            neither) that also receive K' and ``v - v_shift`` as stored (before quantization):
            the fresh keys and values of a prefill's attention.
        tokens_per_program: 16, 32 or 64 (benchmarks); default 16 below ``LONG_INPUT`` tokens,
            ``LONG_TOKENS`` from there.
    Returns:
        ``out``: q' = ``rope(norm(q)) @ q_map``. K' = ``(rope(norm(k)) - k_shift) @ k_map`` and
        ``v - v_shift`` are quantized into the pages (see :func:`~.store.store_kv`).
    Raises:
        KernelInputError: a bad shape, dtype, stride or device.
    """
    _check_qkv(layout, qkv, num_heads)
    device = qkv.device
    t = qkv.shape[0]
    h, d = layout.num_kv_heads, layout.head_dim
    check_pages(layout, pages, device)
    check_int_vector(slot_mapping, "slot_mapping", t, device)
    cos, sin = _rope_rows("cos", cos, t, d, device), _rope_rows("sin", sin, t, d, device)
    for name, x, shape in (("q_norm", q_norm, (d,)), ("k_norm", k_norm, (d,)),
                           ("k_shift", k_shift, (h, d)), ("v_shift", v_shift, (h, d)),
                           ("k_map", k_map, (h, d, d)), ("q_map", q_map, (h, d, d))):
        _check_float(name, x, shape, device)
    if out is None:
        out = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=device)
    elif (tuple(out.shape) != (t, num_heads, d) or out.dtype not in FLOAT_DTYPES
          or out.device != device or out.stride(2) != 1):
        raise KernelInputError(f"out must be a float [{t}, {num_heads}, {d}] on {device} with "
                               f"unit inner stride, got {out.dtype} {tuple(out.shape)}")
    _check_kv_out(k_out, v_out, (t, h, d), device)
    if tokens_per_program is None:
        tokens_per_program = TOKENS if t < LONG_INPUT else LONG_TOKENS
    elif tokens_per_program not in TILE_CHOICES:
        raise KernelInputError(f"tokens_per_program must be one of {sorted(TILE_CHOICES)}, got "
                               f"{tokens_per_program}")
    if t == 0:
        return out
    _launch(layout, pages, qkv, num_heads, cos, sin, slot_mapping, k_scale, v_scale,
            (q_norm, k_norm, k_shift, k_map, q_map, v_shift), eps, norm_offset, out,
            (k_out, v_out), tokens_per_program)
    return out


def _check_kv_out(k_out: torch.Tensor | None, v_out: torch.Tensor | None,
                  shape: tuple[int, int, int], device: torch.device) -> None:
    if (k_out is None) != (v_out is None):
        raise KernelInputError("k_out and v_out go together (both or neither)")
    for name, x in (("k_out", k_out), ("v_out", v_out)):
        if x is not None and (tuple(x.shape) != shape or x.dtype not in FLOAT_DTYPES
                              or x.device != device or x.stride(2) != 1):
            raise KernelInputError(f"{name} must be a float {list(shape)} on {device} with unit "
                                   f"inner stride, got {x.dtype} {tuple(x.shape)} on {x.device}")


def _launch(layout: PageLayout, pages: LayerPages, qkv: torch.Tensor, num_heads: int,
            cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_scale, v_scale,
            params: tuple, eps: float, norm_offset: float, out: torch.Tensor,
            kv_out: tuple, bt: int) -> None:
    """Launch :func:`_qkv_kernel` on checked arguments (``params`` = q_norm, k_norm,
    k_shift, k_map, q_map, v_shift, each a tensor or None; ``kv_out`` = k_out, v_out)."""
    device = qkv.device
    h, d = layout.num_kv_heads, layout.head_dim
    kf, vf = element_codes(layout)
    kd, vd = typed_data(pages.k_data, kf), typed_data(pages.v_data, vf)
    ks = pages.k_scale if pages.k_scale is not None else pages.k_data
    vs = pages.v_scale if pages.v_scale is not None else pages.v_data
    strides = [s for view in (kd, ks, vd, vs) for s in view.stride()[:3]]
    names = ("KD_P", "KD_H", "KD_T", "KS_P", "KS_H", "KS_T", "VD_P", "VD_H", "VD_T", "VS_P",
             "VS_H", "VS_T")
    has = {f"HAS_{n}": p is not None
           for n, p in zip(("QN", "KN", "KSHIFT", "KMAP", "QMAP", "VSHIFT"), params)}
    ptrs = [p if p is not None else qkv for p in params]   # unused pointers: any tensor
    g = num_heads // h
    grid = (triton.cdiv(qkv.shape[0], bt), h, g + 1)
    ko, vo = kv_out if kv_out[0] is not None else (out, out)   # unused pointers: any tensor
    _qkv_kernel[grid](
        qkv, cos, sin, slots, out, ptrs[0], ptrs[1], float(eps), float(norm_offset), ptrs[2],
        ptrs[3], ptrs[4], ptrs[5], kd, ks, vd, vs, scale_tensor(k_scale, device, "k_scale"),
        scale_tensor(v_scale, device, "v_scale"), ko, vo, qkv.shape[0], SX=qkv.stride(0),
        SC=cos.stride(0), SS=sin.stride(0), SO_T=out.stride(0), SO_H=out.stride(1),
        **dict(zip(names, strides)), HQ=num_heads, H=h, HALF=d // 2, PAGE=layout.page_size,
        **has, K_FMT=kf, V_FMT=vf, HW=hw_fp8(device), DOT_BF16=device.type == "cuda",
        HAS_KV_OUT=kv_out[0] is not None, SKO_T=ko.stride(0), SKO_H=ko.stride(1),
        SVO_T=vo.stride(0), SVO_H=vo.stride(1), BT=bt, num_warps=TILE_CHOICES[bt],
        enable_fp_fusion=False)
