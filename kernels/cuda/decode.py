"""NVFP4 and FP8 paged decode attention in CUDA C++ for Hopper (sm_90a), built on first use.

The kernel (``csrc/decode.cu``, design notes at its top) converts E2M1 codes (NVFP4) or
E4M3 bytes (FP8) in registers and runs ``mma.sync`` fp16 MMAs; the last CTA of each
(sequence, KV head) combines the splits (or, with ``combine="kernel"``, a small reduce
kernel does). Nothing is compiled at import: :func:`decode_attention_cuda` checks
its arguments first and builds the extension (``torch.utils.cpp_extension.load`` over the
files in ``csrc/``, see :mod:`._sources`; about 30 s) on its first valid call.

The launch reads every length on the device and its grid depends only on
host-known shapes, so it is CUDA-graph safe.
"""

from __future__ import annotations

import functools
import os

import torch

from ..errors import KernelInputError
from ..layout import LayerPages, PageLayout
from ..triton._common import check_block_tables, check_pages, scale_tensor
from . import _sources

LOG2E = 1.4426950408889634
HEAD_DIM = 128
WARPS_PER_CTA = 4
MAX_GROUP = 8
MIN_TILES_PER_WARP = 4
# variant = 10000 * pair + 100 * pipe + 10 * dequant + register cap. pair: two 16-token
# tiles per softmax step; pipe: cp.async shared-memory stages per warp (0: next tile
# prefetched into registers); dequant 0: byte-permute bit placement (4 LOP3 + 3 shifts +
# 4 PRMT per 8 codes), 2: the same with one sign word shared by both nibble halves (3 LOP3);
# cap (CTAs per SM): 4 -> 128 registers. 10404 and 4 are the dequant-0 references of 10424
# and 24 (same loops, one LOP3 more per 8 codes). 10425 and 10426: the register-cap
# route (5 / 6 CTAs per SM: 96 / 80 registers, 148 / 312 bytes spilled, 20 / 24 warps per SM).
VARIANTS = (10424, 24, 10404, 4, 10425, 10426)
# FP8 E4M3 pages (100000 + the same fields; cp.async rings only): 110602 two tiles per step,
# 6 stages (two pairs in flight), 2 CTAs per SM; 110403 / 110404 4 stages, 168 / 128-register
# caps; 100304 / 100204 one tile per step, 3 / 2 stages.
FP8_VARIANTS = (110602, 110403, 110404, 100304, 100204)
# Diagnostics for the benchmark only (wrong results): 1004 loads without compute, 2004
# computes on register data without loads.
DIAG_VARIANTS = (1004, 2004)
DEFAULT_VARIANT = 10424  # fastest on an H200 in every benchmark case (docs/benchmarks.md)
DEFAULT_FP8_VARIANT = 110602  # equal to 110403 in sum over the benchmark cases, 6% faster
                               # at 64 x 4096, 2% slower at 32 x 32768 (H200)
FORMATS = ("nvfp4", "fp8_e4m3")
# The fused combine counts finished splits in COUNTER_STRIDE int32s per (sequence, KV head)
# (one for the groups of 16 splits, one per group: csrc/decode.cu) of a buffer allocated once
# per device; larger batches fall back to the reduce kernel.
MAX_COUNTERS = 1 << 16           # (sequence, KV head) pairs
SPLIT_GROUP, MAX_SPLIT_GROUPS = 16, 16
COUNTER_STRIDE = 1 + MAX_SPLIT_GROUPS
FUSED_CAPACITY = SPLIT_GROUP * MAX_SPLIT_GROUPS   # splits the fused combine can take
COMBINES = ("auto", "fused", "kernel")
# "auto" fuses the combine up to this many splits, all it can take: against the reduce kernel
# one launch saves 1-6% with few splits (1 x 4096 at 1 split, 8 x 32768 at 4-8), and the two
# levels (groups of 16, then the groups) tie it at 66 splits (1 x 131072 NVFP4) and save 0.5%
# at 33 (FP8) (H200, docs/benchmarks.md).
FUSED_MAX_SPLITS = FUSED_CAPACITY
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Passed to nvcc as -D defines; csrc/tile.cuh asserts they equal the kernel's constants.
KERNEL_CONSTANTS = {"NIBBLE_HEAD_DIM": HEAD_DIM, "NIBBLE_WARPS_PER_CTA": WARPS_PER_CTA,
                    "NIBBLE_MAX_GROUP": MAX_GROUP, "NIBBLE_COUNTER_STRIDE": COUNTER_STRIDE,
                    "NIBBLE_FUSED_CAPACITY": FUSED_CAPACITY}


