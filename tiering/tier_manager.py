"""The tier manager: the only component that moves pages between L1, L2 and L3.

* **Keys.** Every cached page is identified by its chained content key
  (``page_record.chain_keys``), namespaced by model, format, layout and tenant.
  The L1 radix tree indexes token runs to L1 pages; for pages below L1 the key
  is the handle, and the tier manager's indexes (L2 slot map, L3 store) say
  where that key lives.
* **Write path.** ``write_through``: pages go to L2 (and on to L3) as soon as
  they are cached in L1; ``write_through_selective``: only from their second
  hit; ``write_back``: when L1 evicts them (L2 -> L3 when L2 evicts). The
  write-through copies run on the worker thread, with L1 pages pinned meanwhile,
  so no step waits; a write-back copy runs inline on the engine thread
  (``before_reuse``, called by the cache manager just before L1 reuses the
  pages), since the page is about to be overwritten.
* **Read path.** Before admission, ``prepare`` finds the run of pages that
  follows the L1 hit in L2 and, where the cost model says loading beats
  recomputing, starts an L3 -> L2 prefetch; ``load`` then copies the run from L2
  into fresh L1 pages, which the cache manager inserts into the radix tree (the
  tier manager never writes the tree; it only reads ``is_cached``). ``best_effort`` holds
  the request while the prefetch runs, but never longer than recomputing the
  fetched pages would take (so a read is used, not wasted, on an idle server);
  ``wait_complete`` holds it until the prefetch ends, ``timeout`` at most
  ``prefetch_timeout_s``. Held requests let later ones be admitted meanwhile.
* **Tensor parallelism** (``tp`` size > 1, rank 0): every move is also written to a
  ``TierJournal`` that the other ranks replay on their own pool (``tier_mirror``); a
  fetched page joins L2 only once every rank has its record (``sync``).
* **Trust.** Keys are keyed hashes and L3 records carry an HMAC under the
  deployment's KV secret (``page_record``); a record that fails verification,
  or holds non-finite scales, is counted, deleted from L3 and recomputed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from .allocator import PageId
from .errors import CacheArgumentError
from .events import KVEventLog
from .host_pool import HostPool
from .kv_pool import KVPool
from .page_record import (REJECT_REASONS, PageHeader, chain_keys, encode_page, namespace_root,
                          record_key)
from .radix_cache import RadixCache
from .secret import KVSecret
from .tier_mirror import TierJournal
from .tier_worker import Prefetch, TierWorker

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class TierPolicy:
    write_policy: str = "write_through"
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 2.0
    l3_latency_s: float = 0.002          # per batch round trip, for the cost model
    assumed_l3_bytes_s: float = 300e6    # until a fetch has been measured
    assumed_prefill_tok_s: float = 500.0  # until a prefill has been measured


@dataclass(frozen=True)
class LoadResult:
    pages: list[PageId]        # new L1 pages (refcount 1; the caller inserts them in the tree)
    keys: list[bytes]          # their content keys, in order
    from_l2: int               # pages that were already in L2
    from_l3: int               # pages that came up from L3 for this request


class TierManager:
    """``secret``: the deployment's KV secret (keys and record tags); None makes an ephemeral
    one, so this process's L3 records are unreadable to any other. ``clock``: monotonic
    seconds (injectable for tests). ``tp``: (size, rank) of the tensor-parallel group this
    pool is a shard of: the size goes into the content keys' namespace, and L3 records are
    stored under ``record_key(key, size, rank)`` with both in their authenticated header
    (``page_record``), so no record reaches another shard or TP size."""

    def __init__(self, pool: KVPool, cache: RadixCache, fingerprint: str,
                 host: HostPool | None, storage=None, policy: TierPolicy = TierPolicy(), *,
                 secret: KVSecret | None = None, clock: Callable[[], float] = time.monotonic,
                 tp: tuple[int, int] = (1, 0)):
        if policy.write_policy not in WRITE_POLICIES or policy.prefetch_policy not in PREFETCH_POLICIES:
            raise CacheArgumentError(f"bad tier policy {policy}")
        self.pool, self.cache, self.host, self.storage = pool, cache, host, storage
        self.policy = policy
        self.secret = secret if secret is not None else KVSecret.generate()
        self.clock = clock
        self.tp = tp
        self.fingerprint = fingerprint
        self.page_size = pool.layout.page_size
        self._roots: dict[str, bytes] = {}
        self._l1_key: dict[PageId, bytes] = {}       # cached L1 page -> its content key
        self._hits: dict[bytes, int] = {}            # for write_through_selective
        self._inflight: dict[int, tuple[list[PageId], list[bytes]]] = {}  # job -> pinned pages, keys
        self._inflight_keys: set[bytes] = set()
        self._discarded: set[bytes] = set()          # suspect keys whose backup is in flight
        self._job_ids = 0
        self._prefetch: dict[str, Prefetch] = {}
        self.prefill_tok_s = 0.0
        self.counters = {"l1_hit_pages": 0, "l2_hit_pages": 0, "l3_hit_pages": 0,
                         "l2_to_l1_pages": 0, "l1_to_l2_evict_pages": 0,
                         "prefetch_skipped_slow": 0, "load_seconds": 0.0, "loads": 0,
                         "l3_peer_missing": 0}
        self.events = KVEventLog()
        # tensor parallel: the moves the other ranks replay, and how they are sent to them
        # (``mirror(ops) -> keys some rank could not fetch``; set by the engine's builder)
        self.journal = TierJournal() if tp[0] > 1 else None
        self.mirror: Callable[[list[tuple]], list[bytes]] | None = None
        self.worker = TierWorker(pool.pages, host, storage, self.header, self.events,
                                 layout=pool.layout, secret=self.secret,
                                 record_key=self.record_key, journal=self.journal)
        if host is not None:
            host.on_evict = self._on_l2_evict

    # ---- identity ----
    def header(self) -> PageHeader:
        return PageHeader.for_pool(self.pool.layout, self.pool.scale_version, self.pool.global_scales,
                                   self.pool.recipe_digest, self.tp)

    def record_key(self, key: bytes) -> bytes:
        """The L3 key of this rank's record of the page with content ``key``."""
        return record_key(key, self.tp[0], self.tp[1], secret=self.secret)

    def keys(self, namespace: str, tokens, num_pages: int) -> list[bytes]:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = namespace_root(
                self.fingerprint, self.pool.layout, namespace, self.pool.recipe_digest,
                secret=self.secret, tp_size=self.tp[0])
        return chain_keys(root, tokens[:num_pages * self.page_size], self.page_size,
                          secret=self.secret)

    # ---- write path (engine thread) ----
    def on_cached(self, namespace: str, tokens, pages: list[PageId]) -> None:
        """``pages`` (full pages of ``tokens``) were offered to the radix tree."""
        todo, stored = [], []
        for page, key in zip(pages, self.keys(namespace, tokens, len(pages))):
            if not self.cache.is_cached(page) or page in self._l1_key:
                continue
            self._l1_key[page] = key
            stored.append(key)
            if self.host is not None and self._wants_backup(key):
                todo.append((page, key))
        self.events.emit("stored", "l1", stored)
        self._backup(todo)

    def _wants_backup(self, key: bytes) -> bool:
        if self.policy.write_policy == "write_back" or key in self._inflight_keys or key in self.host:
            return False
        return self.policy.write_policy == "write_through" or self._hits.get(key, 0) >= 2

    def note_hits(self, pages: list[PageId]) -> None:
        """L1 prefix hits (for the selective policy and hit metrics)."""
        self.counters["l1_hit_pages"] += len(pages)
        if self.policy.write_policy != "write_through_selective" or self.host is None:
            return
        todo = []
        for page in pages:
            key = self._l1_key.get(page)
            if key is not None:
                self._hits[key] = self._hits.get(key, 0) + 1
                if self._wants_backup(key):
                    todo.append((page, key))
        self._backup(todo)

    def _backup(self, pairs: list[tuple[PageId, bytes]]) -> None:
        if not pairs:
            return
        pages = [p for p, _ in pairs]
        self.pool.allocator.incref(pages)             # pinned until the copy is done
        self._job_ids += 1
        self._inflight[self._job_ids] = (pages, [k for _, k in pairs])
        self._inflight_keys.update(k for _, k in pairs)
        self.worker.submit("backup", self._job_ids, pairs)

    def before_reuse(self, pages: list[PageId]) -> None:
        """``pages`` left the L1 tree and L1 is about to hand (some of) them out again:
        forget their L1 keys, and under ``write_back`` copy them to L2 first, inline
        (their bytes are intact until the new owner writes). Called by the cache
        manager, the pool's one reuse hook."""
        for page in pages:
            key = self._l1_key.pop(page, None)
            if key is not None:
                self.events.emit("removed", "l1", [key])
            if key is None or self.host is None or self.policy.write_policy != "write_back" \
                    or key in self.host:
                continue
            slot = self.host.reserve(key)
            if slot is not None:
                if self.journal is not None:
                    self.journal.append(("put", slot, page, key, False))
                self.host.data[slot].copy_(self.pool.pages[page])
                self.host.commit(key)
                self.counters["l1_to_l2_evict_pages"] += 1
                self.events.emit("stored", "l2", [key])

    def _on_l2_evict(self, key: bytes, slot: int) -> None:
        self.events.emit("removed", "l2", [key])
        if self.storage is not None and self.policy.write_policy == "write_back":
            if self.journal is not None:
                self.journal.append(("persist", slot, key))
            rkey = self.record_key(key)
            record = encode_page(self.header(), self.host.data[slot], key=rkey, secret=self.secret)
            self.worker.submit("persist", [(key, rkey, record)])

    def poll(self) -> None:
        """Apply finished background work (engine thread, once per step)."""
        self.sync()
        while not self.worker.done.empty():
            kind, job_id = self.worker.done.get_nowait()
            if kind == "backup":
                pages, keys = self._inflight.pop(job_id)
                self._inflight_keys.difference_update(keys)
                self.pool.free(pages)
                for key in self._discarded.intersection(keys):
                    self._discarded.discard(key)
                    if self.host is not None and key in self.host:
                        self.host.drop(key)
                        self.events.emit("removed", "l2", [key])

    def sync(self) -> None:
        """Tensor parallel, rank 0 (engine thread): send the journal to the other ranks,
        which replay it, then let into L2 the fetched pages every rank now holds and drop
        the ones some rank lacks (a hit needs every shard). Called before each step's
        forward, from ``poll``, and when a prefetch has finished."""
        if self.journal is None or self.mirror is None:
            return
        settled = [pf for pf in self._prefetch.values() if pf.done and not pf.acked]
        ops = self.journal.take()
        if ops:
            failed = set(self.mirror(ops))
            for op in ops:
                if op[0] == "fetch":
                    self._settle_fetch(op[2], op[2] in failed)
        for pf in settled:
            pf.acked = True

    def _settle_fetch(self, key: bytes, failed: bool) -> None:
        if not failed:
            self.host.commit(key)
            return
        self.host.drop(key)
        self.counters["l3_peer_missing"] += 1
        for pf in self._prefetch.values():
            pf.loaded.discard(key)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until queued background work is done and applied; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._inflight or self.worker.busy():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
            self.poll()
        return True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:
            tps = tokens / seconds
            self.prefill_tok_s = tps if not self.prefill_tok_s else 0.8 * self.prefill_tok_s + 0.2 * tps

    # ---- read path (engine thread) ----
    def _l2_run(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.host:
            n += 1
        return n

    def prepare(self, request_id: str, namespace: str, tokens, first: int, limit: int) -> bool:
        """May the request be admitted now? Starts its L3 prefetch on the first call.

        ``first``: pages already matched in L1; ``limit``: most pages to reuse. Admits once
        the prefetch is done or its hold (``_hold_s``) has passed, with what arrived.
        """
        if self.host is None or first >= limit:
            return True
        pf = self._prefetch.get(request_id)
        if pf is None:
            keys = self.keys(namespace, tokens, limit)[first:]
            in_l2 = self._l2_run(keys)
            rest = keys[in_l2:]
            if not rest or self.storage is None or not self._worth_fetching(len(rest)):
                self._prefetch[request_id] = Prefetch([], done=True)   # decided: nothing to fetch
                return True
            now = self.clock()
            pf = self._prefetch[request_id] = Prefetch(rest, started=now,
                                                       deadline=now + self._hold_s(len(rest)))
            self.worker.submit("fetch", request_id, pf)
        if pf.done and self.journal is not None and not pf.acked:
            self.sync()                       # tensor parallel: every rank's answer first
        settled = pf.done and (self.journal is None or self.mirror is None or pf.acked)
        return settled or self.clock() >= pf.deadline

    def _hold_s(self, num_pages: int) -> float:
        """How long a request may wait for its prefetch of ``num_pages``, per the policy.

        best_effort: as long as recomputing those pages would take (capped by the
        timeout): waiting longer would cost more than it saves, and not waiting at all
        reads pages that an idle server then never uses.
        """
        policy = self.policy
        if policy.prefetch_policy == "wait_complete":
            return float("inf")
        if policy.prefetch_policy == "timeout":
            return policy.prefetch_timeout_s
        return min(self._recompute_s(num_pages), policy.prefetch_timeout_s)

    def _recompute_s(self, num_pages: int) -> float:
        tps = self.prefill_tok_s or self.policy.assumed_prefill_tok_s
        return num_pages * self.page_size / tps

    def _worth_fetching(self, num_pages: int) -> bool:
        """Cost model: load from L3 only when it beats recomputing (sglang#26305's trap)."""
        bw = self.worker.l3_bytes_s or self.policy.assumed_l3_bytes_s
        batches = -(-num_pages // 64)
        load_s = num_pages * self.pool.layout.page_nbytes / bw + batches * self.policy.l3_latency_s
        if load_s < self._recompute_s(num_pages):
            return True
        self.counters["prefetch_skipped_slow"] += 1
        return False

    def load(self, request_id: str, namespace: str, tokens, first: int, limit: int,
             max_new: int, allocate: Callable[[int], list[PageId]]) -> LoadResult:
        """Copy the L2-resident run after the ``first`` pages matched in L1 into new L1 pages
        (at most ``max_new``), taken with ``allocate(n)`` (refcount 1, for the caller).

        The caller inserts them into the radix tree, then calls ``on_loaded``.
        """
        pf = self._prefetch.pop(request_id, None)
        if self.host is None or first >= limit or max_new <= 0:
            return LoadResult([], [], 0, 0)
        keys = self.keys(namespace, tokens, limit)[first:]
        keys = keys[:min(self._l2_run(keys), max_new, self.pool.allocator.num_free)]
        if not keys:
            return LoadResult([], [], 0, 0)
        t0 = time.perf_counter()
        self.host.pin(keys)
        try:
            pages = allocate(len(keys))
            for page, key in zip(pages, keys):
                slot = self.host.slot(key)
                self.pool.pages[page].copy_(self.host.data[slot])
                if self.journal is not None:
                    self.journal.append(("load", slot, page))
        finally:
            self.host.unpin(keys)
        from_l3 = len(pf.loaded.intersection(keys)) if pf is not None else 0
        self.counters["l2_hit_pages"] += len(pages) - from_l3
        self.counters["l3_hit_pages"] += from_l3
        self.counters["l2_to_l1_pages"] += len(pages)
        self.counters["load_seconds"] += time.perf_counter() - t0
        self.counters["loads"] += 1
        return LoadResult(pages, keys, len(pages) - from_l3, from_l3)

    def on_loaded(self, pages: list[PageId], keys: list[bytes]) -> None:
        """Loaded ``pages`` (with their ``keys``) were offered to the radix tree."""
        for page, key in zip(pages, keys):
            if self.cache.is_cached(page):
                self._l1_key[page] = key
        self.events.emit("stored", "l1", keys)

    def pinned_pages(self) -> list[PageId]:
        """L1 pages the in-flight backups hold a reference on (one entry per reference)."""
        return [p for pages, _ in self._inflight.values() for p in pages]

    def discard(self, pages: list[PageId]) -> None:
        """Forget the L1 pages the radix tree just dropped as suspect (a step failed on them),
        and their copies in L2, so no later request can load them again. A backup still
        copying one of them is dropped from L2 when it completes (``poll``)."""
        keys = [k for p in pages if (k := self._l1_key.pop(p, None)) is not None]
        self.events.emit("removed", "l1", keys)
        for key in keys:
            self._hits.pop(key, None)
            if key in self._inflight_keys:
                self._discarded.add(key)
            elif self.host is not None and key in self.host:
                self.host.drop(key)
                self.events.emit("removed", "l2", [key])

    def cancel(self, request_id: str) -> None:
        """Forget a waiting request's prefetch (aborted); fetched pages stay in L2."""
        self._prefetch.pop(request_id, None)

    def flush(self) -> None:
        """Forget L2 (L3 is storage and stays); called with the L1 cache flush."""
        self.events.emit("removed", "l1", list(self._l1_key.values()))
        self._l1_key.clear()
        self._hits.clear()
        if self.host is not None:
            self.events.emit("removed", "l2", self.host.keys())
            self.host.clear()

    def stats(self) -> dict:
        health = self.storage.health() if self.storage is not None else None
        return {
            "hierarchical": self.host is not None,
            **self.counters, **self.worker.counters,
            "l2_pages": len(self.host) if self.host is not None else 0,
            "l2_capacity_pages": self.host.num_pages if self.host is not None else 0,
            "l2_evictions": self.host.evictions if self.host is not None else 0,
            "backup_pinned_pages": len(self.pinned_pages()),   # L1 pages in-flight backups hold
            "l3_state": health.state if health is not None else "absent",
            "l3_bytes_per_s": self.worker.l3_bytes_s, "prefill_tok_per_s": self.prefill_tok_s,
            "write_policy": self.policy.write_policy, "prefetch_policy": self.policy.prefetch_policy,
            "rejected_records": {"l3": {r: self.worker.counters[f"l3_rejected_{r}"]
                                        for r in REJECT_REASONS}},
        }

    def close(self) -> None:
        self.worker.close()
