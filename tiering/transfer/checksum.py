"""Integrity checksum of a set of pages, computed where the pages live.

A transfer's completion message carries the checksum of the source pages; the
receiver recomputes it over the pages it reserved, so equal checksums mean the
reserved pages hold exactly the bytes that were sent. Authentication is the job
of the signed ticket and of the checksum tag that binds this checksum to it
(``signing.checksum_tag``). The sums use fixed public multipliers: this detects
corruption and substitution of a whole page set, not bytes crafted to collide by
someone on the channel (TLS keeps them off it).

The checksum is computed on the pool's device, so a 32K-token request's
1.4 GB of NVFP4 pages is never copied to the host: each page is cut into
chunks of ``CHUNK`` bytes and each chunk reduced to one exact int64,
``sum_j byte_j * m_j`` with fixed random 40-bit multipliers (255 * 2^40 * 2^15
< 2^63, so nothing overflows and CPU and GPU agree bit for bit). SHA-256 over
those partial sums, page by page in order, is the checksum. Any change of
one byte changes its chunk's sum (the multipliers are non-zero); independent
changes cancel with probability about 2^-40.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

CHUNK = 1 << 15                    # bytes per partial sum
_MULT_SEED = 0x4E1BB1E
BATCH_BYTES = {"cuda": 256 << 20, "cpu": 8 << 20}  # per pass (8-byte temporaries per byte)
_multipliers: dict[str, torch.Tensor] = {}


def _mults(device: torch.device) -> torch.Tensor:
    """int64 ``[CHUNK]`` multipliers in [1, 2^40), the same on every device."""
    key = str(device)
    if key not in _multipliers:
        g = torch.Generator().manual_seed(_MULT_SEED)
        _multipliers[key] = torch.randint(1, 1 << 40, (CHUNK,), dtype=torch.int64,
                                          generator=g).to(device)
    return _multipliers[key]


def page_bytes(pool_pages: torch.Tensor, page: int) -> memoryview:
    """The bytes of one page of a contiguous uint8 pool ``[num_pages, ...]`` (copied off-GPU)."""
    row = pool_pages[page]
    if row.device.type != "cpu":
        row = row.cpu()
    return memoryview(row.contiguous().reshape(-1).numpy()).cast("B")


def chunk_sums_ref(pages: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, page_nbytes]`` -> int64 ``[n, ceil(page_nbytes / CHUNK)]`` partial sums
    (the definition, in int64; what ``chunk_sums`` computes on devices)."""
    n, nbytes = pages.shape
    pad = -nbytes % CHUNK
    if pad:
        pages = torch.nn.functional.pad(pages, (0, pad))
    x = pages.reshape(n, -1, CHUNK).to(torch.int64)
    return (x * _mults(pages.device)).sum(dim=-1)


def _split_mults(device: torch.device) -> torch.Tensor:
    """float64 ``[CHUNK, 2]``: the multipliers' low and high 20 bits."""
    key = f"split-{device}"
    if key not in _multipliers:
        m = _mults(device)
        _multipliers[key] = torch.stack([m & ((1 << 20) - 1), m >> 20], 1).to(torch.float64)
    return _multipliers[key]


def chunk_sums(pages: torch.Tensor, work: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[n, page_nbytes]`` -> int64 ``[n, ceil(page_nbytes / CHUNK)]`` partial sums,
    equal to ``chunk_sums_ref``.

    On the CPU as a float64 matrix product against the multipliers' low and
    high 20 bits: every partial sum is an integer below 255 * 2^20 * 2^15 < 2^53,
    so float64 holds it exactly in any summation order, and
    ``low + (high << 20)`` rebuilds the int64 sum. ``work``: a reusable float64
    ``[>= n, ceil(page_nbytes / CHUNK) * CHUNK]`` buffer whose columns past
    ``page_nbytes`` are zero (made here when None), so no large temporary is
    allocated (and page-faulted) per call.
    """
    if pages.device.type != "cpu":
        return chunk_sums_ref(pages)
    n, nbytes = pages.shape
    cols = -(-nbytes // CHUNK) * CHUNK
    if work is None or work.shape[0] < n or work.shape[1] != cols:
        work = torch.zeros(n, cols, dtype=torch.float64)
    work = work[:n]
    work[:, :nbytes].copy_(pages)
    s = (work.view(-1, CHUNK) @ _split_mults(pages.device)).to(torch.int64)
    return (s[:, 0] + (s[:, 1] << 20)).reshape(n, -1)


def page_set_checksum(pool_pages: torch.Tensor, pages: Sequence[int]) -> str:
    """Hex SHA-256 over the chunk sums of ``pool_pages[p]`` for ``p`` in ``pages``, in order.

    ``pool_pages``: uint8 ``[num_pages, num_layers, layer_nbytes]`` on any device;
    one page is ``page_nbytes`` contiguous bytes. Only the sums (8 bytes per
    32 KiB) leave the device.
    """
    h = hashlib.sha256()
    pages = [int(p) for p in pages]
    if not pages:
        return h.hexdigest()
    flat = pool_pages.reshape(pool_pages.shape[0], -1)
    cols = -(-flat.shape[1] // CHUNK) * CHUNK
    per_batch = max(1, BATCH_BYTES.get(flat.device.type, BATCH_BYTES["cpu"]) // (8 * cols))
    work = (torch.zeros(min(per_batch, len(pages)), cols, dtype=torch.float64)
            if flat.device.type == "cpu" else None)
    for i in range(0, len(pages), per_batch):
        idx = torch.tensor(pages[i:i + per_batch], dtype=torch.long, device=flat.device)
        sums = chunk_sums(flat.index_select(0, idx), work)
        h.update(sums.cpu().numpy().astype("<i8").tobytes())
    return h.hexdigest()
