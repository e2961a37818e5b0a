"""KVCacheManager: each operation with exact page ids."""

from __future__ import annotations

import pytest

from nibble.kernels import PageLayout
from nibble.tiering import KVPool
from nibble.tiering.errors import CacheIntegrityError
from nibble.tiering.host_pool import HostPool
from nibble.tiering.kv_cache_manager import KVCacheManager
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.secret import KVSecret
from nibble.tiering.tier_manager import TierManager, TierPolicy

from .test_kv_cache_manager_state import PS, Req

LAYOUT = PageLayout("bf16", num_layers=1, num_kv_heads=1, head_dim=16, page_size=PS)
PROMPT = list(range(1, 14))            # 13 tokens: 3 full pages reusable at most


def manager(num_pages=8, tiers=None):
    pool = KVPool(LAYOUT, num_pages)
    cache = RadixCache(PS, pool)
    tm = None
    if tiers is not None:
        tm = TierManager(pool, cache, "m", HostPool(LAYOUT, 8), None, tiers,
                         secret=KVSecret.generate())
    return KVCacheManager(pool, cache, tm)


def run_once(kv, rid="a", tokens=PROMPT):
    """Admit, compute the whole prompt, commit, release."""
    req = Req(rid, list(tokens))
    h = kv.admit(req, kv.match(req), 64, headroom=0, future=0)
    kv.commit(h, req.token_ids)
    kv.release(h)
    return h


def test_admit_locks_the_hit_and_takes_pages_for_the_first_chunk():
    kv = manager()
    run_once(kv)
    req = Req("b", PROMPT + [99])
    hit = kv.match(req)
    assert hit.pages == (0, 1, 2) and hit.limit == 3
    h = kv.admit(req, hit, 2, headroom=0, future=0)
    assert h.pages == (0, 1, 2, 4) and h.from_l1 == 3 and h.num_shared == 3
    assert [kv.pool.allocator.refcount(p) for p in h.pages] == [1, 1, 1, 1]
    assert kv.grow(h, 17) and h.num_pages == 5 and not kv.grow(h, 100)
    kv.check_integrity()
    kv.release(h)
    assert kv.num_free == 8
    kv.check_integrity()


def test_a_refused_admission_holds_nothing():
    kv = manager(num_pages=4)
    req = Req("a", PROMPT)
    assert kv.admit(req, kv.match(req), 64, headroom=1, future=0) is None   # 4 pages, 3 free
    assert kv.admit(req, kv.match(req), 64, headroom=0, future=1) is None
    assert kv.num_free == 4 and not kv._handles
    kv.check_integrity()


def test_commit_shares_full_pages_and_release_frees_tail_first():
    kv = manager()
    h = run_once(kv)
    assert h.num_pages == 0 and not h.live
    assert kv.num_cached_pages == 3
    assert kv.pool.allocator.free_list()[-4:] == [3, 2, 1, 0]


def test_drop_forgets_the_pages_in_l1_and_l2():
    kv = manager(tiers=TierPolicy())
    run_once(kv)
    assert kv.tiers.drain() and len(kv.tiers.host) == 3
    req = Req("b", PROMPT)
    h = kv.admit(req, kv.match(req), 64, headroom=0, future=0)
    assert kv.drop(h) == [0, 1, 2]
    assert kv.match(req).pages == () and len(kv.tiers.host) == 0
    kv.check_integrity()
    kv.release(h)
    kv.close()


def test_evict_is_explicit_and_writes_back_first():
    kv = manager(tiers=TierPolicy(write_policy="write_back"))
    run_once(kv)
    assert len(kv.tiers.host) == 0                       # write_back: nothing until evicted
    assert kv.evict(1) == [2]                           # the least recently released page
    assert len(kv.tiers.host) == 1                      # ... written back as it left L1
    assert kv.evict(8) == [1, 0]
    assert kv.num_cached_pages == 0 and len(kv.tiers.host) == 3
    req = Req("b", PROMPT)
    h = kv.admit(req, kv.match(req), 64, headroom=0, future=0)
    assert h.from_l1 == 0 and h.from_l2 == 3 and kv.num_cached_pages == 3   # loaded, inserted
    kv.check_integrity()
    kv.release(h)
    kv.close()


def test_reuse_through_the_pool_evicts_in_one_place():
    kv = manager(num_pages=4, tiers=TierPolicy(write_policy="write_back"))
    run_once(kv)
    req = Req("b", list(range(50, 66)))                  # 16 tokens: every page
    h = kv.admit(req, kv.match(req), 64, headroom=0, future=0)
    assert h is not None and kv.num_cached_pages == 0 and len(kv.tiers.host) == 3
    kv.check_integrity()
    kv.release(h)
    kv.close()


def test_reserve_takes_the_whole_prompt_without_loading():
    kv = manager(tiers=TierPolicy())
    run_once(kv)
    req = Req("r", PROMPT + [7, 7, 7])
    h = kv.reserve(req, kv.match(req), headroom=0, future=0)
    assert h.from_l1 == 3 and h.num_pages == 4 and h.from_l2 == 0
    kv.release(h)
    kv.close()


def test_check_integrity_finds_a_leaked_reference():
    kv = manager()
    run_once(kv)
    kv.pool.allocator.incref([1])
    with pytest.raises(CacheIntegrityError, match="page 1: refcount 1, 0 holders"):
        kv.check_integrity()


def test_check_integrity_finds_a_broken_tree_and_free_list():
    kv = manager()
    run_once(kv)
    kv.cache._node_of.pop(1)
    with pytest.raises(CacheIntegrityError, match="radix tree"):
        kv.check_integrity()
    kv = manager()
    kv.pool.allocator._num_free -= 1
    with pytest.raises(CacheIntegrityError, match="allocator"):
        kv.check_integrity()
