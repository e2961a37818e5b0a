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
``(token tiles, KV heads, G + 1)``: program ``z < G`` transforms query head
``h * G + z``, program ``G`` the K and V of KV head ``h``. Short inputs (decode steps)
split each of those into two programs, one per output half (``split_halves``): the K
program, which maps, quantizes and stores, is the longest, and the split halves its map
reads and its store.

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
from ._qkv_parts import (_load_halves, _norm_rope, _store_out, _store_parts, _transform,
                         _vec_halves)

TOKENS = 16          # tokens per program for short inputs (the MMA's M dimension)
# Long inputs (prefill chunks) with a map take 32 tokens per program: every program loads its
# head's D x D map (32 KB in bf16 as the GPU path passes it), which 16-token programs re-read
# from L2 twice as often; 64-token programs (8 warps) were slower still. Without a map 16 is
# fastest. Measured on an H200 at 2K-32K tokens (docs/benchmarks.md, "The query map of a fresh
# prompt"). (tokens per program, warps):
LONG_INPUT = 512
TILE_CHOICES = {16: 4, 32: 4, 64: 8}
LONG_TOKENS = 32


# kgs/vgs: layer i's global scales are elements of one [L, 2] fp32 tensor, so their addresses
# alternate between 16-byte aligned and not from layer to layer; specialized on that, every
# variant would compile twice, the second time inside a served step
@triton.jit(do_not_specialize=["n_tok", "kgs_ptr", "vgs_ptr"])
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
                BT: tl.constexpr, SPLIT: tl.constexpr, UNMAPPED_K_OUT: tl.constexpr,
                PDL_TRIGGER: tl.constexpr = False):
    """Program ``(tile of BT tokens, h, z)``: query head ``h * G + z // SPLIT``
    (``z // SPLIT < G``), or K and V of head ``h`` (and, with ``HAS_KV_OUT``, their
    transformed rows into ``kout``/``vout``; with ``UNMAPPED_K_OUT`` K's row goes out before
    the map, shifted); with ``SPLIT == 2`` only output half
    ``z % 2`` of that head (every program still reads both input halves: the norm and RoPE
    need them). ``PDL_TRIGGER``: let a grid launched as this one's programmatic dependent
    (the CUDA decode kernel) start at once; it waits for this grid before reading its
    outputs."""
    if PDL_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    D = 2 * HALF
    G = HQ // H
    h = tl.program_id(1)
    z = tl.program_id(2) // SPLIT
    part = tl.program_id(2) % SPLIT
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
        a, b = _transform(lo, hi, qmap_ptr + h * D * D, part, HAS_QMAP, SPLIT, HALF, DOT_BF16)
        _store_out(q_out_ptr, t * SO_T + hq * SO_H, a, b, part, tmask, HALF, SPLIT)
    else:
        lo, hi = _load_halves(qkv_ptr, t * SX + (HQ + h) * D, tmask, HALF)
        lo, hi = _norm_rope(lo, hi, kn_ptr, eps, w_off, rope, HAS_KN, HALF)
        if HAS_KSHIFT:
            c0, c1 = _vec_halves(kshift_ptr + h * D, HALF)
            lo, hi = lo - c0, hi - c1
        if HAS_KV_OUT and UNMAPPED_K_OUT:          # written now: not kept live across the map
            ra, rb = _transform(lo, hi, kmap_ptr, part, False, SPLIT, HALF, DOT_BF16)
            _store_out(kout_ptr, t * SKO_T + h * SKO_H, ra, rb, part, tmask, HALF, SPLIT)
        ka, kb = _transform(lo, hi, kmap_ptr + h * D * D, part, HAS_KMAP, SPLIT, HALF,
                            DOT_BF16)
        v_lo, v_hi = _load_halves(qkv_ptr, t * SX + (HQ + H + h) * D, tmask, HALF)
        if HAS_VSHIFT:
            c0, c1 = _vec_halves(vshift_ptr + h * D, HALF)
            v_lo, v_hi = v_lo - c0, v_hi - c1
        va, vb = _transform(v_lo, v_hi, vshift_ptr, part, False, SPLIT, HALF, DOT_BF16)
        if HAS_KV_OUT:
            if not UNMAPPED_K_OUT:
                _store_out(kout_ptr, t * SKO_T + h * SKO_H, ka, kb, part, tmask, HALF, SPLIT)
            _store_out(vout_ptr, t * SVO_T + h * SVO_H, va, vb, part, tmask, HALF, SPLIT)
        slot = tl.load(slot_ptr + t, mask=tmask, other=-1)
        rmask = tmask & (slot >= 0)
        slot = tl.maximum(slot, 0).to(tl.uint32)
        page = (slot // PAGE).to(tl.int64)
        off = (slot % PAGE).to(tl.int32)
        _store_parts(ka, kb, part, kd_ptr, ks_ptr, kgs_ptr, page, off, h, rmask, KD_P, KD_H,
                     KD_T, KS_P, KS_H, KS_T, HALF, K_FMT, HW, SPLIT)
        _store_parts(va, vb, part, vd_ptr, vs_ptr, vgs_ptr, page, off, h, rmask, VD_P, VD_H,
                     VD_T, VS_P, VS_H, VS_T, HALF, V_FMT, HW, SPLIT)


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
                   tokens_per_program: int | None = None,
                   split_halves: bool | None = None, unmapped_kv_out: bool = False,
                   pdl_trigger: bool = False) -> torch.Tensor:
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
        unmapped_kv_out: ``k_out`` receives ``rope(norm(k)) - k_shift``, K before the map
            (the pages still get K'). A prefill chunk with no cached prefix and no decode
            rows may attend over these keys with q unmapped (``q_map`` None): ``q . (k - c)
            = q' . K'``, the same scores without the ``[T, Hq, D] x [D, D]`` query map.
        tokens_per_program: 16, 32 or 64 (benchmarks); default ``LONG_TOKENS`` from
            ``LONG_INPUT`` tokens with a map, else 16.
        split_halves: one program per output half of each head (twice the programs, each
            reading half of its head's map and storing half the head: a shorter critical
            path for decode-sized inputs) instead of one per head. Default: below
            ``LONG_INPUT`` tokens. The same bytes in the interpreter; on a GPU the MMAs'
            fp32 sums may round differently in the last bit.
        pdl_trigger: on CUDA from compute capability 9.0, let the next kernel, if it is
            launched as a programmatic dependent (``decode_attention_cuda(pdl=True)``), start
            while this one runs; ignored elsewhere.
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
    if unmapped_kv_out and k_out is None:
        raise KernelInputError("unmapped_kv_out needs k_out and v_out")
    if tokens_per_program is None:
        mapped = k_map is not None or q_map is not None
        tokens_per_program = LONG_TOKENS if t >= LONG_INPUT and mapped else TOKENS
    elif tokens_per_program not in TILE_CHOICES:
        raise KernelInputError(f"tokens_per_program must be one of {sorted(TILE_CHOICES)}, got "
                               f"{tokens_per_program}")
    if t == 0:
        return out
    split = (t < LONG_INPUT) if split_halves is None else bool(split_halves)
    pdl = pdl_trigger and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    _launch(layout, pages, qkv, num_heads, cos, sin, slot_mapping, k_scale, v_scale,
            (q_norm, k_norm, k_shift, k_map, q_map, v_shift), eps, norm_offset, out,
            (k_out, v_out), tokens_per_program, 2 if split else 1, unmapped_kv_out, pdl)
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
            kv_out: tuple, bt: int, split: int, unmapped_kv_out: bool = False,
            pdl_trigger: bool = False) -> None:
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
    grid = (triton.cdiv(qkv.shape[0], bt), h, (g + 1) * split)
    ko, vo = kv_out if kv_out[0] is not None else (out, out)   # unused pointers: any tensor
    _qkv_kernel[grid](
        qkv, cos, sin, slots, out, ptrs[0], ptrs[1], float(eps), float(norm_offset), ptrs[2],
        ptrs[3], ptrs[4], ptrs[5], kd, ks, vd, vs, scale_tensor(k_scale, device, "k_scale"),
        scale_tensor(v_scale, device, "v_scale"), ko, vo, qkv.shape[0], SX=qkv.stride(0),
        SC=cos.stride(0), SS=sin.stride(0), SO_T=out.stride(0), SO_H=out.stride(1),
        **dict(zip(names, strides)), HQ=num_heads, H=h, HALF=d // 2, PAGE=layout.page_size,
        **has, K_FMT=kf, V_FMT=vf, HW=hw_fp8(device), DOT_BF16=device.type == "cuda",
        HAS_KV_OUT=kv_out[0] is not None, SKO_T=ko.stride(0), SKO_H=ko.stride(1),
        SVO_T=vo.stride(0), SVO_H=vo.stride(1), BT=bt, SPLIT=split, UNMAPPED_K_OUT=unmapped_kv_out,
        PDL_TRIGGER=pdl_trigger, num_warps=TILE_CHOICES[bt],
        enable_fp_fusion=False)


