"""KVCacheManager as a state machine: random admit/grow/commit/release/preempt/requeue/
drop/evict/flush/reserve sequences, with the cache and tiers off and on, and
``check_integrity`` after every step."""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nibble.kernels import PageLayout
from nibble.tiering import KVPool
from nibble.tiering.host_pool import HostPool
from nibble.tiering.kv_cache_manager import Handle, KVCacheManager
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.secret import KVSecret
from nibble.tiering.storage.file_backend import FileStorage
from nibble.tiering.tier_manager import TierManager, TierPolicy

PS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]


@dataclass
class Req:
    request_id: str
    token_ids: list[int]
    namespace: str = ""
    no_reuse: bool = False


@dataclass
class Running:
    req: Req
    handle: Handle
    computed: int


class ManagerMachine(RuleBasedStateMachine):
    """Subclasses pick the cache parts (``make``)."""

    def __init__(self):
        super().__init__()
        self.layout = PageLayout("bf16", num_layers=1, num_kv_heads=1, head_dim=16, page_size=PS)
        self.pool = KVPool(self.layout, 12)
        self.kv = self.make()
        self.running: list[Running] = []
        self.waiting: list[Req] = []
        self.ids = 0

    def make(self) -> KVCacheManager:
        raise NotImplementedError

    def teardown(self):
        self.kv.close()

    def _request(self, prefix: int, extra: list[int], ns: str) -> Req:
        self.ids += 1
        return Req(f"r{self.ids}", PREFIXES[prefix] + extra, ns)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1),
          extra=st.lists(st.integers(30, 33), min_size=1, max_size=9),
          ns=st.sampled_from(["", "t"]), step=st.integers(1, 12))
    def admit(self, prefix, extra, ns, step):
        self._admit(self._request(prefix, extra, ns), step)

    def _admit(self, req: Req, step: int) -> None:
        hit = self.kv.match(req)
        assert hit.num_pages <= hit.limit == (len(req.token_ids) - 1) // PS
        if not self.kv.ready(req, hit):
            self.kv.cancel(req)
            return
        free = self.kv.num_free
        h = self.kv.admit(req, hit, step, headroom=0, future=0)
        if h is None:
            assert self.kv.num_free <= free + hit.num_pages   # nothing kept but what loaded
            return
        assert h.pages[:hit.num_pages] == hit.pages and h.num_reused * PS < len(req.token_ids)
        self.running.append(Running(req, h, h.num_reused * PS))

    @precondition(lambda self: self.waiting)
    @rule(step=st.integers(1, 12))
    def admit_waiting(self, step):
        self._admit(self.waiting.pop(0), step)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 63), n=st.integers(1, 9))
    def grow_and_compute(self, i, n):
        r = self.running[i % len(self.running)]
        if self.kv.grow(r.handle, r.computed + n):
            assert r.handle.num_pages * PS >= r.computed + n
            r.computed += n
            while len(r.req.token_ids) < r.computed + 1:      # decode: sampled tokens
                r.req.token_ids.append(40 + len(r.req.token_ids) % 3)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 63))
    def commit(self, i):
        r = self.running[i % len(self.running)]
        self.kv.commit(r.handle, r.req.token_ids[:r.computed])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 63), cache=st.booleans())
    def release(self, i, cache):
        r = self.running.pop(i % len(self.running))
        if cache:
            self.kv.commit(r.handle, r.req.token_ids[:r.computed])
        self.kv.release(r.handle)
        assert not r.handle.live and r.handle.num_pages == 0

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 63))
    def preempt(self, i):
        r = self.running.pop(i % len(self.running))
        self.kv.commit(r.handle, r.req.token_ids[:r.computed])
        self.kv.release(r.handle)
        self.waiting.append(r.req)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 63))
    def fault(self, i):
        """A failed step: drop the pages from the cache, requeue without reuse."""
        r = self.running.pop(i % len(self.running))
        dropped = self.kv.drop(r.handle)
        if self.kv.cache is not None:
            assert not any(self.kv.cache.is_cached(p) for p in dropped)
        self.kv.release(r.handle)
        r.req.no_reuse = True
        self.waiting.append(r.req)

    @rule(n=st.integers(1, 12))
    def evict(self, n):
        dropped = self.kv.evict(n)
        if self.kv.cache is not None:
            assert not any(self.kv.cache.is_cached(p) for p in dropped)

    @rule()
    def flush(self):
        self.kv.flush()
        assert self.kv.num_cached_pages == 0

    @rule(prefix=st.integers(0, len(PREFIXES) - 1),
          extra=st.lists(st.integers(30, 33), min_size=1, max_size=6))
    def reserve_and_install(self, prefix, extra):
        """Disaggregated decode: pages for the whole prompt, filled, then run."""
        req = self._request(prefix, extra, "")
        hit = self.kv.match(req)
        free = [p for p in self.pool.allocator.free_list() if p not in hit.pages]
        h = self.kv.reserve(req, hit, headroom=0, future=0)
        if h is not None:
            assert h.num_pages * PS >= len(req.token_ids)
            self._check_runs(list(h.pages[hit.num_pages:]), free, self.kv.reserve_slack)
            self.kv.commit(h, req.token_ids)
            self.running.append(Running(req, h, len(req.token_ids)))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 63), n=st.integers(1, 9), slack=st.sampled_from([1.0, 1.5, 3.0]))
    def grow_in_runs(self, i, n, slack):
        """A grow with an explicit run window: ascending pages from the LRU window only."""
        r = self.running[i % len(self.running)]
        free, before = self.pool.allocator.free_list(), r.handle.num_pages
        if self.kv.grow(r.handle, r.computed + n, slack=slack):
            self._check_runs(list(r.handle.pages[before:]), free, slack)
            r.computed += n
            while len(r.req.token_ids) < r.computed + 1:
                r.req.token_ids.append(40 + len(r.req.token_ids) % 3)

    @staticmethod
    def _check_runs(new: list, free: list, slack) -> None:
        """``new`` pages came ascending from the run window of the free list ``free``."""
        if slack is None or not new:
            return
        window = free[:max(len(new), math.ceil(len(new) * slack))]
        assert new == sorted(new) and set(new) <= set(window), (new, window)

    @rule()
    def poll(self):
        self.kv.poll()

    @invariant()
    def consistent(self):
        self.kv.check_integrity()


SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None)


class NoCache(ManagerMachine):
    def make(self):
        return KVCacheManager(self.pool)


class L1Only(ManagerMachine):
    def make(self):
        return KVCacheManager(self.pool, RadixCache(PS, self.pool))


class L1FreeListOrder(ManagerMachine):
    """Grow in the free list's order, reserve with a wide run window."""

    def make(self):
        return KVCacheManager(self.pool, RadixCache(PS, self.pool), grow_slack=None,
                              reserve_slack=4.0)


class WithTiers(ManagerMachine):
    policy = TierPolicy()
    storage = False

    def make(self):
        cache = RadixCache(PS, self.pool)
        self.tmp = tempfile.mkdtemp() if self.storage else None
        store = FileStorage(self.tmp, max_bytes=1 << 20) if self.storage else None
        tiers = TierManager(self.pool, cache, "m", HostPool(self.layout, 6), store, self.policy,
                            secret=KVSecret.generate())
        return KVCacheManager(self.pool, cache, tiers)

    def teardown(self):
        super().teardown()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


class WriteBack(WithTiers):
    policy = TierPolicy(write_policy="write_back")


class WithL3(WithTiers):
    policy = TierPolicy(prefetch_policy="timeout", prefetch_timeout_s=0.0,
                        assumed_prefill_tok_s=1.0)
    storage = True



def _case(machine):
    case = machine.TestCase
    case.settings = SETTINGS
    return case


TestNoCache = _case(NoCache)
TestL1Only = _case(L1Only)
TestL1FreeListOrder = _case(L1FreeListOrder)
TestWithTiers = _case(WithTiers)
TestWriteBack = _case(WriteBack)
TestWithL3 = _case(WithL3)
