"""Torch references for the paged-KV kernels (any device).

These are the ground truth the Triton kernels are tested against, and the
CPU engine's implementation. All take one layer's :class:`LayerPages` views
from :meth:`PageLayout.layer_view`.

Shapes: ``T`` new tokens, ``H`` KV heads, ``Hq`` query heads, ``D`` head_dim,
``S`` page_size, ``B`` sequences, ``M`` max pages per sequence.
"""

from __future__ import annotations

import torch

from .errors import KernelInputError
from .layout import LayerPages, PageLayout


def _check_slots(layout: PageLayout, pages: LayerPages, slot_mapping: torch.Tensor, t: int) -> None:
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t:
        raise KernelInputError(f"slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    if t and (int(slot_mapping.min()) < 0 or
              int(slot_mapping.max()) >= pages.k_data.shape[0] * layout.page_size):
        raise KernelInputError("slot_mapping points outside the pool")


def store_kv_ref(layout: PageLayout, pages: LayerPages, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float | torch.Tensor,
                 v_scale: float | torch.Tensor) -> None:
    """Quantize ``k``/``v`` ``[T, H, D]`` (any float dtype) and write them to their slots.

    ``slot_mapping[T]`` holds ``page_id * S + offset`` per token.
    """
    if k.dim() != 3 or v.shape != k.shape or k.shape[1:] != (layout.num_kv_heads, layout.head_dim):
        raise KernelInputError(
            f"k/v must be [T, {layout.num_kv_heads}, {layout.head_dim}], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}")
    t = k.shape[0]
    _check_slots(layout, pages, slot_mapping, t)
    page = (slot_mapping // layout.page_size).long()
    off = (slot_mapping % layout.page_size).long()
    fmt = layout.fmt
    # Quantize both before writing either, so rejected input (NaN/inf) leaves the pool as it was.
    quantized = (fmt.k.quantize(k, k_scale), fmt.v.quantize(v, v_scale))
    for (qd, qs), data, scales in zip(quantized, (pages.k_data, pages.v_data),
                                      (pages.k_scale, pages.v_scale)):
        data[page, :, off] = qd
        if scales is not None:
            scales[page, :, off] = qs


def gather_kv_ref(layout: PageLayout, pages: LayerPages, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, k_scale: float | torch.Tensor,
                  v_scale: float | torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize the first ``seq_lens[b]`` tokens of each sequence into a packed workspace.

    Args:
        block_tables: int32 ``[B, M]`` page ids per sequence.
        seq_lens: int ``[B]`` tokens to gather per sequence.
        dtype: workspace dtype (bf16, fp16, fp32 or float8_e4m3fn).
    Returns:
        ``(k, v)`` each ``[sum(seq_lens), H, D]`` of ``dtype``, sequences back to back.
    """
    s = layout.page_size
    if block_tables.dim() != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise KernelInputError("block_tables must be [B, M] and seq_lens [B]")
    if bool((seq_lens > block_tables.shape[1] * s).any()):
        raise KernelInputError("a sequence is longer than its block table")
    slots = [torch.arange(int(n), device=block_tables.device) for n in seq_lens.tolist()]
    if not slots or sum(seq_lens.tolist()) == 0:
        empty = torch.empty((0, layout.num_kv_heads, layout.head_dim), dtype=dtype,
                            device=pages.k_data.device)
        return empty, empty.clone()
    page = torch.cat([block_tables[b, sl // s] for b, sl in enumerate(slots)]).long()
    off = torch.cat([sl % s for sl in slots])
    return gather_rows_ref(layout, pages, page, off, k_scale, v_scale, dtype)


def gather_rows_ref(layout: PageLayout, pages: LayerPages, page_idx: torch.Tensor,
                    off_idx: torch.Tensor, k_scale: float | torch.Tensor,
                    v_scale: float | torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize token rows at (page_idx[i], off_idx[i]) -> ``(k, v)`` each ``[N, H, D]``.

    ``page_idx``/``off_idx``: int64 ``[N]``. Callers that gather the same rows
    for every layer compute these indices once per step.
    """
    fmt = layout.fmt
    out = []
    for elem, scale, data, scales in ((fmt.k, k_scale, pages.k_data, pages.k_scale),
                                      (fmt.v, v_scale, pages.v_data, pages.v_scale)):
        d = data[page_idx, :, off_idx]
        sc = scales[page_idx, :, off_idx] if scales is not None else None
        out.append(elem.dequantize(d, sc, scale, torch.float32).to(dtype))
    return out[0], out[1]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                  causal_offset: int | None) -> torch.Tensor:
    """Single-sequence GQA attention in FP32.

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, H, D]`` with ``Hq % H == 0``.
        causal_offset: ``None`` for no mask; else query ``i`` sees keys ``<= i + offset``
            (``offset = Tk - Tq`` when the queries are the last ``Tq`` tokens).
    Returns:
        ``[Tq, Hq, D]`` float32.
    """
    tq, hq, _ = q.shape
    tk, h, _ = k.shape
    if hq % h:
        raise KernelInputError(f"query heads {hq} not a multiple of KV heads {h}")
    group = hq // h
    qf = q.float().unflatten(1, (h, group))                       # [Tq, H, G, D]
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * sm_scale
    if causal_offset is not None:
        qi = torch.arange(tq, device=q.device)[:, None]
        ki = torch.arange(tk, device=q.device)[None, :]
        scores = scores.masked_fill(ki > qi + causal_offset, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.flatten(1, 2)


def decode_attention_ref(layout: PageLayout, pages: LayerPages, q: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                         k_scale: float | torch.Tensor, v_scale: float | torch.Tensor
                         ) -> torch.Tensor:
    """Paged decode: one query token per sequence attends over its cached tokens.

    Args:
        q: ``[B, Hq, D]``; block_tables int32 ``[B, M]``; seq_lens ``[B]`` (>= 1,
            the current token already stored).
    Returns:
        ``[B, Hq, D]`` float32.
    """
    if q.dim() != 3 or q.shape[0] != block_tables.shape[0]:
        raise KernelInputError(f"q must be [B, Hq, D] matching block_tables, got {tuple(q.shape)}")
    k, v = gather_kv_ref(layout, pages, block_tables, seq_lens, k_scale, v_scale, torch.float32)
    outs, start = [], 0
    for b, n in enumerate(seq_lens.tolist()):
        outs.append(attention_ref(q[b:b + 1], k[start:start + n], v[start:start + n],
                                  sm_scale, None))
        start += n
    return torch.cat(outs)
