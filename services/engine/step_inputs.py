"""A step's input tensors, built from the scheduled sequences with one ``torch.tensor`` per
field (no tensor per sequence): the eager runner and the decode graphs' buffers share them."""

from __future__ import annotations

import numpy as np
import torch

from .types import ScheduledSeq


def padded_block_tables(seqs: list[ScheduledSeq]) -> torch.Tensor:
    """int32 ``[len(seqs), W]`` on the CPU, ``W`` the longest block table; shorter rows are
    padded with page 0 (never read: a sequence's length bounds what a kernel reads)."""
    width = max(len(s.block_table) for s in seqs)
    # numpy fills rows from the lists in C: 0.54 ms for 16 x 2,048 pages against 1.97 ms
    # for one torch.tensor over a joined list (this machine's CPU)
    out = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        bt = s.block_table
        out[i, :len(bt)] = np.fromiter(bt, dtype=np.int32, count=len(bt))
    return torch.from_numpy(out)


def positions_of(seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's token positions and the row of the sequence each token belongs to, both
    int64 ``[T]`` on the CPU (``T`` = the step's tokens, sequence after sequence)."""
    pos: list[int] = []
    rows: list[int] = []
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        pos.extend(range(s.start_pos, s.start_pos + n))
        rows.extend([i] * n)
    return torch.tensor(pos, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)


def kv_slots(tables: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
             page_size: int) -> torch.Tensor:
    """int64 ``[T]``: the pool slot (page * page_size + offset) that each token's K/V is
    written to; ``tables`` int32 ``[B, W]``, ``rows`` and ``pos`` int64 ``[T]``."""
    return tables[rows, pos // page_size].long() * page_size + pos % page_size
