"""Vectorized torch counterparts of the paged references, for the CPU decode path.

The references (``paged_ref.py``) run one layer at a time through dozens of
small ops; on a CPU the per-op overhead, not the arithmetic, dominates a decode
step. These functions compute the same values with few, larger ops:

* :func:`dequantize_pages` dequantizes whole pages of a *range of layers* at
  once (one gather, one 256-entry pair lookup for NVFP4 codes, one scale and
  one global-scale multiply), straight into the ``[L, B, H, M * S, D]`` layout
  a batched SDPA reads;
* :func:`dequantize_rows` dequantizes a few token rows of one layer (the tokens
  a step has just stored), :func:`dequantize_stored` the codes the store returned;
* :func:`store_kv_fast` quantizes K and V of plain NVFP4 in one pass (stacked,
  the E2M1 rounding as one ``bucketize``) and writes them like
  :func:`~.paged_ref.store_kv_ref`; other formats go through the reference.

Every value is bit-identical to the references': the same fp32 operations in
the same order (``(e2m1 * scale) * global_scale``; the reference quantizer's
thresholds, the non-strict ones moved down one ulp so that one strict
comparison decides every tie the same way). ``tests/kernels/test_paged_fast.py``
checks this against the references for every registered KV format.

Shapes: ``L`` layers, ``B`` sequences, ``M`` pages per sequence, ``S``
page_size, ``H`` KV heads, ``D`` head_dim, ``T`` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .errors import KernelInputError, NonFiniteInputError
from .formats import NVFP4, ElementFormat
from .layout import LayerPages, PageLayout
from .nvfp4 import _THRESHOLDS, BLOCK, E2M1_MAX, _pair_lut, e4m3_round, pack_nibbles
from .paged_ref import _check_slots, store_kv_ref

# Element formats whose values dequantize_pages/dequantize_rows compute (by name: recipe
# variants store plain NVFP4 codes, e.g. nvfp4_46); rotated K (nvfp4_had*) is not here.
FAST_ELEMENTS = frozenset({"bf16", "fp8_e4m3", "nvfp4", "nvfp4_46"})


def supports_layout(layout: PageLayout) -> bool:
    """Both of the layout's element formats are in :data:`FAST_ELEMENTS`."""
    fmt = layout.fmt
    return fmt.k.name in FAST_ELEMENTS and fmt.v.name in FAST_ELEMENTS


def _kind(elem: ElementFormat) -> str:
    """How an element format's values are computed: ``bf16``, ``fp8`` or ``nvfp4``."""
    if elem.name not in FAST_ELEMENTS:
        raise KernelInputError(f"no fast dequantize for element format {elem.name!r}")
    return {"bf16": "bf16", "fp8_e4m3": "fp8"}.get(elem.name, "nvfp4")


