"""Ranks 1..n-1 of a tensor-parallel group: run the steps rank 0 broadcasts.

Rank 0 schedules (one scheduler, one radix tree, one page accounting: page ids are
the same on every rank) and broadcasts each step's ``ScheduledBatch`` before its
forward (``ModelRunner.announce``); a follower runs the same forward on its shard of
the weights and its own KV pool (its KV heads), joining the collectives, and never
samples. A step rank 0 launches without waiting (overlap scheduling, ``("launch", ...)``)
reads its decodes' ids from the previous launched step's sampled ids on the device: rank 0
broadcasts them as a tensor right after sampling (NCCL: on the GPU, no host round trip), and
each follower keeps its copy for the next launch. Broadcasting the batch rather than
scheduling identically on every rank keeps the followers free of scheduler state: the
tiers, the prefix cache, request arrival order and timing all live on rank 0 alone.

Tiers (``--enable-hierarchical-cache``): rank 0's tier manager journals every page move
(L1 <-> L2 slot, L2 <-> L3 record); before a step's forward, and whenever a prefetch
needs an answer, rank 0 broadcasts ``("tiers", ops)`` and each follower replays them on
its own pool, L2 slots and L3 records (``tiering.tier_mirror.TierMirror``), then sends
back the keys it could not fetch, so rank 0 counts a page as hit only when every rank
holds it. The moves are rank 0's decisions with rank 0's slot numbers: the followers
keep no tier state that could drift from rank 0's.
"""

from __future__ import annotations

import logging

from nibble.kernels.errors import NibbleError

from .group import TPGroup

log = logging.getLogger(__name__)

STOP = ("stop",)


class TierMirrorMissingError(NibbleError):
    """Rank 0 sent tier moves to a follower built without tiers (configs differ)."""


def follow(runner, tp: TPGroup, mirror=None, kv=None) -> None:
    """Run rank 0's steps on ``runner`` (a ModelRunner on this rank's shard) until it stops;
    ``mirror``: this rank's ``TierMirror`` (None without L2/L3); ``kv``: this rank's
    ``FollowerTransfers`` in a disaggregated worker (``services/disagg/rank_transfer.py``:
    rank 0's ``("kv", op, ...)`` messages, each answered by a gather), else None."""
    log.info("tensor-parallel rank %d of %d following rank 0", tp.rank, tp.size)
    last = None          # the last launched step's sampled ids (overlap scheduling)
    while True:
        msg = tp.broadcast_object()
        if msg[0] == "stop":
            return
        if msg[0] == "launch":
            last = _launched(runner, tp, *msg[1:], last)
            continue
        if msg[0] == "tiers":
            if mirror is None:
                raise TierMirrorMissingError(
                    f"rank {tp.rank} has no tiers but rank 0 sent tier moves")
            tp.gather_object(mirror.apply(msg[1]))
            continue
        if msg[0] == "kv":
            tp.gather_object(("err", f"rank {tp.rank} has no KV transport") if kv is None
                             else kv.handle(*msg[1:]))
            continue
        _, batch, page_size = msg
        runner.forward_only(batch, page_size)


def _launched(runner, tp: TPGroup, batch, page_size: int, src, last):
    """Rank 0 launched ``batch`` without waiting (overlap scheduling): its placeholders read
    the previous launched step's ids, which rank 0 broadcast as it sampled them; run the same
    forward and take this step's ids for the next one (int64 ``[sampled rows]``)."""
    import torch

    from ..engine.overlap import launch_ids
    ids = launch_ids([t for e in batch.seqs for t in e.token_ids], src, last, runner.device)
    with torch.inference_mode():
        runner.forward_ids(batch.seqs, page_size, ids)
    n = sum(1 for e in batch.seqs if e.sample)
    return tp.broadcast_tensor(torch.empty(n, dtype=torch.int64, device=runner.device)) \
        if n else last


def mirror_tiers(tp: TPGroup, ops: list[tuple]) -> list[bytes]:
    """Rank 0: have every follower replay ``ops``; the keys any rank could not fetch."""
    tp.broadcast_object(("tiers", ops))
    answers = tp.gather_object([]) or []
    return [key for failed in answers[1:] for key in failed]


def stop_followers(tp: TPGroup) -> None:
    """Rank 0: end the followers' loops (they return from ``follow``)."""
    if tp.size > 1 and tp.rank == 0:
        tp.broadcast_object(STOP)
