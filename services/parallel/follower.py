"""Ranks 1..n-1 of a tensor-parallel group: run the steps rank 0 broadcasts.

Rank 0 schedules (one scheduler, one radix tree, one page accounting: page ids are
the same on every rank) and broadcasts each step's ``ScheduledBatch`` before its
forward (``ModelRunner.execute``); a follower runs the same forward on its shard of
the weights and its own KV pool (its KV heads), joining the collectives, and never
samples. Broadcasting the batch rather than scheduling identically on every rank keeps
the followers free of scheduler state: the tiers, the prefix cache, request arrival
order and timing all live on rank 0 alone.
"""

from __future__ import annotations

import logging

from .group import TPGroup

log = logging.getLogger(__name__)

STOP = ("stop",)


def follow(runner, tp: TPGroup) -> None:
    """Run rank 0's steps on ``runner`` (a ModelRunner on this rank's shard) until it stops."""
    log.info("tensor-parallel rank %d of %d following rank 0", tp.rank, tp.size)
    while True:
        msg = tp.broadcast_object()
        if msg[0] == "stop":
            return
        _, batch, page_size = msg
        runner.forward_only(batch, page_size)


def stop_followers(tp: TPGroup) -> None:
    """Rank 0: end the followers' loops (they return from ``follow``)."""
    if tp.size > 1 and tp.rank == 0:
        tp.broadcast_object(STOP)
