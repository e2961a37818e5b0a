"""RadixCache: exact page ids through insert, match, split, lock, lazy LRU evict, flush."""

import pytest

from nibble.kernels import PageLayout
from nibble.tiering import KVPool
from nibble.tiering.radix_cache import PrefixMatch, RadixCache

PS = 4


def run(*chunks: int) -> list[int]:
    """Tokens of page-sized chunks: chunk c is ``[100c, 100c+1, 100c+2, 100c+3]``."""
    return [100 * c + i for c in chunks for i in range(PS)]


A, B, C, D, E, X = 1, 2, 3, 4, 5, 9


def make_pool(num_pages: int = 12) -> KVPool:
    layout = PageLayout("bf16", num_layers=1, num_kv_heads=1, head_dim=16, page_size=PS)
    return KVPool(layout, num_pages)


def runs(cache: RadixCache, namespace: str = "") -> list[tuple[tuple[int, ...], list[int]]]:
    return sorted(cache.iter_runs(namespace))


def test_insert_then_match():
    cache = RadixCache(PS)
    assert cache.insert(run(A, B, C), [5, 6, 7]) == 0
    assert cache.match(run(A, B, C, D) + [1, 2]) == PrefixMatch([5, 6, 7], 12)
    assert cache.match(run(A, B, C)) == PrefixMatch([5, 6, 7], 12)
    # Partial inside the node, max_pages cap, a non-aligned tail, a miss.
    assert cache.match(run(A, B, X)) == PrefixMatch([5, 6], 8)
    assert cache.match(run(A, B, C), max_pages=1) == PrefixMatch([5], 4)
    assert cache.match(run(A, B, C), max_pages=(12 - 1) // PS) == PrefixMatch([5, 6], 8)
    assert cache.match(run(A, B, C), max_pages=0) == PrefixMatch([], 0)
    assert cache.match(run(A, B) + run(C)[:3]) == PrefixMatch([5, 6], 8)
    assert cache.match(run(A)[:3]) == PrefixMatch([], 0)
    assert cache.match(run(X, A, B)) == PrefixMatch([], 0)
    assert cache.match([]) == PrefixMatch([], 0)
    # A token differing inside the first page is a miss.
    assert cache.match([100, 101, 102, 999] + run(B)) == PrefixMatch([], 0)
    assert cache.num_cached_pages == 3 and all(cache.is_cached(p) for p in (5, 6, 7))
    assert not cache.is_cached(4)


def test_namespaces_are_isolated():
    cache = RadixCache(PS)
    cache.insert(run(A, B), [1, 2], namespace="tenant-a")
    assert cache.match(run(A, B)) == PrefixMatch([], 0)
    assert cache.match(run(A, B), namespace="tenant-b") == PrefixMatch([], 0)
    assert cache.match(run(A, B), namespace="tenant-a") == PrefixMatch([1, 2], 8)
    assert cache.insert(run(A, B), [3, 4], namespace="tenant-b") == 0
    assert cache.match(run(A, B), namespace="tenant-b").pages == [3, 4]
    assert cache.match(run(A, B), namespace="tenant-a").pages == [1, 2]
    assert cache.namespaces() == ["tenant-a", "tenant-b"]
    cache.evict_page(1)
    assert cache.namespaces() == ["tenant-b"]


def test_split_at_page_boundary_keeps_pages_and_children():
    cache = RadixCache(PS)
    cache.insert(run(A, B, C, E), [1, 2, 3, 5])
    assert runs(cache) == [(tuple(run(A, B, C, E)), [1, 2, 3, 5])]  # one node
    # The caller matched A B (pages 1, 2) and computed D into page 4.
    assert cache.insert(run(A, B, D), [1, 2, 4]) == 2
    assert runs(cache) == [
        (tuple(run(A, B)), [1, 2]),
        (tuple(run(A, B, C, E)), [1, 2, 3, 5]),
        (tuple(run(A, B, D)), [1, 2, 4]),
    ]
    assert cache.match(run(A, B, C, E)).pages == [1, 2, 3, 5]
    assert cache.match(run(A, B, D)).pages == [1, 2, 4]
    assert cache.match(run(A, B, E)).pages == [1, 2]
    # Split the lower node again (A B | C | E): its child D-branch is unaffected.
    assert cache.insert(run(A, B, C, A), [1, 2, 3, 6]) == 3
    assert cache.match(run(A, B, C, E)).pages == [1, 2, 3, 5]
    assert cache.match(run(A, B, C, A)).pages == [1, 2, 3, 6]
    assert cache.num_cached_pages == 6
    # Evicting the split-off middle page drops both branches below it, not D.
    assert sorted(cache.evict_page(3)) == [3, 5, 6]
    assert runs(cache) == [(tuple(run(A, B)), [1, 2]), (tuple(run(A, B, D)), [1, 2, 4])]


def test_incremental_insert_grows_one_leaf():
    cache = RadixCache(PS)
    for k in range(1, 5):
        assert cache.insert(run(A, B, C, D)[:k * PS], [1, 2, 3, 4][:k]) == k - 1
    assert runs(cache) == [(tuple(run(A, B, C, D)), [1, 2, 3, 4])]
    cache.node_visits = 0
    assert cache.match(run(A, B, C, D)).pages == [1, 2, 3, 4]
    assert cache.node_visits == 1


def test_duplicate_insert_keeps_first_pages():
    cache = RadixCache(PS)
    assert cache.insert(run(A, B, C), [1, 2, 3]) == 0
    assert cache.insert(run(A, B, C), [1, 2, 3]) == 3  # idempotent
    assert cache.insert(run(A, B, C), [7, 8, 9]) == 3
    assert cache.insert(run(A, B), [7, 8]) == 2  # ends inside a node: no split
    assert cache.match(run(A, B, C)).pages == [1, 2, 3]
    assert not any(cache.is_cached(p) for p in (7, 8, 9))
    assert cache.insert(run(A, B, C, D), [7, 8, 9, 10]) == 3
    assert cache.match(run(A, B, C, D)).pages == [1, 2, 3, 10]
    assert cache.num_cached_pages == 4 and not cache.is_cached(9)
    assert runs(cache) == [(tuple(run(A, B, C, D)), [1, 2, 3, 10])]


def test_insert_rejects_bad_input():
    cache = RadixCache(PS)
    with pytest.raises(ValueError):
        cache.insert(run(A, B)[:-1], [1, 2])
    with pytest.raises(ValueError):
        cache.insert(run(A), [1, 2])
    cache.insert(run(A, B), [1, 2])
    with pytest.raises(ValueError):
        cache.insert(run(X), [2])  # page 2 already holds A B's second chunk
    with pytest.raises(ValueError):
        cache.insert(run(X, E), [5, 5])
    assert cache.insert([], []) == 0
    assert runs(cache) == [(tuple(run(A, B)), [1, 2])] and cache.num_cached_pages == 2
    with pytest.raises(ValueError):
        RadixCache(8, make_pool())


def test_lock_unlock_through_the_allocator():
    pool = make_pool()
    alloc = pool.allocator
    cache = RadixCache(PS, pool)
    seq = pool.allocate(3)
    assert seq == [0, 1, 2]
    cache.insert(run(A, B, C), seq)
    pool.free(list(reversed(seq)))
    assert alloc.free_list() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 1, 0]
    hit = cache.match(run(A, B, C, D))
    assert hit.pages == [0, 1, 2] and [alloc.refcount(p) for p in hit.pages] == [0, 0, 0]
    cache.lock(hit.pages)
    assert [alloc.refcount(p) for p in hit.pages] == [1, 1, 1]
    assert alloc.free_list() == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    cache.lock(hit.pages[:1])  # a second reader of the first page
    cache.unlock(list(reversed(hit.pages)))
    assert alloc.free_list() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 1]
    assert alloc.refcount(0) == 1
    cache.unlock([0])
    assert alloc.free_list()[-3:] == [2, 1, 0]
    assert cache.num_cached_pages == 3  # refcounts never touch the tree
    with pytest.raises(RuntimeError):
        RadixCache(PS).lock([0])


