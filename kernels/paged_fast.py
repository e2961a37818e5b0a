"""Vectorized torch counterparts of the paged references, for the CPU decode path.

The references (``paged_ref.py``) run one layer at a time through dozens of
small ops; on a CPU the per-op overhead, not the arithmetic, dominates a decode
step. These functions compute the same values with few, larger ops:

* :func:`dequantize_pages` dequantizes whole pages of a *range of layers* at
  once (one gather, one 256-entry pair lookup for NVFP4 codes, one scale and
  one global-scale multiply), straight into the ``[L, B, H, M * S, D]`` layout
  a batched SDPA reads;
* :func:`dequantize_rows` dequantizes a few token rows of one layer (the tokens
  a step has just stored);
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

import torch

from .errors import KernelInputError, NonFiniteInputError
from .formats import BF16, FP8_E4M3, NVFP4, ElementFormat
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


def _dequant(elem: ElementFormat, data: torch.Tensor, scales: torch.Tensor | None,
             gs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data`` uint8 ``[..., data_bytes]`` (+ ``scales`` ``[..., scale_bytes]``) -> ``[..., D]``.

    ``gs``: fp32, broadcastable against ``data`` without its last dim (one global
    scale per layer). The values equal ``elem.dequantize`` with that scale.
    """
    if elem.name == BF16.name:
        return data.contiguous().view(torch.bfloat16).to(dtype)
    g = gs.unsqueeze(-1)
    if elem.name == FP8_E4M3.name:
        return (data.view(torch.float8_e4m3fn).float() * g).to(dtype)
    if elem.name not in FAST_ELEMENTS:
        raise KernelInputError(f"no fast dequantize for element format {elem.name!r}")
    values = _pair_lut(data.device)[data.long()].flatten(-2).unflatten(-1, (-1, BLOCK))
    scale = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    return ((values * scale) * g.unsqueeze(-1)).flatten(-2).to(dtype)


