"""Background jobs of the tier manager: L1->L2 backups, L2->L3 writes, L3->L2 prefetches.

The worker never touches allocator state; the engine thread pins L1 pages
before a backup and unpins them when the job's completion comes back through
``done`` (drained by ``TierManager.poll``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from nibble.kernels import PageLayout

from .host_pool import HostPool
from .page_record import REJECT_REASONS, PageRecordError, check_finite, decode_page, encode_page
from .secret import KVSecret

log = logging.getLogger(__name__)
BATCH = 64


@dataclass
class Prefetch:
    """An L3 -> L2 fetch for one waiting request."""

    keys: list[bytes]
    started: float = field(default_factory=time.monotonic)
    deadline: float = float("inf")                   # admit the request from then on anyway
    done: bool = False
    acked: bool = False           # tensor parallel: every rank has answered for its fetches
    loaded: set[bytes] = field(default_factory=set)   # keys that arrived intact in L2
    corrupt: int = 0


class TierWorker:
    """One daemon thread executing tier jobs in order."""

    def __init__(self, pool_pages: torch.Tensor, host: HostPool | None, storage, header_fn,
                 events=None, *, layout: PageLayout, secret: KVSecret, record_key=None, journal=None):
        self.pool_pages = pool_pages
        self.layout = layout
        self.secret = secret                  # authenticates the records (page_record)
        self.host = host
        self.storage = storage
        self.header_fn = header_fn            # () -> PageHeader of the pool's current scales
        # content key -> the key of this rank's L3 record (tensor parallel; identity for one)
        self.record_key = record_key or (lambda key: key)
        # tensor parallel, rank 0: the moves the other ranks replay (tier_mirror.TierJournal);
        # a fetched page stays pending in L2 until every rank has its record (TierManager.sync)
        self.journal = journal
        self.events = events                  # KVEventLog or None
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.l3_bytes_s = 0.0                 # EMA of measured L3 read bandwidth (0 = unknown)
        self.counters = {"l2_written": 0, "l3_written": 0, "l3_write_failed": 0,
                         "l3_read": 0, "l3_miss": 0, "l3_corrupt": 0, "l3_bytes_read": 0,
                         "l3_bytes_written": 0, "l3_deleted_rejected": 0,
                         **{f"l3_rejected_{r}": 0 for r in REJECT_REASONS}}
        self._lock = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="nibble-tiers", daemon=True)
        self._thread.start()

    def submit(self, *job) -> None:
        with self._lock:
            self._pending += 1
        self.jobs.put(job)

    def busy(self) -> bool:
        """True while any submitted job has not finished."""
        with self._lock:
            return self._pending > 0

    def close(self) -> None:
        self.jobs.put(("stop",))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            kind = job[0]
            if kind == "stop":
                return
            try:
                getattr(self, f"_{kind}")(*job[1:])
            except Exception:  # noqa: BLE001 - a tier fault must never stop serving
                log.exception("tier job %s failed", kind)
                if kind == "backup":
                    self.done.put(("backup", job[1]))
                elif kind == "fetch":
                    job[2].done = True
            finally:
                with self._lock:
                    self._pending -= 1

    def _emit(self, kind: str, tier: str, keys: list[bytes]) -> None:
        if self.events is not None:
            self.events.emit(kind, tier, keys)

    def _backup(self, job_id: int, pairs: list[tuple[int, bytes]]) -> None:
        """Copy pinned L1 pages into L2 slots, then write them to L3."""
        written = []
        for page, key in pairs:
            slot = self.host.reserve(key)
            if slot is None:
                continue
            if self.journal is not None:
                self.journal.append(("put", slot, page, key, self.storage is not None))
            self.host.data[slot].copy_(self.pool_pages[page])
            self.host.commit(key)
            written.append((key, slot))
        self.counters["l2_written"] += len(written)
        self._emit("stored", "l2", [k for k, _ in written])
        self.done.put(("backup", job_id))
        if self.storage is not None and written:
            header = self.header_fn()
            items = [(k, self.record_key(k), s) for k, s in written]
            self._persist([(k, r, encode_page(header, self.host.data[s], key=r,
                                              secret=self.secret)) for k, r, s in items])

    def _persist(self, items: list[tuple[bytes, bytes, bytes]]) -> None:
        """Write ``(content key, record key, record)`` items; events name the content key."""
        for i in range(0, len(items), BATCH):
            chunk = items[i:i + BATCH]
            stored = self.storage.put_batch([(r, v) for _, r, v in chunk])
            if stored == len(chunk):
                self._emit("stored", "l3", [k for k, _, _ in chunk])
            self.counters["l3_written"] += stored
            self.counters["l3_write_failed"] += len(chunk) - stored
            self.counters["l3_bytes_written"] += sum(len(v) for _, _, v in chunk[:stored])

    def _fetch(self, request_id: str, pf: Prefetch) -> None:
        """Read a run of keys from L3 into L2, stopping at the first miss or rejected record."""
        header = self.header_fn()
        for i in range(0, len(pf.keys), BATCH):
            keys = pf.keys[i:i + BATCH]
            t0 = time.perf_counter()
            rkeys = [self.record_key(k) for k in keys]
            blobs = self.storage.get_batch(rkeys)
            dt = time.perf_counter() - t0
            nbytes = sum(len(b) for b in blobs if b)
            if nbytes and dt > 0:
                bw = nbytes / dt
                self.l3_bytes_s = bw if not self.l3_bytes_s else 0.7 * self.l3_bytes_s + 0.3 * bw
            self.counters["l3_bytes_read"] += nbytes
            for key, rkey, blob in zip(keys, rkeys, blobs):
                if blob is None:
                    self.counters["l3_miss"] += 1
                    pf.done = True
                    return
                try:
                    payload = decode_page(blob, header, key=rkey, secret=self.secret)
                    check_finite(self.layout, payload, header)
                except PageRecordError as e:
                    self._reject(key, rkey, e)
                    pf.corrupt += 1
                    pf.done = True
                    return
                slot = self.host.reserve(key)
                if slot is not None:
                    # One copy, straight from the record into the pinned slot.
                    self.host.data[slot].view(-1).numpy()[:] = np.frombuffer(payload, np.uint8)
                    if self.journal is None:
                        self.host.commit(key)
                    else:
                        self.journal.append(("fetch", slot, key))
                    self._emit("stored", "l2", [key])
                pf.loaded.add(key)
                self.counters["l3_read"] += 1
        pf.done = True

    def _reject(self, key: bytes, rkey: bytes, err: PageRecordError) -> None:
        """Count a refused L3 record (``rkey``, of content ``key``) and delete it (best
        effort) unless it is merely stale: a stale record is genuine, for another pool
        state, and this pool's write replaces it."""
        log.warning("rejected an L3 page record (%s): %s; recomputing the page", err.reason, err)
        self.counters["l3_corrupt"] += 1
        self.counters[f"l3_rejected_{err.reason}"] += 1
        if err.reason != "stale" and self.storage.delete_batch([rkey]):
            self.counters["l3_deleted_rejected"] += 1
            self._emit("removed", "l3", [key])
