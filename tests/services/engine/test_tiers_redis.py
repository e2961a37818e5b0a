"""Hierarchical cache over real Redis: L3 round trip, a killed connection, Redis stopped mid-run."""

from __future__ import annotations

import pytest

redis_py = pytest.importorskip("redis")
import torch

from nibble.services.engine.builder import Injected, build_engine_core
from nibble.tiering.storage import RedisStorage

from tests.redis_fixtures import wait_for

from .conftest import CharTokenizer, tiered_config
from .test_engine import PROMPT, alone, greedy, run_all

pytestmark = pytest.mark.redis


def engine_on(model, url, prefix, kv="nvfp4"):
    store = RedisStorage(url, prefix=prefix, client_name="nibble-test-tiers",
                         backoff_base_s=0.05, backoff_max_s=0.2)
    return build_engine_core(model, CharTokenizer(), tiered_config(kv), fingerprint="test-model",
                             inject=Injected(calibrate=False, storage=store,
                                             tier_kw={"l3_latency_s": 0.0}))


def flush_l1_l2(eng):
    eng.cache.flush()
    eng.tiers.host.clear()


def test_nvfp4_pages_come_back_from_redis_bit_identical(bf16_model, redis_url, redis_prefix):
    eng = engine_on(bf16_model, redis_url, redis_prefix)
    first = run_all(eng, [greedy("a", n=6)])["a"]
    original = [eng.pool.pages[p].clone() for p in eng.cache.match(PROMPT, "", 4).pages]
    assert wait_for(lambda: eng.tiers.stats()["l3_written"] >= 4)
    flush_l1_l2(eng)
    again = run_all(eng, [greedy("b", n=6)])["b"]
    assert again[3].cached_by_tier == {"l1": 0, "l2": 0, "l3": 64}
    back = [eng.pool.pages[p] for p in eng.cache.match(PROMPT, "", 4).pages]
    assert len(back) == 4 and all(torch.equal(x, y) for x, y in zip(back, original))
    assert again[0] == first[0]          # same pages in, same tokens out


def test_bf16_prefix_from_redis_equals_recomputing(bf16_model, redis_url, redis_prefix):
    eng = engine_on(bf16_model, redis_url, redis_prefix, kv="bf16")
    run_all(eng, [greedy("a", n=8)])
    assert wait_for(lambda: eng.tiers.stats()["l3_written"] >= 4)
    flush_l1_l2(eng)
    got = run_all(eng, [greedy("b", n=8)])["b"]
    assert got[3].cached_by_tier["l3"] == 64
    tokens, horizon = alone(bf16_model, greedy("ref", n=8))
    assert got[0][:horizon] == tokens[:horizon]


def test_killed_connection_costs_hits_not_requests(bf16_model, redis_url, redis_prefix):
    eng = engine_on(bf16_model, redis_url, redis_prefix)
    run_all(eng, [greedy("a", n=4)])
    assert wait_for(lambda: eng.tiers.stats()["l3_written"] >= 4)
    admin = redis_py.Redis.from_url(redis_url)
    for c in admin.client_list():
        if c.get("name") == "nibble-test-tiers":
            admin.client_kill_filter(_id=c["id"])
    admin.close()
    flush_l1_l2(eng)
    out = run_all(eng, [greedy("b", n=4)])["b"]
    assert len(out[0]) == 4 and out[2].value == "length"      # served, whatever the hit rate


def test_redis_stopped_mid_run_keeps_serving(bf16_model, private_redis):
    eng = engine_on(bf16_model, private_redis.url, "nibble:test:stop:")
    run_all(eng, [greedy("a", n=4)])
    assert wait_for(lambda: eng.tiers.stats()["l3_written"] >= 4)
    private_redis.stop()
    flush_l1_l2(eng)
    out = run_all(eng, [greedy("b", n=4)])["b"]               # L3 gone: recompute
    assert len(out[0]) == 4 and out[3].cached_tokens == 0
    other = [(i * 5) % 90 + 1 for i in range(40)]
    run_all(eng, [greedy("c", other, n=4)])                    # writes fail quietly
    assert wait_for(lambda: eng.tiers.stats()["l3_state"] == "down")
    private_redis.start()
    assert wait_for(lambda: eng.tiers.stats()["l3_state"] == "up", timeout=10)
    assert eng.pool.allocator.num_free == eng.pool.num_pages
