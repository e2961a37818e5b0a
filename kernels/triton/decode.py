"""Fused paged decode attention, split-K with a reduce kernel (portable Triton).

Program ``(seq, kv_head, split)`` runs an online softmax over its share of the
sequence's ``BLOCK_N``-token tiles for all ``Hq / H`` query heads of the KV head
(padded to ``BLOCK_G >= 16`` rows for ``tl.dot``), dequantizing K and V in the
kernel. Each KV tile is split in two halves of the head dim so that NVFP4 needs
no nibble interleave: half A holds the low nibbles (even elements), half B the
high nibbles (odd elements); BF16 and FP8 use the first and second halves.

Dequantized operands are exact fp16 values times a per-format power of two
(NVFP4: E2M1 bit placement gives value * 2^-14, times the E4M3 block scale; FP8
without hardware conversion: value * 2^-8); those factors and the global scales
fold into the softmax scale (K) and the output (V).

The grid is ``(B, H, num_splits)``; ``num_splits`` depends only on host-known
shapes, every length is read on the device, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout
from ._common import (FLOAT_DTYPES, FMT_BF16, FMT_FP8, FMT_NVFP4, check_block_tables,
                      check_pages, e2m1_nibble_f16, e2m1_quad_f16_ptx, e4m3_to_f16,
                      e4m3_to_f16_raw, element_codes, fp8_raw_factor, hw_fp8, scale_tensor,
                      typed_data)

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _part_index(w, R: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr):
    """Head-dim index of column ``w`` of part ``R`` (of 4) for element format ``FMT``."""
    if FMT == 2:
        return 4 * w + R
    else:
        return R * (D // 4) + w


@triton.jit
def _nvfp4_scales(s_ptr, srow, m2, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  HW: tl.constexpr, SCALE_MODE: tl.constexpr):
    """Block scales expanded to ``[BLOCK_N, D // 4]`` fp16 (one per 16-bit code word)."""
    if SCALE_MODE == 0:
        w = tl.arange(0, D // 4)[None, :]
        sc = tl.load(s_ptr + srow[:, None] + w // 4, mask=m2, other=0)
        return e4m3_to_f16(sc, HW)
    else:
        NB: tl.constexpr = D // 16
        sc = tl.load(s_ptr + srow[:, None] + tl.arange(0, NB)[None, :], mask=m2, other=0)
        s3 = tl.broadcast_to(e4m3_to_f16(sc, HW)[:, :, None], [BLOCK_N, NB, 4])
        return tl.reshape(s3, [BLOCK_N, D // 4])


@triton.jit
def _load_tile(d_ptr, row, s_ptr, srow, tmask, BLOCK_N: tl.constexpr, D: tl.constexpr,
               FMT: tl.constexpr, HW: tl.constexpr, DOT_F32: tl.constexpr,
               SCALE_MODE: tl.constexpr, PTX: tl.constexpr):
    """Load and dequantize one K or V tile as four ``[BLOCK_N, D // 4]`` dot operands.

    NVFP4 rows are read as 16-bit words (4 codes each): part ``r`` takes nibble
    ``r`` of every word, so each word feeds the same position of the four parts
    and the MMA fragments need no nibble interleave.
    """
    w = tl.arange(0, D // 4)[None, :]
    m2 = tmask[:, None]
    ptr = d_ptr + row[:, None] + w
    if FMT == 2:
        words = tl.load(ptr, mask=m2, other=0)
        s = _nvfp4_scales(s_ptr, srow, m2, BLOCK_N, D, HW, SCALE_MODE)
        if PTX:
            a, b, c, d = e2m1_quad_f16_ptx(words)
        else:
            a = e2m1_nibble_f16(words, 0)
            b = e2m1_nibble_f16(words, 1)
            c = e2m1_nibble_f16(words, 2)
            d = e2m1_nibble_f16(words, 3)
        a, b, c, d = a * s, b * s, c * s, d * s
    elif FMT == 1:
        a = e4m3_to_f16_raw(tl.load(ptr, mask=m2, other=0), HW)
        b = e4m3_to_f16_raw(tl.load(ptr + D // 4, mask=m2, other=0), HW)
        c = e4m3_to_f16_raw(tl.load(ptr + D // 2, mask=m2, other=0), HW)
        d = e4m3_to_f16_raw(tl.load(ptr + 3 * D // 4, mask=m2, other=0), HW)
    else:
        a = tl.load(ptr, mask=m2, other=0.0)
        b = tl.load(ptr + D // 4, mask=m2, other=0.0)
        c = tl.load(ptr + D // 2, mask=m2, other=0.0)
        d = tl.load(ptr + 3 * D // 4, mask=m2, other=0.0)
    if DOT_F32:
        a, b, c, d = a.to(tl.float32), b.to(tl.float32), c.to(tl.float32), d.to(tl.float32)
    return a, b, c, d


@triton.jit
def _load_q(q_row, gmask, R: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr,
            DT: tl.constexpr):
    idx = _part_index(tl.arange(0, D // 4), R, FMT, D)
    return tl.load(q_row + idx[None, :], mask=gmask, other=0.0).to(DT)


@triton.jit
def _store_part(ptr, val, gmask, R: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr):
    idx = _part_index(tl.arange(0, D // 4), R, FMT, D)
    tl.store(ptr + idx[None, :], val.to(ptr.dtype.element_ty), mask=gmask)


@triton.jit
def _decode_kernel(q_ptr, q_b, q_h, bt_ptr, bt_b, seq_ptr, kd_ptr, kd_p, ks_ptr, ks_p,
                   vd_ptr, vd_p, vs_ptr, vs_p, kgs_ptr, vgs_ptr, po_ptr, pm_ptr, o_ptr, o_b, o_h,
                   qk_scale, v_fac, nsplit, PAGE: tl.constexpr, K_ROW: tl.constexpr,
                   V_ROW: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                   K_FMT: tl.constexpr, V_FMT: tl.constexpr, HW: tl.constexpr,
                   DOT_F32: tl.constexpr, SCALE_MODE: tl.constexpr, PTX: tl.constexpr,
                   QK_DT: tl.constexpr, PV_DT: tl.constexpr):
    """Online softmax over one split of one sequence for one KV head's query group.

    Inside a page, rows are contiguous (checked by the wrapper): element offset of
    (head, slot) is ``(head * PAGE + slot) * ROW``; constexpr strides let the
    compiler prove 16-byte alignment.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_ptr + b)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per = tl.cdiv(n_tiles, nsplit)
    t_lo = sp * per
    t_hi = tl.minimum(t_lo + per, n_tiles)
    g = tl.arange(0, BLOCK_G)
    gmask = (g < GROUP)[:, None]
    hq = (h * GROUP + g).to(tl.int64)
    q_row = q_ptr + b.to(tl.int64) * q_b + hq[:, None] * q_h
    qa = _load_q(q_row, gmask, 0, K_FMT, D, QK_DT)
    qb = _load_q(q_row, gmask, 1, K_FMT, D, QK_DT)
    qc = _load_q(q_row, gmask, 2, K_FMT, D, QK_DT)
    qd = _load_q(q_row, gmask, 3, K_FMT, D, QK_DT)
    scale = qk_scale * tl.load(kgs_ptr)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_a = tl.zeros([BLOCK_G, D // 4], tl.float32)
    acc_b = tl.zeros([BLOCK_G, D // 4], tl.float32)
    acc_c = tl.zeros([BLOCK_G, D // 4], tl.float32)
    acc_d = tl.zeros([BLOCK_G, D // 4], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * bt_b
    for t in range(t_lo, t_hi):
        tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tmask = tok < seq_len
        page = tl.load(bt_row + tok // PAGE, mask=tmask, other=0).to(tl.int64)
        slot = h * PAGE + tok % PAGE
        ka, kb, kc, kd = _load_tile(kd_ptr, page * kd_p + slot * K_ROW, ks_ptr,
                                    page * ks_p + slot * (D // 16), tmask, BLOCK_N, D, K_FMT,
                                    HW, DOT_F32, SCALE_MODE, PTX)
        s = tl.dot(qa, tl.trans(ka))
        s = tl.dot(qb, tl.trans(kb), s)
        s = tl.dot(qc, tl.trans(kc), s)
        s = tl.dot(qd, tl.trans(kd), s) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        va, vb, vc, vd = _load_tile(vd_ptr, page * vd_p + slot * V_ROW, vs_ptr,
                                    page * vs_p + slot * (D // 16), tmask, BLOCK_N, D, V_FMT,
                                    HW, DOT_F32, SCALE_MODE, PTX)
        pv = p.to(PV_DT)
        acc_a = tl.dot(pv, va, acc_a * alpha[:, None])
        acc_b = tl.dot(pv, vb, acc_b * alpha[:, None])
        acc_c = tl.dot(pv, vc, acc_c * alpha[:, None])
        acc_d = tl.dot(pv, vd, acc_d * alpha[:, None])
        m_i = m_new
    vscale = v_fac * tl.load(vgs_ptr)
    if DIRECT:
        f = (vscale / l_i)[:, None]
        o_row = o_ptr + b.to(tl.int64) * o_b + hq[:, None] * o_h
    else:
        f = vscale
        part = (b * (tl.num_programs(1) * GROUP) + hq) * nsplit + sp  # [BLOCK_G]
        o_row = po_ptr + part[:, None] * D
        tl.store(pm_ptr + part * 2, m_i, mask=g < GROUP)
        tl.store(pm_ptr + part * 2 + 1, l_i, mask=g < GROUP)
    _store_part(o_row, acc_a * f, gmask, 0, V_FMT, D)
    _store_part(o_row, acc_b * f, gmask, 1, V_FMT, D)
    _store_part(o_row, acc_c * f, gmask, 2, V_FMT, D)
    _store_part(o_row, acc_d * f, gmask, 3, V_FMT, D)


@triton.jit
def _reduce_kernel(po_ptr, pm_ptr, o_ptr, o_b, o_h, HQ, nsplit, BLOCK_S: tl.constexpr,
                   D: tl.constexpr):
    """Combine the splits of one (sequence, query head): weights ``2^(m_s - max m)``."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < nsplit
    part = (b.to(tl.int64) * HQ + hq) * nsplit + s
    m = tl.load(pm_ptr + part * 2, mask=smask, other=float("-inf"))
    l_s = tl.load(pm_ptr + part * 2 + 1, mask=smask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    d = tl.arange(0, D)
    o = tl.load(po_ptr + part[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w * l_s, 0)
    tl.store(o_ptr + b.to(tl.int64) * o_b + hq * o_h + d, res.to(o_ptr.dtype.element_ty))


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int,
                       device: torch.device) -> int:
    """Splits per (sequence, KV head) so that about four programs per SM are in flight.

    Depends only on host-known shapes (never on ``seq_lens``' values), so one
    batch-size bucket keeps one grid under CUDA graphs.
    """
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 4)
    want = triton.cdiv(4 * sms, max(batch * num_kv_heads, 1))
    cap = triton.cdiv(max(max_seq_len, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap))


def _check_q(layout: PageLayout, q: torch.Tensor, out: torch.Tensor | None) -> None:
    h, d = layout.num_kv_heads, layout.head_dim
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % h:
        raise KernelInputError(f"q must be [B, Hq, {d}] with Hq a multiple of {h}, got "
                               f"{tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"q must be bf16/fp16/fp32, got {q.dtype}")
    if q.stride(2) != 1:
        raise KernelInputError("q must have a unit stride on head_dim")
    if out is not None and (out.shape != q.shape or out.dtype not in FLOAT_DTYPES
                            or out.device != q.device or out.stride(2) != 1):
        raise KernelInputError(f"out must be a float tensor {tuple(q.shape)} on {q.device} "
                               f"with unit inner stride, got {out.dtype} {tuple(out.shape)}")


def _dot_dtype(elem: int, device: torch.device):
    """Operand type of a tensor core dot: fp32 under the interpreter (its bf16 dot is wrong)."""
    if device.type == "cpu":
        return tl.float32
    return tl.bfloat16 if elem == FMT_BF16 else tl.float16


def _format_factor(elem: int, hw: bool) -> float:
    """What the kernel's dequantized operand must be multiplied by (before the global scale)."""
    if elem == FMT_NVFP4:
        return 16384.0
    return fp8_raw_factor(hw) if elem == FMT_FP8 else 1.0


def decode_attention(layout: PageLayout, pages: LayerPages, q: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                     k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                     *, out: torch.Tensor | None = None, num_splits: int | None = None,
                     max_seq_len: int | None = None, block_n: int = 64, num_warps: int = 4,
                     num_stages: int | None = None, scale_mode: int = 1,
                     ptx: bool | None = None) -> torch.Tensor:
    """Paged GQA decode: ``q[b]`` attends over the first ``seq_lens[b]`` cached tokens.

    Args:
        q: ``[B, Hq, D]`` bf16/fp16/fp32, ``Hq`` a multiple of the layout's KV heads.
        block_tables: int32 ``[B, M]``; seq_lens: int ``[B]``, each in ``[1, M * S]``
            (not checked: that would need a host sync).
        k_scale, v_scale: global scales (float or one-element fp32 device tensor).
        out: optional ``[B, Hq, D]`` output (any float dtype); default ``q.dtype``.
        num_splits: split-K factor; default :func:`default_num_splits` from
            ``max_seq_len`` (default ``M * S``).
        block_n, num_warps, num_stages, scale_mode: tuning knobs (``scale_mode`` 0
            gathers NVFP4 scales per byte, 1 broadcasts one load per token).
        ptx: NVFP4 nibble expansion in inline PTX (default: on NVIDIA GPUs).
    Returns:
        ``out``: ``[B, Hq, D]``.
    """
    _check_q(layout, q, out)
    device = q.device
    check_block_tables(block_tables, seq_lens, device)
    check_pages(layout, pages, device)
    if block_tables.shape[0] != q.shape[0]:
        raise KernelInputError(f"block_tables has {block_tables.shape[0]} rows, q {q.shape[0]}")
    if block_n < 16 or block_n & (block_n - 1):
        raise KernelInputError(f"block_n must be a power of two >= 16, got {block_n}")
    nb, hq, d = q.shape
    h = layout.num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if nb == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * layout.page_size
    nsplit = num_splits or default_num_splits(nb, h, max_seq_len, device)
    kf, vf = element_codes(layout)
    hw = hw_fp8(device)
    ptx_dequant = (device.type == "cuda" and torch.version.hip is None) if ptx is None else ptx
    group = hq // h
    part_o = torch.empty((nb, hq, nsplit, d) if nsplit > 1 else (1,), dtype=torch.float32,
                         device=device)
    part_m = torch.empty((nb, hq, nsplit, 2) if nsplit > 1 else (1,), dtype=torch.float32,
                         device=device)
    kd, vd = typed_data(pages.k_data, kf, True), typed_data(pages.v_data, vf, True)
    ks = pages.k_scale if pages.k_scale is not None else pages.k_data
    vs = pages.v_scale if pages.v_scale is not None else pages.v_data
    if num_stages is None:
        num_stages = 1 if FMT_NVFP4 in (kf, vf) else 2
    qk_scale = sm_scale * LOG2E * _format_factor(kf, hw)
    _decode_kernel[(nb, h, nsplit)](
        q, q.stride(0), q.stride(1), block_tables, block_tables.stride(0), seq_lens,
        kd, kd.stride(0), ks, ks.stride(0), vd, vd.stride(0), vs, vs.stride(0),
        scale_tensor(k_scale if layout.fmt.k.uses_global_scale else 1.0, device, "k_scale"),
        scale_tensor(v_scale if layout.fmt.v.uses_global_scale else 1.0, device, "v_scale"),
        part_o, part_m, out, out.stride(0), out.stride(1), qk_scale, _format_factor(vf, hw),
        nsplit, PAGE=layout.page_size, K_ROW=kd.shape[3], V_ROW=vd.shape[3], GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=d, BLOCK_N=block_n, DIRECT=nsplit == 1, K_FMT=kf, V_FMT=vf, HW=hw, DOT_F32=device.type == "cpu",
        SCALE_MODE=scale_mode, PTX=ptx_dequant, QK_DT=_dot_dtype(kf, device), PV_DT=_dot_dtype(vf, device),
        num_warps=num_warps, num_stages=num_stages)
    if nsplit > 1:
        _reduce_kernel[(nb, hq)](part_o, part_m, out, out.stride(0), out.stride(1), hq, nsplit,
                                 BLOCK_S=triton.next_power_of_2(nsplit), D=d, num_warps=4)
    return out