def test_lazy_lru_eviction_through_pool_allocate():
    pool = make_pool()
    alloc = pool.allocator
    events = []
    cache = RadixCache(PS, pool, events=lambda *e: events.append(e))
    s1, s2 = pool.allocate(3), pool.allocate(3)
    assert (s1, s2) == ([0, 1, 2], [3, 4, 5])
    cache.insert(run(A, B, C), s1)
    cache.insert(run(X, B, C), s2, namespace="t")
    pool.free(list(reversed(s1)))  # s1 released first: least recently used
    pool.free(list(reversed(s2)))
    assert alloc.free_list() == [6, 7, 8, 9, 10, 11, 2, 1, 0, 5, 4, 3]
    events.clear()
    assert pool.allocate(6) == [6, 7, 8, 9, 10, 11]  # never-used pages first
    assert cache.num_cached_pages == 6 and events == []
    assert pool.allocate(1) == [2]  # then s1's deepest page
    assert events == [("removed", "", [2])]
    assert cache.match(run(A, B, C)).pages == [0, 1]
    assert pool.allocate(2) == [1, 0]
    assert cache.match(run(A, B, C)).pages == [] and cache.namespaces() == ["t"]
    assert cache.match(run(X, B, C), namespace="t").pages == [3, 4, 5]
    assert events[1:] == [("removed", "", [1]), ("removed", "", [0])]


