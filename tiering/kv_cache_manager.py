"""KVCacheManager: the one interface of the KV cache (pool, allocator, radix tree, tiers).

The scheduler and the disaggregation connector call only this; they see
handles, never the tree or the allocator. A request's pages live in a
``Handle``: its ``pages`` (read-only) are the block table, and every
reference the handle holds is one refcount in the allocator.

Operations (engine thread only):

* ``match(request) -> Hit``: the longest cached L1 prefix (no refcount taken).
* ``ready(request, hit)``: starts an L3 -> L2 prefetch once; False while the
  request should wait for it (prefetch policy).
* ``admit(request, hit, ...) -> Handle | None``: lock the hit, load the run that
  follows from L2 (inserting it into the tree), check the room the scheduler
  asks for and take pages for the first chunk; None (nothing held) if short.
* ``grow(handle, num_tokens)``, ``commit(handle, tokens)`` (offer computed
  full pages to the tree and the tiers), ``release(handle)``.
* ``drop(handle)``: a fault; forget its cached pages in L1 and L2.
* ``reserve(request, hit, ...)``: pages for a whole prompt, for a peer to fill.
* ``evict(n)``, ``flush()``, ``poll()``, ``stats()``, ``check_integrity()``.

Page order: ``grow`` takes the pages ``allocate`` would, sorted ascending
(``grow_slack`` 1; None keeps the free list's order), and ``reserve`` looks
``reserve_slack`` times further down the LRU order for longer runs of
consecutive ids, so a transfer between two workers moves few runs
(``page_runs.merge_runs``) instead of one copy or descriptor per page.

Eviction is explicit: this manager owns the pool's one reuse hook
(``_before_reuse``), so every page the pool hands out first leaves the tree
(with what hangs below it) and then the tier manager writes back what its
policy keeps, in that order. ``evict`` does the same ahead of time.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, Sequence

from .allocator import PageId
from .errors import CacheIntegrityError
from .kv_pool import KVPool
from .radix_cache import RadixCache
from .tier_manager import TierManager


class CacheRequest(Protocol):
    """What the manager reads of a request (the engine's ``Sequence`` is one)."""

    request_id: str
    token_ids: list[int]
    namespace: str
    no_reuse: bool


@dataclass(frozen=True)
class Hit:
    """A request's cached L1 prefix: ``pages`` (unlocked) and ``limit``, the most pages
    it may reuse (one token is always left to compute)."""

    pages: tuple[PageId, ...] = ()
    limit: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class Handle:
    """The pages one request (or reservation) holds, one reference each.

    ``pages[i]`` holds tokens ``i*page_size .. (i+1)*page_size-1``. The first
    ``num_shared`` pages came from the cache or were committed to it; the rest
    are private to this handle. ``from_l1/l2/l3``: pages the admission reused
    from each tier.
    """

    __slots__ = ("request_id", "namespace", "_pages", "num_shared", "from_l1", "from_l2",
                 "from_l3", "live")

    def __init__(self, request_id: str, namespace: str):
        self.request_id, self.namespace = request_id, namespace
        self._pages: list[PageId] = []
        self.num_shared = self.from_l1 = self.from_l2 = self.from_l3 = 0
        self.live = True

    @property
    def pages(self) -> tuple[PageId, ...]:
        return tuple(self._pages)

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def num_reused(self) -> int:
        """Pages the admission took from the cache (L1 hit + L2/L3 load)."""
        return self.from_l1 + self.from_l2 + self.from_l3

    def __repr__(self) -> str:
        return f"Handle({self.request_id!r}, {self.num_pages} pages, shared {self.num_shared})"


class KVCacheManager:
    """See the module docstring. ``cache`` None: no prefix reuse; ``tiers`` None: L1 only
    (``tiers`` needs ``cache``). ``grow_slack`` / ``reserve_slack``: the allocator's
    run window for ``grow`` and ``reserve`` (``PageAllocator.allocate_runs``; None:
    the free list's order)."""

    def __init__(self, pool: KVPool, cache: RadixCache | None = None,
                 tiers: TierManager | None = None, *, grow_slack: float | None = 1.0,
                 reserve_slack: float | None = 2.0):
        self.pool, self.cache, self.tiers = pool, cache, tiers
        self.grow_slack, self.reserve_slack = grow_slack, reserve_slack
        self.page_size = pool.layout.page_size
        self._handles: set[Handle] = set()
        pool.set_reuse_hook(self._before_reuse)

    # ---- capacity ----
    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out now (cached free pages included)."""
        return self.pool.allocator.num_free

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_cached_pages if self.cache is not None else 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- admission ----
    def match(self, request: CacheRequest) -> Hit:
        """Longest cached prefix of ``request`` (none with ``no_reuse`` or no cache)."""
        limit = (len(request.token_ids) - 1) // self.page_size
        if self.cache is None or request.no_reuse:
            return Hit((), limit)
        m = self.cache.match(request.token_ids, request.namespace, max_pages=limit)
        return Hit(tuple(m.pages), limit)

    def ready(self, request: CacheRequest, hit: Hit) -> bool:
        """May ``request`` be admitted now? Starts its L3 prefetch on the first call."""
        if self.tiers is None or self.cache is None or request.no_reuse:
            return True
        return self.tiers.prepare(request.request_id, request.namespace, request.token_ids,
                                  hit.num_pages, hit.limit)

    def admit(self, request: CacheRequest, hit: Hit, max_step_tokens: int, *,
              headroom: float, future: float, load: bool = True,
              slack: float | None = -1) -> Handle | None:
        """Lock ``hit``, load what follows from L2 (``load``), then take pages for the first
        ``min(uncached tokens, max_step_tokens)`` tokens.

        ``headroom``: pages the running requests may still claim; ``future``: pages this
        request may claim after its prompt (both as the scheduler counts them). ``slack``:
        the run window of the new pages (default ``grow_slack``). Refused
        (None, nothing held; loaded pages stay cached) unless the free pages minus
        ``headroom`` cover the rest of the prompt plus ``future``.
        """
        handle = Handle(request.request_id, request.namespace)
        self._handles.add(handle)
        if hit.pages:
            self.pool.allocator.incref(hit.pages)
            handle._pages.extend(hit.pages)
            handle.from_l1 = hit.num_pages
            if self.tiers is not None and load:
                self.tiers.note_hits(list(hit.pages))
        if load and self.tiers is not None and not request.no_reuse:
            self._load(request, handle, hit, int(self.num_free - headroom))
        handle.num_shared = handle.num_pages
        tokens = len(request.token_ids)
        cached = handle.num_pages * self.page_size
        rest = max(0, self.pages_for(tokens) - handle.num_pages)
        if rest + future > self.num_free - headroom or \
                not self.grow(handle, cached + min(tokens - cached, max_step_tokens),
                              slack=slack):
            self.release(handle)
            return None
        return handle

    def _load(self, request: CacheRequest, handle: Handle, hit: Hit, room: int) -> None:
        got = self.tiers.load(request.request_id, request.namespace, request.token_ids,
                              hit.num_pages, hit.limit, room, self.pool.allocate)
        if not got.pages:
            return
        handle._pages.extend(got.pages)
        handle.from_l2, handle.from_l3 = got.from_l2, got.from_l3
        n = handle.num_pages
        self.cache.insert(request.token_ids[:n * self.page_size], handle._pages, request.namespace)
        self.tiers.on_loaded(got.pages, got.keys)

    def reserve(self, request: CacheRequest, hit: Hit, *, headroom: float,
                future: float) -> Handle | None:
        """Lock ``hit`` and take pages for the rest of the prompt, for a peer to write
        (disaggregated decode); None when they do not fit now. No tier load. The new pages
        come in ascending runs taken with ``reserve_slack``."""
        return self.admit(request, hit, len(request.token_ids), headroom=headroom,
                          future=future, load=False, slack=self.reserve_slack)

    def cancel(self, request: CacheRequest) -> None:
        """Forget ``request``'s pending prefetch (it left the queue); fetched pages stay in L2."""
        if self.tiers is not None:
            self.tiers.cancel(request.request_id)

    # ---- running ----
    def grow(self, handle: Handle, num_tokens: int, *, slack: float | None = -1) -> bool:
        """Make ``handle`` cover ``num_tokens`` tokens; False (nothing taken) if the pool is
        short. ``slack``: the run window (default ``grow_slack``; None: list order)."""
        need = self.pages_for(num_tokens) - handle.num_pages
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        slack = self.grow_slack if slack == -1 else slack
        handle._pages.extend(self.pool.allocate(need) if slack is None else
                             self.pool.allocate_runs(need, slack))
        return True

    def commit(self, handle: Handle, tokens: Sequence[int]) -> None:
        """Offer the full pages of ``tokens`` (the handle's computed tokens) to the tree and the
        tiers. Chunks already cached keep the tree's page; the handle's stays private."""
        if self.cache is None:
            return
        full = min(len(tokens) // self.page_size, handle.num_pages)
        if not full:
            return
        run, pages = tokens[:full * self.page_size], handle._pages[:full]
        self.cache.insert(run, pages, handle.namespace)
        if self.tiers is not None:
            self.tiers.on_cached(handle.namespace, run, pages)
        handle.num_shared = max(handle.num_shared, full)

    def release(self, handle: Handle) -> None:
        """Drop the handle's references, tail first (its prefix stays cached longest)."""
        if not handle.live:
            return
        self._handles.discard(handle)
        handle.live = False
        if handle._pages:
            self.pool.free(list(reversed(handle._pages)))
            handle._pages = []

    def drop(self, handle: Handle) -> list[PageId]:
        """A step failed on ``handle``'s pages: forget every cached one, and what hangs below
        it, in L1 and L2, so no later request matches them. References are untouched.
        Returns the pages dropped from the tree."""
        dropped: list[PageId] = []
        if self.cache is not None:
            for page in handle._pages:
                dropped += self.cache.evict_page(page)
        if self.tiers is not None and dropped:
            self.tiers.discard(dropped)
        return dropped

    # ---- eviction and background work ----
    def _before_reuse(self, pages: list[PageId]) -> None:
        """The pool's one reuse hook: ``pages`` are being handed out. Drop each cached one,
        with what hangs below it, from the tree; then the tier manager forgets their keys and,
        under write_back, copies them to L2 (their bytes are still intact)."""
        if self.cache is None:
            return
        dropped = [d for p in pages if self.cache.is_cached(p) for d in self.cache.evict_page(p)]
        if self.tiers is not None:
            # The reused pages too: one the tree lost some other way may still be keyed.
            gone = set(dropped)
            self.tiers.before_reuse(dropped + [p for p in pages if p not in gone])

    def evict(self, num_pages: int) -> list[PageId]:
        """Evict up to ``num_pages`` unreferenced cached pages now, least recently released
        first (with what hangs below them); returns the pages that left the tree."""
        if self.cache is None or num_pages <= 0:
            return []
        victims = [p for p in self.pool.allocator.free_list() if self.cache.is_cached(p)]
        dropped = [d for p in victims[:num_pages] if self.cache.is_cached(p)
                   for d in self.cache.evict_page(p)]
        if dropped and self.tiers is not None:
            self.tiers.before_reuse(dropped)
        return dropped

    def flush(self) -> None:
        """Forget the prefix cache and L2 (L3 is storage and stays)."""
        if self.cache is not None:
            self.cache.flush()
        if self.tiers is not None:
            self.tiers.flush()

    def poll(self) -> None:
        """Apply finished tier work (backups give back the L1 pages they pinned)."""
        if self.tiers is not None:
            self.tiers.poll()

    def wait(self, seconds: float) -> None:
        """Only requests waiting for a prefetch are queued: give the tier worker the time."""
        time.sleep(seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step prefilled ``tokens`` in ``seconds`` (the tier cost model's throughput)."""
        if self.tiers is not None:
            self.tiers.observe_prefill(tokens, seconds)

    @property
    def events(self):
        """The tiers' ``KVEventLog``, or None without tiers."""
        return self.tiers.events if self.tiers is not None else None

    def stats(self) -> dict:
        return {"num_pages": self.num_pages, "num_free_pages": self.num_free,
                "num_cached_pages": self.num_cached_pages, "num_handles": len(self._handles),
                "tiers": self.tiers.stats() if self.tiers is not None else None}

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()

    # ---- integrity ----
    def check_integrity(self) -> None:
        """Raise CacheIntegrityError unless the bookkeeping agrees (debug mode, tests):
        the allocator and the tree each hold their invariants; every page's refcount equals
        its holders (live handles, in-flight backups); a page held by two handles sits at
        the same position in both (shared through the tree); private pages (past
        ``num_shared``) are in no other handle and not in the tree. O(pool + tree)."""
        self.pool.allocator.check_integrity()
        cached = set()
        if self.cache is not None:
            self.cache.check_integrity()
            cached = self.cache.cached_pages()
        holders: Counter = Counter()
        position: dict[PageId, int] = {}
        problems = []
        for h in self._handles:
            if len(set(h._pages)) != len(h._pages):
                problems.append(f"{h} repeats a page")
            for i, p in enumerate(h._pages):
                holders[p] += 1
                if position.setdefault(p, i) != i:
                    problems.append(f"page {p} held at positions {position[p]} and {i}")
        for h in self._handles:
            for p in h._pages[h.num_shared:]:
                if holders[p] != 1 or p in cached:
                    problems.append(f"private page {p} of {h} is shared or cached")
        if self.tiers is not None:
            holders.update(self.tiers.pinned_pages())
        alloc = self.pool.allocator
        problems += [f"page {p}: refcount {alloc.refcount(p)}, {holders[p]} holders"
                     for p in range(self.num_pages) if alloc.refcount(p) != holders[p]]
        if problems:
            raise CacheIntegrityError("kv cache manager: " + "; ".join(problems[:8]))
