"""L3 page records under tensor parallelism, one process: each rank's records live under
their own keys with the TP size and rank in the authenticated header; a record of
another TP size or rank never hits, a forged rank is refused, and a page-set hit needs
every rank's record (rank 0 keeps a fetched page out of L2 until the others answer)."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.tiering import KVPool
from nibble.tiering.host_pool import HostPool
from nibble.tiering.kv_cache_manager import KVCacheManager
from nibble.tiering.page_record import PageRecordError, decode_page, record_key
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.secret import KVSecret
from nibble.tiering.storage import FileStorage, RedisStorage
from nibble.tiering.tier_manager import TierManager, TierPolicy
from nibble.tiering.tier_mirror import TierMirror

from .test_kv_cache_manager_state import Req

PS = 4
LAYOUT = PageLayout("bf16", num_layers=2, num_kv_heads=1, head_dim=16, page_size=PS)
PROMPT = list(range(1, 14))            # 3 full pages reusable
SECRET = KVSecret("tp-records-test-secret-0123456789")
POLICY = TierPolicy(write_policy="write_through", prefetch_policy="wait_complete")


def manager(storage, tp, *, peers_fail=False, policy=POLICY):
    """A rank's cache manager over ``storage``; for TP > 1 the followers' answer is
    simulated: they hold every record, or (``peers_fail``) none."""
    pool = KVPool(LAYOUT, 16)
    cache = RadixCache(PS, pool)
    tm = TierManager(pool, cache, "m", HostPool(LAYOUT, 16), storage, policy, secret=SECRET,
                     tp=tp)
    if tp[0] > 1:
        tm.mirror = lambda ops: [op[2] for op in ops if op[0] == "fetch" and peers_fail]
    return KVCacheManager(pool, cache, tm)


def write(kv, seed):
    """Compute PROMPT with random (finite) page bytes, commit, back up to L2 and L3."""
    req = Req("w", list(PROMPT))
    h = kv.admit(req, kv.match(req), 64, headroom=0, future=0)
    g = torch.Generator().manual_seed(seed)
    for p in h.pages:
        kv.pool.pages[p] = torch.randint(0, 0x70, kv.pool.pages[p].shape, generator=g,
                                         dtype=torch.uint8)
    kv.commit(h, req.token_ids)
    written = [kv.pool.pages[p].clone() for p in h.pages[:3]]
    kv.release(h)
    assert kv.tiers.drain()
    return written


def read(kv):
    """A fresh rank asks for PROMPT: prefetch from L3 (waits), admit; the handle."""
    req = Req("r", list(PROMPT))
    hit = kv.match(req)
    assert hit.num_pages == 0
    kv.ready(req, hit)
    assert kv.tiers.drain()
    assert kv.ready(req, hit)
    return kv.admit(req, hit, 64, headroom=0, future=0)


@pytest.fixture(params=["file", pytest.param("redis", marks=pytest.mark.redis)])
def store(request, tmp_path):
    if request.param == "file":
        s = FileStorage(tmp_path / "l3")
    else:                      # the test's own key prefix, removed afterwards
        s = RedisStorage(request.getfixturevalue("redis_url"),
                         prefix=request.getfixturevalue("redis_prefix"))
    yield s
    s.close()


def test_each_rank_writes_its_own_records(store):
    kv0, kv1 = manager(store, (2, 0)), manager(store, (2, 1))
    write(kv0, 0)
    write(kv1, 1)
    keys = kv0.tiers.keys("", PROMPT, 3)
    assert keys == kv1.tiers.keys("", PROMPT, 3)             # the logical key is shared
    for rank in (0, 1):
        assert store.exists_batch([record_key(k, 2, rank, secret=SECRET) for k in keys]) == \
            [True] * 3
    assert store.exists_batch(keys) == [False] * 3          # nothing under the plain key
    assert keys != manager(store, (1, 0)).tiers.keys("", PROMPT, 3)   # TP size in the root
    events, _ = kv0.tiers.events.since(0)                    # events name the content keys
    assert {k for e in events if (e.kind, e.tier) == ("stored", "l3") for k in e.keys} == {k.hex() for k in keys}


def test_a_rank_gets_its_own_pages_back_bit_identical(store):
    written = write(manager(store, (2, 1)), 1)
    write(manager(store, (2, 0)), 0)
    kv = manager(store, (2, 1))
    h = read(kv)
    assert h.from_l3 == 3
    for page, want in zip(h.pages[:3], written):
        assert torch.equal(kv.pool.pages[page], want)


@pytest.mark.parametrize("reader", [(1, 0), (4, 0), (4, 1), (2, 1)])
def test_records_of_another_tp_size_or_rank_never_hit(store, reader):
    write(manager(store, (2, 0)), 0)                         # rank 0 of TP=2 only
    h = read(manager(store, reader))
    assert h.from_l3 == 0 and h.from_l2 == 0                 # recomputed


def test_tp1_records_never_hit_a_tp2_rank(store):
    write(manager(store, (1, 0)), 0)
    assert read(manager(store, (2, 0))).from_l3 == 0


def test_a_page_set_hit_needs_every_rank(store):
    write(manager(store, (2, 0)), 0)
    kv = manager(store, (2, 0), peers_fail=True)             # rank 1 has no records
    h = read(kv)
    assert h.from_l3 == 0
    assert kv.tiers.counters["l3_peer_missing"] >= 1
    assert len(kv.tiers.host) == 0                            # nothing half-held in L2
    assert read(manager(store, (2, 0))).from_l3 == 3          # control: with rank 1, a hit


def _forge(store, fn):
    """Replace rank 0's records of PROMPT with ``fn(rank-1 record)`` under rank 0's keys."""
    keys = manager(store, (2, 0)).tiers.keys("", PROMPT, 3)
    r0 = [record_key(k, 2, 0, secret=SECRET) for k in keys]
    r1 = store.get_batch([record_key(k, 2, 1, secret=SECRET) for k in keys])
    assert store.put_batch([(k, fn(b)) for k, b in zip(r0, r1)]) == 3


def _relabel(blob: bytes) -> bytes:
    assert b'"tp_rank":1' in blob
    return blob.replace(b'"tp_rank":1', b'"tp_rank":0', 1)


@pytest.mark.parametrize("forgery", ["moved", "relabelled"])
def test_a_forged_rank_is_refused(store, forgery):
    write(manager(store, (2, 0)), 0)
    write(manager(store, (2, 1)), 1)
    if forgery == "moved":            # rank 1's genuine record copied onto rank 0's key
        _forge(store, lambda b: b)
    else:                             # and its header edited to claim rank 0
        _forge(store, _relabel)
    kv = manager(store, (2, 0))
    h = read(kv)
    assert h.from_l3 == 0
    assert kv.tiers.stats()["rejected_records"]["l3"]["auth"] == 1


def test_a_genuine_record_of_another_shard_is_stale(store):
    kv1 = manager(store, (2, 1))
    write(kv1, 1)
    key = kv1.tiers.keys("", PROMPT, 1)[0]
    rkey = record_key(key, 2, 1, secret=SECRET)
    blob = store.get_batch([rkey])[0]
    expect0 = manager(store, (2, 0)).tiers.header()
    with pytest.raises(PageRecordError, match="another shard") as e:
        decode_page(blob, expect0, key=rkey, secret=SECRET)
    assert e.value.reason == "stale"
    decode_page(blob, kv1.tiers.header(), key=rkey, secret=SECRET)   # its own rank reads it


def _fill(pool, pages, seed):
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        pool.pages[p] = torch.randint(0, 0x70, pool.pages[p].shape, generator=g,
                                      dtype=torch.uint8)


def test_a_follower_replays_rank0s_write_back_and_load(store):
    """Rank 0 (write_back) and a follower's TierMirror over its own pool, in one process:
    L1 eviction writes back on rank 0 and, replayed, on the follower; the later L2 load
    brings the follower its own bytes (not rank 0's)."""
    kv = manager(store, (2, 0), policy=TierPolicy(write_policy="write_back"))
    follower = KVPool(LAYOUT, 16)
    mirror = TierMirror(follower, 16, store, secret=SECRET, tp=(2, 1))
    kv.tiers.mirror = mirror.apply
    req = Req("w", list(PROMPT))
    h = kv.admit(req, kv.match(req), 64, headroom=0, future=0)
    _fill(kv.pool, h.pages, 0)
    _fill(follower, h.pages, 1)
    kv.commit(h, req.token_ids)
    want = [follower.pages[p].clone() for p in h.pages[:3]]
    kv.release(h)
    assert len(kv.evict(16)) >= 3
    kv.tiers.sync()
    assert mirror.counters["l2_written"] == 3
    _fill(follower, range(16), 2)                           # the follower's L1 is gone too
    again = kv.admit(Req("r", list(PROMPT)), kv.match(Req("r", list(PROMPT))), 64,
                     headroom=0, future=0)
    assert again.from_l2 == 3
    kv.tiers.sync()
    for page, w in zip(again.pages[:3], want):
        assert torch.equal(follower.pages[page], w)


def test_write_back_l2_evictions_persist_every_ranks_record(store):
    """write_back with a 3-slot L2: a second prompt pushes the first one's pages out of L2,
    and both rank 0 and (replaying) the follower write their own L3 records of them."""
    pool = KVPool(LAYOUT, 16)
    cache = RadixCache(PS, pool)
    tm = TierManager(pool, cache, "m", HostPool(LAYOUT, 3), store,
                     TierPolicy(write_policy="write_back"), secret=SECRET, tp=(2, 0))
    kv = KVCacheManager(pool, cache, tm)
    follower = KVPool(LAYOUT, 16)
    mirror = TierMirror(follower, 3, store, secret=SECRET, tp=(2, 1))
    tm.mirror = mirror.apply
    for n, prompt in enumerate((PROMPT, [t + 50 for t in PROMPT])):
        req = Req(f"p{n}", list(prompt))
        h = kv.admit(req, kv.match(req), 64, headroom=0, future=0)
        _fill(pool, h.pages, n)
        _fill(follower, h.pages, 10 + n)
        kv.commit(h, req.token_ids)
        kv.release(h)
        assert len(kv.evict(16)) >= 3                       # L1 -> L2 (write-back)
        tm.sync()
    assert tm.drain()
    keys = tm.keys("", PROMPT, 3)
    for rank in (0, 1):
        assert store.exists_batch([record_key(k, 2, rank, secret=SECRET) for k in keys]) == \
            [True] * 3, rank
    assert mirror.counters["l3_written"] == 3


def test_one_rank_records_keep_the_header_of_before():
    """TP=1 records carry no TP fields (older readers take them); they decode as rank 0 of 1."""
    from nibble.tiering.page_record import PageHeader, encode_page
    pool = KVPool(LAYOUT, 1)
    h1 = PageHeader.for_pool(LAYOUT, 0, pool.global_scales)
    blob = encode_page(h1, pool.pages[0], key=b"k", secret=SECRET)
    assert b"tp_size" not in blob
    decode_page(blob, h1, key=b"k", secret=SECRET)
    h2 = PageHeader.for_pool(LAYOUT, 0, pool.global_scales, tp=(2, 1))
    assert b'"tp_size":2,"tp_rank":1' in encode_page(h2, pool.pages[0], key=b"k", secret=SECRET)
