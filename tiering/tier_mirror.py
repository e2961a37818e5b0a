"""Tiers under tensor parallelism: rank 0's tier operations, replayed on every other rank.

Each rank's pool holds its own KV heads in the same page ids, so a cached page is one
L2 slot and one L3 record *per rank*. Rank 0's ``TierManager`` stays the only thing that
decides where pages go (one radix tree, one L2 index, one cost model); it writes every
move into a ``TierJournal`` as it makes it, and the followers replay the journal, in
order, on their own pool (``TierMirror``):

* ``("put", slot, page, key, persist)``: L1 ``page`` -> L2 ``slot`` (a backup or a
  write-back); ``persist``: also write this rank's L3 record (write-through);
* ``("persist", slot, key)``: write the record of L2 ``slot`` (an L2 eviction under
  write-back);
* ``("fetch", slot, key)``: read this rank's L3 record of ``key`` into L2 ``slot``;
* ``("load", slot, page)``: L2 ``slot`` -> L1 ``page``.

Why a journal of concrete moves, with rank 0's slot numbers, rather than each rank
running its own tier manager: the L2 LRU and the worker thread's timing would differ
per rank (uneven head splits even give ranks different page sizes), so independent
managers would disagree about what L2 holds; replaying rank 0's moves makes every
follower's L2 the same slots holding the same pages, with no index of its own. The
journal is replayed before each step's forward (and whenever rank 0's prefetch needs
an answer), so a page is copied on a follower before rank 0 can reuse it: a backed-up
L1 page stays pinned until its step, and a reused page is written only by a later
forward.

A page-set hit needs every rank's record: a follower reports the fetches it could not
complete (no record, or one refused by ``page_record``: forged, another shard or TP
size, damaged), and rank 0 keeps a fetched page out of L2 until every rank has
answered, dropping the ones any rank lacks, so a hit always covers every shard (the
rest is recomputed).

A follower's L3 reads and writes run inline when it replays, before the step's forward
(rank 0's run on its tier worker): fine for the CPU groups of this version; a GPU group
would give the followers a worker thread of their own.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from .page_record import PageHeader, PageRecordError, check_finite, decode_page, encode_page
from .page_record import record_key as _record_key
from .secret import KVSecret

log = logging.getLogger(__name__)


class TierJournal:
    """Rank 0's tier moves in the order they happened (engine and tier-worker threads)."""

    def __init__(self) -> None:
        self._ops: list[tuple] = []
        self._lock = threading.Lock()

    def append(self, op: tuple) -> None:
        with self._lock:
            self._ops.append(op)

    def take(self) -> list[tuple]:
        """Every move since the last ``take``, oldest first."""
        with self._lock:
            ops, self._ops = self._ops, []
        return ops

    def __len__(self) -> int:
        with self._lock:
            return len(self._ops)


class TierMirror:
    """A follower's L2 (``num_slots`` slots shaped like its pool's pages, uint8
    ``[num_slots, num_layers, layer_nbytes]``) and its L3 records, moved only by
    ``apply(ops)`` from rank 0's journal. ``tp``: (size, rank) of this shard."""

    def __init__(self, pool, num_slots: int, storage, *, secret: KVSecret,
                 tp: tuple[int, int]):
        self.pool, self.storage, self.secret, self.tp = pool, storage, secret, tp
        self.data = pool.layout.allocate(num_slots, "cpu")
        self.counters = {"l2_written": 0, "l1_loaded": 0, "l3_written": 0, "l3_read": 0,
                         "l3_missing": 0, "l3_rejected": 0}

    def header(self) -> PageHeader:
        p = self.pool
        return PageHeader.for_pool(p.layout, p.scale_version, p.global_scales, p.recipe_digest,
                                   self.tp)

    def record_key(self, key: bytes) -> bytes:
        return _record_key(key, self.tp[0], self.tp[1], secret=self.secret)

    def apply(self, ops: list[tuple]) -> list[bytes]:
        """Replay ``ops`` in order; return the keys whose fetch failed on this rank."""
        failed: list[bytes] = []
        for op in ops:
            kind = op[0]
            if kind == "put":
                _, slot, page, key, persist = op
                self.data[slot].copy_(self.pool.pages[page])
                self.counters["l2_written"] += 1
                if persist:
                    self._persist(slot, key)
            elif kind == "persist":
                self._persist(op[1], op[2])
            elif kind == "fetch":
                if not self._fetch(op[1], op[2]):
                    failed.append(op[2])
            elif kind == "load":
                self.pool.pages[op[2]].copy_(self.data[op[1]])
                self.counters["l1_loaded"] += 1
            else:
                raise ValueError(f"unknown tier op {kind!r}")
        return failed

    def _persist(self, slot: int, key: bytes) -> None:
        if self.storage is None:
            return
        rkey = self.record_key(key)
        record = encode_page(self.header(), self.data[slot], key=rkey, secret=self.secret)
        self.counters["l3_written"] += self.storage.put_batch([(rkey, record)])

    def _fetch(self, slot: int, key: bytes) -> bool:
        """This rank's record of ``key`` into ``slot``; False if it is missing or refused."""
        if self.storage is None:
            return False
        rkey = self.record_key(key)
        blob = self.storage.get_batch([rkey])[0]
        if blob is None:
            self.counters["l3_missing"] += 1
            return False
        header = self.header()
        try:
            payload = decode_page(blob, header, key=rkey, secret=self.secret)
            check_finite(self.pool.layout, payload, header)
        except PageRecordError as e:
            log.warning("rank %d refused an L3 page record (%s): %s", self.tp[1], e.reason, e)
            self.counters["l3_rejected"] += 1
            if e.reason != "stale":
                self.storage.delete_batch([rkey])
            return False
        self.data[slot].view(-1).copy_(torch.from_numpy(np.frombuffer(payload, np.uint8).copy()))
        self.counters["l3_read"] += 1
        return True
