"""Contiguous runs of page ids: how few copies or descriptors a page transfer needs.

One page is ``page_nbytes`` contiguous bytes of a pool ``[num_pages, num_layers,
layer_nbytes]`` (all its layers together, see ``nibble.kernels.layout``), so a run
of ascending page ids is one contiguous byte range, and a transfer whose source
and destination pages are both ascending runs, in the same order, moves each run
as one copy or one transfer descriptor. Pure functions over ints.
"""

from __future__ import annotations

from typing import Sequence


def contiguous_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of consecutive ascending ids, in order.

    ``[4, 5, 6, 2, 9, 10] -> [(4, 3), (2, 1), (9, 2)]``.
    """
    runs: list[tuple[int, int]] = []
    for p in pages:
        p = int(p)
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def merge_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs of the pairing ``src[i] -> dst[i]``, each
    adjacent on both sides (``src[i+1] == src[i] + 1`` and ``dst[i+1] == dst[i] + 1``),
    in order; their lengths sum to ``len(src)``.

    ``merge_runs([3, 4, 5, 9], [7, 8, 1, 2]) -> [(3, 7, 2), (5, 1, 1), (9, 2, 1)]``.
    Raises ValueError when the lists differ in length.
    """
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages against {len(dst)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        s, d = int(s), int(d)
        if runs:
            s0, d0, n = runs[-1]
            if s0 + n == s and d0 + n == d:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
