"""Fused paged decode attention, split-K with a reduce kernel (portable Triton).

Program ``(seq, kv_head, split)`` runs an online softmax over its share of the
sequence's ``BLOCK_N``-token tiles for all ``Hq / H`` query heads of the KV head
(padded to ``BLOCK_G >= 16`` rows for ``tl.dot``), dequantizing K and V in the
kernel. The head dim of each tile is split into ``PARTS`` (2 or 4) dot operands
so that quantized rows need no interleave: NVFP4 reads words of ``PARTS`` codes
(bytes, or int16 for 4 parts) and part ``r`` takes nibble ``r`` of each word;
FP8 with 4 parts reads int32 words of 4 values likewise; otherwise the parts are
contiguous slices. ``q`` and the output use the same index map. On NVIDIA GPUs
the code expansion is inline PTX (``prmt``/``lop3``, ``cvt...e4m3x2``).

Dequantized operands are exact fp16 values times a per-format power of two
(NVFP4: E2M1 bit placement gives value * 2^-14, times the E4M3 block scale; FP8
without hardware conversion: value * 2^-8); those factors and the global scales
fold into the softmax scale (K) and the output (V).

The grid is ``(B, H, num_splits)``; ``num_splits`` depends only on host-known
shapes, every length is read on the device, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout
from ._common import (FLOAT_DTYPES, FMT_BF16, FMT_FP8, FMT_NVFP4, check_block_tables,
                      check_pages, e2m1_hi_f16, e2m1_lo_f16, e2m1_nibble_f16,
                      e2m1_pair_f16_ptx, e2m1_quad_f16_ptx, e4m3_byte_f16, e4m3_quad_f16_ptx,
                      e4m3_to_f16, e4m3_to_f16_raw, element_codes, fp8_raw_factor, hw_fp8,
                      scale_tensor, typed_data)

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
# (block_n, num_stages) per widest format code (BF16, FP8, NVFP4), from the H200 sweep
# in bench/kernels.py; num_warps 4.
DEFAULT_KNOBS = {FMT_BF16: (64, 2), FMT_FP8: (128, 3), FMT_NVFP4: (64, 2)}


@triton.jit
def _interleaved(FMT: tl.constexpr, PARTS: tl.constexpr):
    """Whether part ``r`` holds element ``r`` of each word (else contiguous head-dim slices)."""
    return FMT == 2 or (FMT == 1 and PARTS == 4)


@triton.jit
def _part_index(w, R: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr):
    """Head-dim index of column ``w`` of part ``R`` (of ``PARTS``) for format ``FMT``."""
    if _interleaved(FMT, PARTS):
        return PARTS * w + R
    else:
        return R * (D // PARTS) + w


@triton.jit
def _nvfp4_scales(s_ptr, srow, m2, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  PARTS: tl.constexpr, HW: tl.constexpr, SCALE_MODE: tl.constexpr):
    """Block scales expanded to ``[BLOCK_N, D // PARTS]`` fp16, one per code word."""
    W: tl.constexpr = 16 // PARTS  # words per 16-element block
    if SCALE_MODE == 0:
        w = tl.arange(0, D // PARTS)[None, :]
        sc = tl.load(s_ptr + srow[:, None] + w // W, mask=m2, other=0)
        return e4m3_to_f16(sc, HW)
    else:
        NB: tl.constexpr = D // 16
        sc = tl.load(s_ptr + srow[:, None] + tl.arange(0, NB)[None, :], mask=m2, other=0)
        s3 = tl.broadcast_to(e4m3_to_f16(sc, HW)[:, :, None], [BLOCK_N, NB, W])
        return tl.reshape(s3, [BLOCK_N, D // PARTS])


@triton.jit
def _load_nvfp4(ptr, s_ptr, srow, m2, BLOCK_N: tl.constexpr, D: tl.constexpr,
                PARTS: tl.constexpr, HW: tl.constexpr, SCALE_MODE: tl.constexpr,
                PTX: tl.constexpr):
    """NVFP4 tile as ``PARTS`` operands: words are bytes (2 codes) or int16 (4 codes)."""
    words = tl.load(ptr, mask=m2, other=0)
    s = _nvfp4_scales(s_ptr, srow, m2, BLOCK_N, D, PARTS, HW, SCALE_MODE)
    if PARTS == 4:
        if PTX:
            a, b, c, d = e2m1_quad_f16_ptx(words)
        else:
            a = e2m1_nibble_f16(words, 0)
            b = e2m1_nibble_f16(words, 1)
            c = e2m1_nibble_f16(words, 2)
            d = e2m1_nibble_f16(words, 3)
        return a * s, b * s, c * s, d * s
    else:
        if PTX:
            a, b = e2m1_pair_f16_ptx(words)
        else:
            a = e2m1_lo_f16(words)
            b = e2m1_hi_f16(words)
        return a * s, b * s, a, b


@triton.jit
def _load_tile(d_ptr, row, s_ptr, srow, tmask, BLOCK_N: tl.constexpr, D: tl.constexpr,
               FMT: tl.constexpr, PARTS: tl.constexpr, HW: tl.constexpr,
               DOT_F32: tl.constexpr, SCALE_MODE: tl.constexpr, PTX: tl.constexpr):
    """Load and dequantize one K or V tile as ``PARTS`` ``[BLOCK_N, D // PARTS]`` operands.

    Interleaved formats read words of ``PARTS`` elements (NVFP4: bytes or int16 of
    codes; FP8 with 4 parts: int32 of 4 values) and part ``r`` takes element ``r``
    of every word, so the MMA fragments need no nibble or byte shuffles. With 2
    parts the last two returned tensors are placeholders.
    """
    w = tl.arange(0, D // PARTS)[None, :]
    m2 = tmask[:, None]
    ptr = d_ptr + row[:, None] + w
    if FMT == 2:
        a, b, c, d = _load_nvfp4(ptr, s_ptr, srow, m2, BLOCK_N, D, PARTS, HW, SCALE_MODE, PTX)
    elif FMT == 1 and PARTS == 4:
        words = tl.load(ptr, mask=m2, other=0)
        if PTX and HW:
            a, b, c, d = e4m3_quad_f16_ptx(words)
        else:
            a = e4m3_byte_f16(words, 0, HW)
            b = e4m3_byte_f16(words, 1, HW)
            c = e4m3_byte_f16(words, 2, HW)
            d = e4m3_byte_f16(words, 3, HW)
    elif FMT == 1:
        a = e4m3_to_f16_raw(tl.load(ptr, mask=m2, other=0), HW)
        b = e4m3_to_f16_raw(tl.load(ptr + D // 2, mask=m2, other=0), HW)
        c, d = a, b
    else:
        a = tl.load(ptr, mask=m2, other=0.0)
        b = tl.load(ptr + D // PARTS, mask=m2, other=0.0)
        if PARTS == 4:
            c = tl.load(ptr + D // 2, mask=m2, other=0.0)
            d = tl.load(ptr + 3 * D // 4, mask=m2, other=0.0)
        else:
            c, d = a, b
    if DOT_F32:
        a, b, c, d = a.to(tl.float32), b.to(tl.float32), c.to(tl.float32), d.to(tl.float32)
    return a, b, c, d


@triton.jit
def _load_q_part(q_row, gmask, R: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr,
                 PARTS: tl.constexpr, DT: tl.constexpr):
    idx = _part_index(tl.arange(0, D // PARTS), R, FMT, D, PARTS)
    return tl.load(q_row + idx[None, :], mask=gmask, other=0.0).to(DT)


@triton.jit
def _load_q(q_row, gmask, FMT: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr,
            DT: tl.constexpr):
    """The query group split like K (parts 2 and 3 repeat 0 and 1 when ``PARTS == 2``)."""
    return (_load_q_part(q_row, gmask, 0, FMT, D, PARTS, DT),
            _load_q_part(q_row, gmask, 1, FMT, D, PARTS, DT),
            _load_q_part(q_row, gmask, 2 % PARTS, FMT, D, PARTS, DT),
            _load_q_part(q_row, gmask, 3 % PARTS, FMT, D, PARTS, DT))


@triton.jit
def _scores(qa, qb, qc, qd, ka, kb, kc, kd, PARTS: tl.constexpr):
    """``q . k^T`` summed over the parts: ``[BLOCK_G, BLOCK_N]`` fp32."""
    s = tl.dot(qa, tl.trans(ka))
    s = tl.dot(qb, tl.trans(kb), s)
    if PARTS == 4:
        s = tl.dot(qc, tl.trans(kc), s)
        s = tl.dot(qd, tl.trans(kd), s)
    return s


@triton.jit
def _store_part(ptr, val, gmask, R: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr,
                PARTS: tl.constexpr):
    if R < PARTS:
        idx = _part_index(tl.arange(0, D // PARTS), R, FMT, D, PARTS)
        tl.store(ptr + idx[None, :], val.to(ptr.dtype.element_ty), mask=gmask)


@triton.jit
def _store_parts(ptr, a, b, c, d, gmask, FMT: tl.constexpr, D: tl.constexpr,
                 PARTS: tl.constexpr):
    """Store the part accumulators ``[BLOCK_G, D // PARTS]`` of one output row block."""
    _store_part(ptr, a, gmask, 0, FMT, D, PARTS)
    _store_part(ptr, b, gmask, 1, FMT, D, PARTS)
    _store_part(ptr, c, gmask, 2, FMT, D, PARTS)
    _store_part(ptr, d, gmask, 3, FMT, D, PARTS)


@triton.jit
def _decode_kernel(q_ptr, q_b, q_h, bt_ptr, bt_b, seq_ptr, kd_ptr, kd_p, ks_ptr, ks_p,
                   vd_ptr, vd_p, vs_ptr, vs_p, kgs_ptr, vgs_ptr, po_ptr, pm_ptr, o_ptr, o_b, o_h,
                   qk_scale, v_fac, nsplit, PAGE: tl.constexpr, K_ROW: tl.constexpr,
                   V_ROW: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                   K_FMT: tl.constexpr, V_FMT: tl.constexpr, HW: tl.constexpr,
                   DOT_F32: tl.constexpr, SCALE_MODE: tl.constexpr, PTX: tl.constexpr,
                   QK_DT: tl.constexpr, PV_DT: tl.constexpr, PARTS: tl.constexpr):
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
    qa, qb, qc, qd = _load_q(q_row, gmask, K_FMT, D, PARTS, QK_DT)
    scale = qk_scale * tl.load(kgs_ptr)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_a = tl.zeros([BLOCK_G, D // PARTS], tl.float32)
    acc_b = tl.zeros([BLOCK_G, D // PARTS], tl.float32)
    acc_c = tl.zeros([BLOCK_G, D // PARTS], tl.float32)  # used when PARTS == 4
    acc_d = tl.zeros([BLOCK_G, D // PARTS], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * bt_b
    for t in range(t_lo, t_hi):
        tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tmask = tok < seq_len
        page = tl.load(bt_row + tok // PAGE, mask=tmask, other=0).to(tl.int64)
        slot = h * PAGE + tok % PAGE
        ka, kb, kc, kd = _load_tile(kd_ptr, page * kd_p + slot * K_ROW, ks_ptr,
                                    page * ks_p + slot * (D // 16), tmask, BLOCK_N, D, K_FMT,
                                    PARTS, HW, DOT_F32, SCALE_MODE, PTX)
        s = _scores(qa, qb, qc, qd, ka, kb, kc, kd, PARTS) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        va, vb, vc, vd = _load_tile(vd_ptr, page * vd_p + slot * V_ROW, vs_ptr,
                                    page * vs_p + slot * (D // 16), tmask, BLOCK_N, D, V_FMT,
                                    PARTS, HW, DOT_F32, SCALE_MODE, PTX)
        pv = p.to(PV_DT)
        acc_a = tl.dot(pv, va, acc_a * alpha[:, None])
        acc_b = tl.dot(pv, vb, acc_b * alpha[:, None])
        if PARTS == 4:
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
    _store_parts(o_row, acc_a * f, acc_b * f, acc_c * f, acc_d * f, gmask, V_FMT, D, PARTS)


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
                       device: torch.device, ctas_per_sm: int = 8) -> int:
    """Splits per (sequence, KV head) giving about ``ctas_per_sm`` programs per SM.

    Depends only on host-known shapes (never on ``seq_lens``' values), so one
    batch-size bucket keeps one grid under CUDA graphs.
    """
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 4)
    want = triton.cdiv(ctas_per_sm * sms, max(batch * num_kv_heads, 1))
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


def _resolve_knobs(layout: PageLayout, block_n: int | None, num_stages: int | None,
                   parts: int | None) -> tuple[int, int, int]:
    """Fill in per-format defaults and check the tuning knobs."""
    kf, vf = element_codes(layout)
    default_n, default_stages = DEFAULT_KNOBS[max(kf, vf)]
    block_n = block_n or default_n
    num_stages = default_stages if num_stages is None else num_stages
    if parts is None:
        parts = 4 if min(kf, vf) > FMT_BF16 and layout.head_dim >= 128 else 2
    if parts not in (2, 4):
        raise KernelInputError(f"parts must be 2 or 4, got {parts}")
    if block_n < 16 or block_n & (block_n - 1):
        raise KernelInputError(f"block_n must be a power of two >= 16, got {block_n}")
    return block_n, num_stages, parts


def decode_attention(layout: PageLayout, pages: LayerPages, q: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                     k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                     *, out: torch.Tensor | None = None, num_splits: int | None = None,
                     max_seq_len: int | None = None, block_n: int | None = None,
                     num_warps: int = 4, num_stages: int | None = None, scale_mode: int = 1,
                     ptx: bool | None = None, parts: int | None = None) -> torch.Tensor:
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
            gathers NVFP4 scales per word, 1 broadcasts one load per token); defaults
            per format from :data:`DEFAULT_KNOBS`, measured on an H200.
        ptx: NVFP4/FP8 code expansion in inline PTX (default: on NVIDIA GPUs).
        parts: head-dim split of the dots, 2 or 4 (default 4 for quantized K and V
            with ``head_dim >= 128``, else 2).
    Returns:
        ``out``: ``[B, Hq, D]``.
    """
    _check_q(layout, q, out)
    device = q.device
    check_block_tables(block_tables, seq_lens, device)
    check_pages(layout, pages, device)
    if block_tables.shape[0] != q.shape[0]:
        raise KernelInputError(f"block_tables has {block_tables.shape[0]} rows, q {q.shape[0]}")
    if layout.head_dim not in (64, 128, 256):
        raise KernelInputError(f"decode supports head_dim 64, 128 or 256, got {layout.head_dim}")
    kf, vf = element_codes(layout)
    block_n, num_stages, parts = _resolve_knobs(layout, block_n, num_stages, parts)
    nb, hq, d = q.shape
    h = layout.num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if nb == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * layout.page_size
    nsplit = num_splits or default_num_splits(nb, h, max_seq_len, device)
    hw = hw_fp8(device)
    ptx_dequant = (device.type == "cuda" and torch.version.hip is None) if ptx is None else ptx
    group = hq // h
    part_o = torch.empty((nb, hq, nsplit, d) if nsplit > 1 else (1,), dtype=torch.float32,
                         device=device)
    part_m = torch.empty((nb, hq, nsplit, 2) if nsplit > 1 else (1,), dtype=torch.float32,
                         device=device)
    kd, vd = typed_data(pages.k_data, kf, parts == 4), typed_data(pages.v_data, vf, parts == 4)
    ks = pages.k_scale if pages.k_scale is not None else pages.k_data
    vs = pages.v_scale if pages.v_scale is not None else pages.v_data
    qk_scale = sm_scale * LOG2E * _format_factor(kf, hw)
    _decode_kernel[(nb, h, nsplit)](  # partials unused (1 element) when nsplit == 1
        q, q.stride(0), q.stride(1), block_tables, block_tables.stride(0), seq_lens,
        kd, kd.stride(0), ks, ks.stride(0), vd, vd.stride(0), vs, vs.stride(0),
        scale_tensor(k_scale if layout.fmt.k.uses_global_scale else 1.0, device, "k_scale"),
        scale_tensor(v_scale if layout.fmt.v.uses_global_scale else 1.0, device, "v_scale"),
        part_o, part_m, out, out.stride(0), out.stride(1), qk_scale, _format_factor(vf, hw),
        nsplit, PAGE=layout.page_size, K_ROW=kd.shape[3], V_ROW=vd.shape[3], GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), D=d, BLOCK_N=block_n,
        DIRECT=nsplit == 1, K_FMT=kf, V_FMT=vf, HW=hw, DOT_F32=device.type == "cpu",
        SCALE_MODE=scale_mode, PTX=ptx_dequant, QK_DT=_dot_dtype(kf, device),
        PV_DT=_dot_dtype(vf, device), PARTS=parts, num_warps=num_warps, num_stages=num_stages)
    if nsplit > 1:
        _reduce_kernel[(nb, hq)](part_o, part_m, out, out.stride(0), out.stride(1), hq, nsplit,
                                 BLOCK_S=triton.next_power_of_2(nsplit), D=d, num_warps=4)
    return out
