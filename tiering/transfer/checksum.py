"""SHA-256 of a set of pages, for the transfer's completion message."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch


def page_bytes(pool_pages: torch.Tensor, page: int) -> memoryview:
    """The bytes of one page of a contiguous uint8 pool ``[num_pages, ...]`` (copied off-GPU)."""
    row = pool_pages[page]
    if row.device.type != "cpu":
        row = row.cpu()
    return memoryview(row.contiguous().reshape(-1).numpy()).cast("B")


def page_set_checksum(pool_pages: torch.Tensor, pages: Sequence[int]) -> str:
    """Hex SHA-256 over the bytes of ``pool_pages[p]`` for ``p`` in ``pages``, in that order.

    ``pool_pages``: uint8 ``[num_pages, num_layers, layer_nbytes]`` (any device);
    one page is ``page_nbytes`` contiguous bytes, so equal checksums mean the
    page sets are bit-identical.
    """
    h = hashlib.sha256()
    if pool_pages.device.type != "cpu" and len(pages):
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=pool_pages.device)
        pool_pages, pages = pool_pages.index_select(0, idx).cpu(), range(len(pages))
    for p in pages:
        h.update(page_bytes(pool_pages, int(p)))
    return h.hexdigest()
