"""The per-head pieces of :mod:`.qkv`'s kernel (Triton device functions).

Rows are handled in halves of a head (``lo`` = channels ``[0, D/2)``, ``hi`` =
``[D/2, D)``; see :mod:`.qkv`). With ``SPLIT == 2`` (``qkv_rope_store(...,
split_halves=True)``) program ``part`` of a head computes and stores only output half
``part``: :func:`_map_part` runs two of :func:`_map`'s four MMAs (half of the map read),
:func:`_store_parts` and :func:`_store_out` write that half alone. With
``SPLIT == 1`` they pass both halves through, so the kernel body is one code for both.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .store import _store_rows


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
def _map_part(lo, hi, m_ptr, part, HALF: tl.constexpr, DOT_BF16: tl.constexpr):
    """Output half ``part`` (0: channels ``[0, HALF)``, 1: ``[HALF, 2 * HALF)``) of
    ``[lo | hi] @ M``: two of :func:`_map`'s four MMAs, half of the map read."""
    r = tl.arange(0, HALF)[:, None] * (2 * HALF) + part * HALF
    c = tl.arange(0, HALF)[None, :]
    zero = tl.zeros(lo.shape, tl.float32)
    return _dot(hi, tl.load(m_ptr + HALF * 2 * HALF + r + c),
                _dot(lo, tl.load(m_ptr + r + c), zero, DOT_BF16), DOT_BF16)


@triton.jit
def _transform(lo, hi, m_ptr, part, HAS_MAP: tl.constexpr, SPLIT: tl.constexpr,
               HALF: tl.constexpr, DOT_BF16: tl.constexpr):
    """``(a, b)``: with ``SPLIT == 1`` both halves of ``[lo | hi] (@ M)``; with 2 only half
    ``part`` of it, as ``a`` (``b`` is ``a`` again)."""
    if SPLIT == 1:
        if HAS_MAP:
            lo, hi = _map(lo, hi, m_ptr, HALF, DOT_BF16)
        return lo, hi
    else:
        if HAS_MAP:
            x = _map_part(lo, hi, m_ptr, part, HALF, DOT_BF16)
        else:
            x = tl.where(part == 0, lo, hi)
        return x, x


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


@triton.jit
def _store_parts(a, b, part, d_ptr, s_ptr, gs_ptr, page, off, h, rmask, D_P, D_H, D_T, S_P,
                 S_H, S_T, HALF: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr,
                 SPLIT: tl.constexpr):
    """Both halves ``a``, ``b`` (``SPLIT == 1``) or half ``part`` = ``a`` (2) of one head's rows."""
    if SPLIT == 1:
        _store_head(a, b, d_ptr, s_ptr, gs_ptr, page, off, h, rmask, D_P, D_H, D_T, S_P, S_H,
                    S_T, HALF, FMT, HW)
    else:
        drow = page * D_P + (h * D_H + off * D_T)
        srow = page * S_P + (h * S_H + off * S_T)
        if FMT == 2:    # NVFP4: half 1's codes start HALF / 2 bytes in, its scales HALF / 16
            drow += part * (HALF // 2)
            srow += part * (HALF // 16)
        else:
            drow += part * HALF
        _store_half(a, d_ptr, drow, s_ptr, srow, gs_ptr, rmask, HALF, FMT, HW)


@triton.jit
def _store_out(ptr, row, a, b, part, tmask, HALF: tl.constexpr, SPLIT: tl.constexpr):
    """Rows of both halves (``SPLIT == 1``) or of half ``part`` (2) into a float tensor."""
    o = ptr + row[:, None] + tl.arange(0, HALF)[None, :]
    if SPLIT == 1:
        tl.store(o, a.to(ptr.dtype.element_ty), mask=tmask[:, None])
        tl.store(o + HALF, b.to(ptr.dtype.element_ty), mask=tmask[:, None])
    else:
        tl.store(o + part * HALF, a.to(ptr.dtype.element_ty), mask=tmask[:, None])