def test_evicting_a_page_drops_its_descendants_and_keeps_refcounts():
    pool = make_pool()
    alloc = pool.allocator
    cache = RadixCache(PS, pool)
    seq = pool.allocate(3)
    cache.insert(run(A, B, C), seq)
    other = pool.allocate(1)  # [3]: a request that matched A B and added D
    cache.lock(seq[:2])
    cache.insert(run(A, B, D), seq[:2] + other)
    alloc.incref([2])  # page 2 is also held elsewhere (e.g. being copied)
    pool.free(seq)  # prefix first: [0, 1, 2] -> refcounts 1, 1, 1
    cache.unlock(seq[:2])  # now 0, 0 and page 2 still 1
    assert alloc.free_list() == list(range(4, 12)) + [0, 1]
    assert pool.allocate(8) == list(range(4, 12))
    assert pool.allocate(1) == [0]  # the root page: everything below it goes
    assert cache.num_cached_pages == 0 and cache.namespaces() == []
    assert alloc.refcount(2) == 1 and alloc.refcount(3) == 1  # uncached, still held
    assert alloc.free_list() == [1]  # a plain free page now
    assert pool.allocate(1) == [1]
    # Direct eviction in the middle of a node keeps the part before it.
    cache.insert(run(A, B, C), [0, 1, 2])
    assert cache.evict_page(1) == [1, 2]
    assert runs(cache) == [(tuple(run(A)), [0])]
    assert cache.evict_page(7) == []  # not cached: nothing happens
    assert [alloc.refcount(p) for p in (0, 1, 2)] == [1, 1, 1]


def test_match_and_evict_touch_only_their_path():
    cache = RadixCache(PS)
    width = 2000
    page = iter(range(10**6))
    cache.insert(run(A, 10), [next(page), next(page)])
    for i in range(11, 10 + width):
        cache.insert(run(A, i), [0, next(page)])  # siblings under the shared A node
    chain = run(*range(10000, 10000 + 1000))
    chain_pages = [next(page) for _ in range(1000)]
    cache.insert(chain, chain_pages, namespace="deep")
    for k in range(1, 1000):  # branch off at every page: a 1000-node-deep path
        cache.insert(chain[:k * PS] + run(20000 + k), chain_pages[:k] + [next(page)], "deep")
    assert cache.num_cached_pages == 1 + width + 1000 + 999

    cache.node_visits = 0
    assert cache.match(run(A, 1234, X)).pages == [0, 1 + 1234 - 10]
    assert cache.node_visits == 2
    cache.node_visits = 0
    assert cache.match(run(A, 5)).pages == [0] and cache.node_visits == 1
    cache.node_visits = 0
    assert cache.match(chain[:3 * PS] + run(20003), namespace="deep").pages == chain_pages[:3] + [
        chain_pages[-1] + 3]
    assert cache.node_visits == 4
    cache.node_visits = 0
    assert cache.match(chain, namespace="deep").pages == chain_pages
    assert cache.node_visits == 1000
    cache.node_visits = 0
    assert cache.evict_page(1 + 1500 - 10) == [1 + 1500 - 10]  # one leaf
    assert cache.node_visits == 1
    cache.node_visits = 0
    # Chain nodes 500..999 and the branches hanging under nodes 500..998.
    assert len(cache.evict_page(chain_pages[500])) == 500 + 499
    assert cache.node_visits == 500 + 499
    assert cache.match(chain, namespace="deep").pages == chain_pages[:500]


def test_flush_forgets_everything():
    pool = make_pool()
    events = []
    cache = RadixCache(PS, pool, events=lambda *e: events.append(e))
    seq = pool.allocate(3)
    cache.insert(run(A, B), seq[:2])
    cache.insert(run(C), [seq[2]], namespace="t")
    assert events == [("stored", "", [0, 1]), ("stored", "t", [2])]
    pool.free(seq)
    cache.flush()
    assert cache.num_cached_pages == 0 and cache.namespaces() == []
    assert cache.match(run(A, B)).pages == [] and list(cache.iter_runs()) == []
    assert sorted(events[2:]) == [("removed", "", [0, 1]), ("removed", "t", [2])]
    assert pool.allocator.num_free == 12
    events.clear()
    assert pool.allocate(12) == list(range(3, 12)) + [0, 1, 2]
    assert events == []