def _buffer(scratch: dict | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """An uninitialized ``shape`` tensor: a view of the caller's persistent ``scratch[name]``
    (grown when too small), or a new one without ``scratch``. Reusing the memory saves a
    large allocation's page faults every step."""
    n = math.prod(shape)
    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = scratch.get(name)
    if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
        buf = scratch[name] = torch.empty(n + n // 4, dtype=dtype, device=device)
    return buf[:n].view(shape)


def _dequant(kind: str, data: torch.Tensor, scales: torch.Tensor | None, gs: torch.Tensor,
             dtype: torch.dtype, scratch: dict | None = None) -> torch.Tensor:
    """``data`` uint8 ``[..., data_bytes]`` (+ ``scales`` ``[..., scale_bytes]``; any strides,
    the last dim contiguous) -> ``[..., D]`` contiguous.

    ``gs``: fp32, broadcastable against ``data`` without its last dim (one global
    scale per layer). The values equal the element format's ``dequantize`` with that
    scale. NVFP4 codes go through one table lookup per byte (``index_select`` of the
    pair table: a gather several times faster on CPU than advanced indexing) and two
    in-place multiplies; the result (and the lookup's indices) may live in ``scratch``.
    """
    shape = data.shape[:-1]
    if kind == "bf16":
        out = _buffer(scratch, "values", (*shape, data.shape[-1] // 2), torch.float32,
                      data.device)
        return out.copy_(data.view(torch.bfloat16)).to(dtype)
    g = gs.unsqueeze(-1)
    if kind == "fp8":
        out = _buffer(scratch, "values", data.shape, torch.float32, data.device)
        return out.copy_(data.view(torch.float8_e4m3fn)).mul_(g).to(dtype)
    idx = _buffer(scratch, "index", data.shape, torch.int32, data.device).copy_(data)
    out = _buffer(scratch, "values", (*shape, data.shape[-1] * 2), torch.float32, data.device)
    torch.index_select(_pair_lut(data.device), 0, idx.view(-1), out=out.view(-1, 2))
    scale = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    out.unflatten(-1, (-1, BLOCK)).mul_(scale).mul_(g.unsqueeze(-1))
    return out.to(dtype)


def _sections(layout: PageLayout, raw: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Views of ``raw`` uint8 ``[..., layer_nbytes]`` as ``{section: [..., H, S, row]}``."""
    views: dict[str, torch.Tensor | None] = {"k_scale": None, "v_scale": None}
    offset = 0
    for name, size, row in layout.sections():
        views[name] = raw[..., offset:offset + size].unflatten(
            -1, (layout.num_kv_heads, layout.page_size, row))
        offset += size
    return views


def _dequant_kv(layout: PageLayout, secs: dict, gs: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
    """K and V stacked ``[2, ...]`` from section tensors ``{name: [..., row]}`` and ``gs``
    ``[..., 2]`` (K, V); one pass for both when they share an element format."""
    fmt = layout.fmt
    kk, vk = _kind(fmt.k), _kind(fmt.v)
    if kk == vk and fmt.k.data_bytes(layout.head_dim) == fmt.v.data_bytes(layout.head_dim):
        data = torch.stack((secs["k_data"], secs["v_data"]))
        scales = None if secs["k_scale"] is None else torch.stack((secs["k_scale"],
                                                                     secs["v_scale"]))
        return _dequant(kk, data, scales, gs.movedim(-1, 0), dtype)
    return torch.stack((_dequant(kk, secs["k_data"], secs["k_scale"], gs[..., 0], dtype),
                        _dequant(vk, secs["v_data"], secs["v_scale"], gs[..., 1], dtype)))


def dequantize_pages(layout: PageLayout, pool: torch.Tensor, page_ids: torch.Tensor,
                     layers: range, global_scales: torch.Tensor, dtype: torch.dtype,
                     scratch: dict | None = None) -> torch.Tensor:
    """Dequantize pages ``page_ids`` of layers ``layers`` for a batched decode.

    Args:
        pool: the KV pool, uint8 ``[P, num_layers, layer_nbytes]``.
        page_ids: int64 ``[B, M]`` page ids per sequence, in token order (padding
            may point at any valid page; the caller masks it).
        layers: a contiguous range of layers (step 1).
        global_scales: fp32 ``[num_layers, 2]`` (K, V) on the pool's device.
        dtype: output dtype.
        scratch: a dict the caller keeps between calls (e.g. one per step): the result
            and the intermediates then reuse its buffers, and the result is valid only
            until the next call with the same ``scratch``.
    Returns:
        K and V stacked, ``[2, len(layers), B, H, M * S, D]`` of ``dtype``, contiguous:
        token ``j`` of sequence ``b`` is at ``[:, :, b, :, j]``.
    """
    layout.check_pool(pool)
    if page_ids.dim() != 2 or page_ids.dtype != torch.int64:
        raise KernelInputError(f"page_ids must be int64 [B, M], got {page_ids.dtype} "
                               f"{tuple(page_ids.shape)}")
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= layout.num_layers:
        raise KernelInputError(f"bad layer range {layers}")
    b, m = page_ids.shape
    nl, s, h = len(layers), layout.page_size, layout.num_kv_heads
    raw = pool[:, layers.start:layers.stop].index_select(0, page_ids.flatten())
    gs = global_scales[layers.start:layers.stop].to(torch.float32).view(nl, 1, 1, 1, 2)
    fmt, secs = layout.fmt, layout.sections()
    if _kind(fmt.k) == _kind(fmt.v) and secs[0][1] == secs[1][1]:
        # K and V sections are adjacent and alike (data, then scales): one pass for both,
        # straight from [B*M, L, 2, H, S, row] into [2, L, B, H, M, S, D] (views until then).
        def pair(start: int, size: int, row: int) -> torch.Tensor:
            return (raw[..., start:start + 2 * size].unflatten(-1, (2, h, s, row))
                    .unflatten(0, (b, m)).permute(3, 2, 0, 4, 1, 5, 6))
        size, row = secs[0][1], secs[0][2]
        scales = pair(2 * size, secs[2][1], secs[2][2]) if len(secs) == 4 else None
        out = _dequant(_kind(fmt.k), pair(0, size, row), scales,
                       gs.movedim(-1, 0).unsqueeze(-1), dtype, scratch)
        return out.view(2, nl, b, h, m * s, layout.head_dim)
    # [B*M, L, H, S, row] -> [L, B, H, M*S, row]
    views = {n: None if t is None else t.unflatten(0, (b, m)).permute(2, 0, 3, 1, 4, 5)
             .reshape(nl, b, h, m * s, t.shape[-1]) for n, t in _sections(layout, raw).items()}
    return _dequant_kv(layout, views, gs, dtype)


def dequantize_rows(layout: PageLayout, pages: LayerPages, page_idx: torch.Tensor,
                    off_idx: torch.Tensor, k_scale: float, v_scale: float, dtype: torch.dtype
                    ) -> torch.Tensor:
    """:func:`~.paged_ref.gather_rows_ref` for the formats in :data:`FAST_ELEMENTS`:
    rows ``(page_idx[i], off_idx[i])`` (int64 ``[N]``) of one layer -> K and V stacked,
    ``[2, N, H, D]``."""
    secs = {n: None if t is None else t[page_idx, :, off_idx] for n, t in pages._asdict().items()}
    gs = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=pages.k_data.device)
    return _dequant_kv(layout, secs, gs.view(1, 1, 2), dtype)


def dequantize_stored(layout: PageLayout, codes: torch.Tensor, scales: torch.Tensor,
                      global_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What :func:`store_kv_fast` returned (plain NVFP4 K and V: ``codes`` uint8
    ``[2, N, H, D // 2]``, ``scales`` ``[2, N, H, D // 16]``) with ``global_scale`` fp32 ``[2]``
    (K, V) -> ``[2, N, H, D]`` of ``dtype``, the values a read of those rows gives."""
    if codes.dim() != 4 or codes.shape[0] != 2 or global_scale.shape != (2,):
        raise KernelInputError(f"codes must be [2, N, H, D // 2] and global_scale [2], got "
                               f"{tuple(codes.shape)}, {tuple(global_scale.shape)}")
    return _dequant("nvfp4", codes, scales, global_scale.view(2, 1, 1), dtype)


def _e2m1_bounds(device: torch.device) -> torch.Tensor:
    """fp32 [7]: ``bucketize`` boundaries giving the reference's E2M1 codes (magnitude part)."""
    b = torch.tensor([t for t, _ in _THRESHOLDS], dtype=torch.float32)
    loose = torch.tensor([not strict for _, strict in _THRESHOLDS])
    # mag >= t  <=>  mag > nextafter(t, -inf) for fp32 mag and t
    b = torch.where(loose, torch.nextafter(b, torch.tensor(-float("inf"))), b)
    return b.to(device)


_BOUNDS: dict[torch.device, torch.Tensor] = {}
_FMAX = torch.finfo(torch.float32).max


def quantize_nvfp4_stacked(x: torch.Tensor, global_scale: Sequence[float]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.nvfp4.quantize_nvfp4` of ``x`` ``[N, ..., D]`` with one global scale per
    leading index (``global_scale``: ``N`` finite values > 0) -> ``(codes uint8
    [..., D // 2], scales uint8 [..., D // 16])``, bit-identical to quantizing each ``x[i]``
    alone (the same fp32 operations; the block reciprocal's zero guard as one ``where``)."""
    if not x.is_floating_point() or x.dim() < 2 or x.shape[-1] % BLOCK:
        raise KernelInputError(f"x must be floating [N, ..., D % 16 == 0], got {x.dtype} "
                               f"{tuple(x.shape)}")
    if len(global_scale) != x.shape[0] or not all(0 < g < math.inf for g in global_scale):
        raise KernelInputError(f"global_scale must be {x.shape[0]} finite values > 0, "
                               f"got {global_scale!r}")
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise NonFiniteInputError("NVFP4 quantize got NaN or inf input")
    gs = torch.tensor(global_scale, dtype=torch.float32, device=x.device).view(
        -1, *([1] * (x.dim() - 1)))
    blocks = xf.unflatten(-1, (-1, BLOCK))
    scale = e4m3_round(blocks.abs().amax(dim=-1) / E2M1_MAX / gs)
    denom = scale.float() * gs
    inv = torch.where(denom > 0, denom.reciprocal().clamp_(max=_FMAX), 0.0)
    q = blocks * inv.unsqueeze(-1)
    bounds = _BOUNDS.get(x.device)
    if bounds is None:
        bounds = _BOUNDS[x.device] = _e2m1_bounds(x.device)
    code = torch.bucketize(q.abs(), bounds, out_int32=True).to(torch.uint8)
    code |= torch.signbit(q).view(torch.uint8) << 3
    return pack_nibbles(code.flatten(-2)), scale.view(torch.uint8)


def split_slots(layout: PageLayout, pages: LayerPages, slot_mapping: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked ``slot_mapping`` (int ``[T]``, ``page * S + offset``) -> ``(page, offset)``
    int64 ``[T]``, for :func:`store_kv_fast` (a step computes them once for all layers)."""
    _check_slots(layout, pages, slot_mapping, slot_mapping.shape[0] if slot_mapping.dim() else -1)
    return (slot_mapping // layout.page_size).long(), (slot_mapping % layout.page_size).long()


def _kv_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``[P, 2, ...]`` view over two equal sections ``a`` and ``b`` ``[P, ...]`` when ``b``
    directly follows ``a`` in every page (K then V in the layout), else None."""
    size = a[0].numel()
    if a.shape != b.shape or a.stride() != b.stride() or \
            b.storage_offset() != a.storage_offset() + size or not a[0].is_contiguous():
        return None
    return a.as_strided((a.shape[0], 2, *a.shape[1:]), (a.stride(0), size, *a.stride()[1:]),
                        a.storage_offset())


def store_kv_fast(layout: PageLayout, pages: LayerPages, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float, v_scale: float,
                  slots: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`~.paged_ref.store_kv_ref` (same arguments, same bytes written): plain NVFP4
    K and V are quantized together in one pass, written with one index per section pair,
    and their ``(codes [2, T, H, D // 2], scales [2, T, H, D // 16])`` returned (see
    :func:`dequantize_stored`); every other format goes to the reference (returns None).
    ``slots``: :func:`split_slots` of ``slot_mapping``, already checked, if the caller has it.
    """
    fmt = layout.fmt
    if fmt.k is not NVFP4 or fmt.v is not NVFP4:
        store_kv_ref(layout, pages, k, v, slot_mapping, k_scale, v_scale)
        return None
    if k.dim() != 3 or v.shape != k.shape or k.shape[1:] != (layout.num_kv_heads, layout.head_dim):
        raise KernelInputError(
            f"k/v must be [T, {layout.num_kv_heads}, {layout.head_dim}], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}")
    page, off = slots if slots is not None else split_slots(layout, pages, slot_mapping)
    if page.shape != (k.shape[0],):
        raise KernelInputError(f"slots must be [{k.shape[0]}], got {tuple(page.shape)}")
    # Quantize both before writing either, so rejected input leaves the pool as it was.
    codes, scales = quantize_nvfp4_stacked(torch.stack((k.float(), v.float())),
                                           (k_scale, v_scale))
    for (a, b), vals in (((pages.k_data, pages.v_data), codes),
                         ((pages.k_scale, pages.v_scale), scales)):
        both = _kv_pair(a, b)
        if both is not None:
            both[page, :, :, off] = vals.transpose(0, 1)
        else:
            a[page, :, off], b[page, :, off] = vals[0], vals[1]
    return codes, scales