def is_built() -> bool:
    """Whether the extension has been compiled and loaded in this process."""
    return _module.cache_info().currsize > 0


@functools.lru_cache(maxsize=1)
def _module():
    """Compile (or load from torch's extension cache) the CUDA extension."""
    from torch.utils import cpp_extension
    return cpp_extension.load(**_sources.load_kwargs(
        KERNEL_CONSTANTS, verbose=os.environ.get("NIBBLE_CUDA_VERBOSE") == "1"))


@functools.lru_cache(maxsize=None)
def _resident_ctas(device_index: int, variant: int) -> int:
    """CTAs of ``variant`` that fit on the whole device at once."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return max(1, int(_module().occupancy(variant))) * sms


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                       variant: int = DEFAULT_VARIANT, waves: int = 1) -> int:
    """CTAs per (sequence, KV head): about ``waves`` full waves of resident CTAs.

    Depends only on host-known shapes (never on ``seq_lens``' values), so one
    batch-size bucket keeps one grid under CUDA graphs. Builds the extension.
    """
    pairs = max(batch * num_kv_heads, 1)
    want = max(1, waves * _resident_ctas(device.index or 0, variant) // pairs)
    tiles = -(-max(max_seq_len, 1) // 16)
    cap = max(1, -(-tiles // (WARPS_PER_CTA * MIN_TILES_PER_WARP)))
    return min(want, cap)


_COUNTERS: dict[int, torch.Tensor] = {}


def _split_counters(device: torch.device, pairs: int) -> torch.Tensor | None:
    """The device's zeroed int32 ``[MAX_COUNTERS * COUNTER_STRIDE]`` split counters; None if
    ``pairs`` exceeds ``MAX_COUNTERS``.

    Every launch leaves the counters it used at zero (the last CTA resets its own), so one
    buffer serves every call and every graph replay on the device. Calls that may run
    concurrently on one device (different streams) would share counters: the engine runs
    one step at a time on one stream. The first allocation is refused during graph capture
    (the call then takes the reduce kernel), so the buffer never lives in a graph's pool.
    """
    if pairs > MAX_COUNTERS:
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    buf = _COUNTERS.get(idx)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[idx] = torch.zeros(MAX_COUNTERS * COUNTER_STRIDE, dtype=torch.int32,
                                           device=device)
    return buf


def _check_layout(layout: PageLayout) -> None:
    fmt = layout.fmt
    if fmt.k.name != fmt.v.name or fmt.k.name not in FORMATS:
        raise KernelInputError(f"the CUDA decode kernel needs NVFP4 or FP8 E4M3 for both K and "
                               f"V, got {layout.kv_format!r}")
    if layout.head_dim != HEAD_DIM:
        raise KernelInputError(f"the CUDA decode kernel supports head_dim {HEAD_DIM}, got "
                               f"{layout.head_dim}")
    tpp = layout.page_size // 16
    if layout.page_size % 16 or tpp & (tpp - 1):
        raise KernelInputError(f"page_size must be 16 times a power of two, got "
                               f"{layout.page_size}")


def _check_q_out(layout: PageLayout, q: torch.Tensor, out: torch.Tensor | None) -> None:
    h = layout.num_kv_heads
    if q.dim() != 3 or q.shape[2] != HEAD_DIM or q.shape[1] % h:
        raise KernelInputError(f"q must be [B, Hq, {HEAD_DIM}] with Hq a multiple of {h}, got "
                               f"{tuple(q.shape)}")
    if not 1 <= q.shape[1] // h <= MAX_GROUP:
        raise KernelInputError(f"at most {MAX_GROUP} query heads per KV head, got "
                               f"{q.shape[1] // h}")
    if q.dtype not in _FLOAT_DTYPES or q.stride(2) != 1:
        raise KernelInputError(f"q must be bf16/fp16/fp32 with unit inner stride, got {q.dtype} "
                               f"strides {q.stride()}")
    if q.device.type != "cuda":
        raise KernelInputError(f"q must be on a CUDA device, got {q.device}")
    if out is not None and (out.shape != q.shape or out.dtype not in _FLOAT_DTYPES
                            or out.device != q.device or out.stride(2) != 1):
        raise KernelInputError(f"out must be a float tensor {tuple(q.shape)} on {q.device} "
                               f"with unit inner stride, got {out.dtype} {tuple(out.shape)}")


def _check_pool_views(pages: LayerPages) -> int:
    """All views must come from one pool (one page stride); returns that stride."""
    views = tuple(v for v in pages if v is not None)
    stride = pages.k_data.stride(0)
    if any(v.stride(0) != stride for v in views):
        raise KernelInputError("K/V code and scale views must share one page stride "
                               "(use PageLayout.layer_view)")
    base = pages.k_data.data_ptr()
    if base % 16 or stride % 16:
        raise KernelInputError("K codes must be 16-byte aligned with a 16-byte page stride")
    if any(not 0 <= v.data_ptr() - base < max(stride, 1) for v in views[1:]):
        raise KernelInputError("V codes and the scales must follow the K codes inside each page")
    if stride >= 1 << 32:
        raise KernelInputError(f"the page stride must be below 4 GiB (the kernel computes page "
                               f"addresses with 32-bit factors), got {stride} bytes")
    return stride


def default_variant(layout: PageLayout) -> int:
    """The fastest measured variant for the layout's page format."""
    return DEFAULT_FP8_VARIANT if layout.fmt.k.name == "fp8_e4m3" else DEFAULT_VARIANT


def decode_attention_cuda(layout: PageLayout, pages: LayerPages, q: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          sm_scale: float, k_scale: float | torch.Tensor = 1.0,
                          v_scale: float | torch.Tensor = 1.0, *,
                          out: torch.Tensor | None = None, num_splits: int | None = None,
                          max_seq_len: int | None = None,
                          variant: int | None = None, combine: str = "auto",
                          pdl: bool = False) -> torch.Tensor:
    """Paged GQA decode over NVFP4 or FP8 pages: ``q[b]`` attends over ``seq_lens[b]`` tokens.

    Args:
        layout: an ``nvfp4`` or ``fp8_e4m3`` :class:`PageLayout` with head_dim 128 and
            page_size 16 * 2^k.
        pages: one layer's views from ``layout.layer_view(pool, layer)`` on a CUDA device.
        q: ``[B, Hq, 128]`` bf16/fp16/fp32 (unit inner stride), ``Hq = G * H`` with
            ``1 <= G <= 8``. Values must fit fp16 (the MMA operands are fp16).
        block_tables: int32 ``[B, M]``; seq_lens: int32/int64 ``[B]``, each in
            ``[1, M * S]`` (not checked: that would need a host sync).
        sm_scale: softmax scale; k_scale, v_scale: global scales (float or one-element
            fp32 device tensor).
        out: optional ``[B, Hq, 128]`` bf16/fp16/fp32 output; default ``q.dtype``.
        num_splits: CTAs (of 4 warps) per (sequence, KV head); default
            :func:`default_num_splits` from ``max_seq_len`` (default ``M * S``).
        variant: kernel variant from :data:`VARIANTS` (NVFP4) or :data:`FP8_VARIANTS`;
            default :func:`default_variant`.
        combine: how the splits are combined: ``"fused"`` (the last CTA of each
            (sequence, KV head) reduces them inside the decode kernel, one launch; with
            one split the kernel writes ``out`` directly), ``"kernel"`` (a separate
            reduce kernel, two launches) or ``"auto"`` (fused up to
            :data:`FUSED_MAX_SPLITS` splits). ``"fused"`` takes up to
            :data:`FUSED_CAPACITY` splits.
        pdl: launch as a programmatic dependent of the kernel before it on the stream
            (which should call ``griddepcontrol.launch_dependents`` early, as
            ``qkv_rope_store(pdl_trigger=True)`` does): the split CTAs start, and fill their
            rings with every tile but each sequence's last, while that kernel runs, then
            wait for it before reading q and the last tile. Only correct when that kernel
            wrote nothing this one reads but ``q`` and the token at ``seq_lens[b] - 1``
            (a decode step's fused QKV kernel).
    Returns:
        ``out``.
    Raises:
        KernelInputError: a bad shape, dtype, stride, device or option, or a device
            that is not compute capability 9.0.
    """
    _check_layout(layout)
    _check_q_out(layout, q, out)
    device = q.device
    check_block_tables(block_tables, seq_lens, device)
    check_pages(layout, pages, device)
    page_stride = _check_pool_views(pages)
    if block_tables.shape[0] != q.shape[0]:
        raise KernelInputError(f"block_tables has {block_tables.shape[0]} rows, q {q.shape[0]}")
    fp8 = layout.fmt.k.name == "fp8_e4m3"
    variant = default_variant(layout) if variant is None else variant
    _check_options(layout, variant, combine, num_splits)
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise KernelInputError("the CUDA decode kernel is built for sm_90a (Hopper)")
    kgs = scale_tensor(k_scale, device, "k_scale")
    vgs = scale_tensor(v_scale, device, "v_scale")
    out = torch.empty_like(q) if out is None else out
    nb, hq, d = q.shape
    if nb == 0:
        return out
    h = layout.num_kv_heads
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * layout.page_size
    nsplit = num_splits or default_num_splits(nb, h, max_seq_len, device, variant)
    if combine == "fused" and nsplit > FUSED_CAPACITY:
        raise KernelInputError(f"combine='fused' takes up to {FUSED_CAPACITY} splits, got "
                               f"{nsplit}")
    fused = combine == "fused" or (combine == "auto" and nsplit <= FUSED_MAX_SPLITS)
    counters = _split_counters(device, nb * h) if fused else None
    parts = 0 if counters is not None and nsplit == 1 else nsplit   # one split: no partials
    part_o = torch.empty((nb, hq, parts, d), dtype=torch.float32, device=device)
    part_ml = torch.empty((nb, hq, parts, 2), dtype=torch.float32, device=device)
    if counters is None:
        counters = torch.empty(0, dtype=torch.int32, device=device)
    tpp_log2 = (layout.page_size // 16).bit_length() - 1
    # NVFP4 operands are value * 2^-7 (see csrc/decode.cu); FP8 ones are exact. FP8 pages have no
    # scale sections: the kernel never reads the scale pointers then.
    ks = pages.k_data if fp8 else pages.k_scale
    vs = pages.k_data if fp8 else pages.v_scale
    _module().decode(q, block_tables, seq_lens, pages.k_data, pages.v_data, ks, vs, page_stride,
                     layout.page_size, tpp_log2, hq // h, kgs, vgs,
                     sm_scale * LOG2E * (1.0 if fp8 else 128.0), part_o, part_ml, out, counters,
                     nsplit, variant, bool(pdl))
    return out


def _check_options(layout: PageLayout, variant: int, combine: str,
                   num_splits: int | None) -> None:
    """Raises KernelInputError on an unknown variant or combine, or a split count < 1."""
    allowed = FP8_VARIANTS if layout.fmt.k.name == "fp8_e4m3" else VARIANTS + DIAG_VARIANTS
    if variant not in allowed:
        raise KernelInputError(f"variant must be one of {allowed} for {layout.kv_format}, got "
                               f"{variant}")
    if combine not in COMBINES:
        raise KernelInputError(f"combine must be one of {COMBINES}, got {combine!r}")
    if num_splits is not None and num_splits < 1:
        raise KernelInputError(f"num_splits must be >= 1, got {num_splits}")