def warm_long_inputs(layout: PageLayout, pages: LayerPages, num_heads: int,
                     dtype: torch.dtype, qk_norm: bool, params: dict, k_scale, v_scale,
                     device: torch.device) -> int:
    """Compiles the prompt-sized variants of :func:`qkv_rope_store` (``LONG_INPUT`` tokens
    and up, with ``k_out``/``v_out``) that a server's steps will launch: with ``params`` (the
    recipe's k_shift/k_map/q_map/v_shift as the steps pass them) and, where there is a query
    map, the fresh-prompt form without it (``unmapped_kv_out``). Every slot is -1, so nothing
    is stored. A Triton compile costs a second or more, which would otherwise fall into the
    first long prompt's step of each kind. Returns the number of variants launched."""
    t, h, d = LONG_INPUT, layout.num_kv_heads, layout.head_dim
    qkv = torch.zeros(t, (num_heads + 2 * h) * d, dtype=dtype, device=device)
    rope = torch.ones(t, 1, d, dtype=dtype, device=device)    # as RotaryCache.lookup gives it
    norm = torch.ones(d, dtype=dtype, device=device) if qk_norm else None
    slots = torch.full((t,), -1, dtype=torch.long, device=device)
    kv = {n: torch.empty(t, h, d, dtype=dtype, device=device) for n in ("k_out", "v_out")}
    variants = [(params, False)]
    if params.get("q_map") is not None:
        variants.append(({**params, "q_map": None}, True))
    for p, unmapped in variants:
        qkv_rope_store(layout, pages, qkv, num_heads, rope, rope, slots, k_scale, v_scale, norm,
                       norm, 1e-6, **p, **kv, unmapped_kv_out=unmapped)
    return len(variants)