def _sections(layout: PageLayout, raw: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Views of ``raw`` uint8 ``[..., layer_nbytes]`` as ``{section: [..., H, S, row]}``."""
    views: dict[str, torch.Tensor | None] = {"k_scale": None, "v_scale": None}
    offset = 0
    for name, size, row in layout.sections():
        views[name] = raw[..., offset:offset + size].unflatten(
            -1, (layout.num_kv_heads, layout.page_size, row))
        offset += size
    return views


def dequantize_pages(layout: PageLayout, pool: torch.Tensor, page_ids: torch.Tensor,
                     layers: range, global_scales: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize pages ``page_ids`` of layers ``layers`` for a batched decode.

    Args:
        pool: the KV pool, uint8 ``[P, num_layers, layer_nbytes]``.
        page_ids: int64 ``[B, M]`` page ids per sequence, in token order (padding
            may point at any valid page; the caller masks it).
        layers: a contiguous range of layers (step 1).
        global_scales: fp32 ``[num_layers, 2]`` (K, V) on the pool's device.
        dtype: output dtype.
    Returns:
        ``(k, v)`` each ``[len(layers), B, H, M * S, D]`` of ``dtype``, contiguous:
        token ``j`` of sequence ``b`` is at ``[:, b, :, j]``.
    """
    layout.check_pool(pool)
    if page_ids.dim() != 2 or page_ids.dtype != torch.int64:
        raise KernelInputError(f"page_ids must be int64 [B, M], got {page_ids.dtype} "
                               f"{tuple(page_ids.shape)}")
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= layout.num_layers:
        raise KernelInputError(f"bad layer range {layers}")
    b, m = page_ids.shape
    nl, s = len(layers), layout.page_size
    raw = pool[:, layers.start:layers.stop].index_select(0, page_ids.flatten())
    # [B*M, L, H, S, row] -> [L, B, H, M*S, row]: move the bytes, not the dequantized values.
    secs = {n: None if t is None else t.unflatten(0, (b, m)).permute(2, 0, 3, 1, 4, 5)
            .reshape(nl, b, layout.num_kv_heads, m * s, t.shape[-1])
            for n, t in _sections(layout, raw).items()}
    gs = global_scales[layers.start:layers.stop].to(torch.float32).view(nl, 1, 1, 1, 2)
    fmt = layout.fmt
    k = _dequant(fmt.k, secs["k_data"], secs["k_scale"], gs[..., 0], dtype)
    v = _dequant(fmt.v, secs["v_data"], secs["v_scale"], gs[..., 1], dtype)
    return k, v


def dequantize_rows(layout: PageLayout, pages: LayerPages, page_idx: torch.Tensor,
                    off_idx: torch.Tensor, k_scale: float, v_scale: float, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.paged_ref.gather_rows_ref` for the formats in :data:`FAST_ELEMENTS`:
    rows ``(page_idx[i], off_idx[i])`` (int64 ``[N]``) of one layer -> ``(k, v)`` ``[N, H, D]``."""
    fmt = layout.fmt
    out = []
    for elem, gs, data, scales in ((fmt.k, k_scale, pages.k_data, pages.k_scale),
                                   (fmt.v, v_scale, pages.v_data, pages.v_scale)):
        d = data[page_idx, :, off_idx]
        sc = scales[page_idx, :, off_idx] if scales is not None else None
        g = torch.tensor(gs, dtype=torch.float32, device=d.device)
        out.append(_dequant(elem, d, sc, g, dtype))
    return out[0], out[1]


def _e2m1_bounds(device: torch.device) -> torch.Tensor:
    """fp32 [7]: ``bucketize`` boundaries giving the reference's E2M1 codes (magnitude part)."""
    b = torch.tensor([t for t, _ in _THRESHOLDS], dtype=torch.float32)
    loose = torch.tensor([not strict for _, strict in _THRESHOLDS])
    # mag >= t  <=>  mag > nextafter(t, -inf) for fp32 mag and t
    b = torch.where(loose, torch.nextafter(b, torch.tensor(-float("inf"))), b)
    return b.to(device)


_BOUNDS: dict[torch.device, torch.Tensor] = {}


def quantize_nvfp4_stacked(x: torch.Tensor, global_scale: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.nvfp4.quantize_nvfp4` of ``x`` ``[N, ..., D]`` with one global scale per
    leading index (``global_scale`` fp32 ``[N]``, each > 0) -> ``(codes uint8 [..., D // 2],
    scales uint8 [..., D // 16])``, bit-identical to quantizing each ``x[i]`` alone."""
    if not x.is_floating_point() or x.dim() < 2 or x.shape[-1] % BLOCK:
        raise KernelInputError(f"x must be floating [N, ..., D % 16 == 0], got {x.dtype} "
                               f"{tuple(x.shape)}")
    if global_scale.shape != x.shape[:1] or not bool((global_scale > 0).all()):
        raise KernelInputError("global_scale must be [N] positive values")
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise NonFiniteInputError("NVFP4 quantize got NaN or inf input")
    gs = global_scale.to(torch.float32).view(-1, *([1] * (x.dim() - 1)))
    blocks = xf.unflatten(-1, (-1, BLOCK))
    scale = e4m3_round(blocks.abs().amax(dim=-1) / E2M1_MAX / gs)
    denom = scale.float() * gs
    pos = denom > 0
    inv = (torch.ones_like(denom) / torch.where(pos, denom, torch.ones_like(denom)))
    inv = torch.where(pos, inv.clamp(max=torch.finfo(torch.float32).max), torch.zeros_like(inv))
    q = blocks * inv.unsqueeze(-1)
    bounds = _BOUNDS.get(x.device)
    if bounds is None:
        bounds = _BOUNDS[x.device] = _e2m1_bounds(x.device)
    code = torch.bucketize(q.abs(), bounds).to(torch.uint8) | (torch.signbit(q).to(torch.uint8) << 3)
    return pack_nibbles(code.flatten(-2)), scale.view(torch.uint8)


def store_kv_fast(layout: PageLayout, pages: LayerPages, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """:func:`~.paged_ref.store_kv_ref` (same arguments, same bytes written): plain NVFP4
    K and V are quantized together in one pass; every other format goes to the reference."""
    fmt = layout.fmt
    if fmt.k is not NVFP4 or fmt.v is not NVFP4:
        store_kv_ref(layout, pages, k, v, slot_mapping, k_scale, v_scale)
        return
    if k.dim() != 3 or v.shape != k.shape or k.shape[1:] != (layout.num_kv_heads, layout.head_dim):
        raise KernelInputError(
            f"k/v must be [T, {layout.num_kv_heads}, {layout.head_dim}], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}")
    _check_slots(layout, pages, slot_mapping, k.shape[0])
    gs = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=k.device)
    codes, scales = quantize_nvfp4_stacked(torch.stack((k.float(), v.float())), gs)   # before any write
    page = (slot_mapping // layout.page_size).long()
    off = (slot_mapping % layout.page_size).long()
    pages.k_data[page, :, off] = codes[0]
    pages.v_data[page, :, off] = codes[1]
    pages.k_scale[page, :, off] = scales[0]
    pages.v_scale[page, :, off] = scales[1]
