"""Hierarchical cache through EngineCore: pages leave L1 and come back bit-identical."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nibble.services.config import HiCacheConfig, SchedulerConfig
from nibble.services.engine.builder import Injected, build_engine_core

from .conftest import CharTokenizer, engine_config
from .test_engine import PROMPT, alone, greedy, run_all


def tiered_engine(model, tmp_path, kv="bf16", write="write_through", prefetch="wait_complete",
                  num_pages=32, host_pages=64, storage=True, clock=None, **policy):
    """A real EngineCore with L2 (``host_pages``) and an L3 file store under ``tmp_path``."""
    hicache = HiCacheConfig(enable_hierarchical_cache=True, hicache_size=None,
                            hicache_ratio=host_pages / num_pages, hicache_write_policy=write,
                            hicache_prefetch_policy=prefetch,
                            hicache_storage_backend="file" if storage else "none",
                            hicache_storage_url=str(tmp_path / "l3"))
    cfg = engine_config(kv, num_pages, hicache=hicache,
                        max_running_requests=SchedulerConfig().max_running_requests)
    tier_kw = {"l3_latency_s": 0.0, **policy, **({"clock": clock} if clock else {})}
    return build_engine_core(model, CharTokenizer(), cfg, fingerprint="test-model",
                             inject=Injected(calibrate=False, tier_kw=tier_kw))


def settle(eng, cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, eng.tiers.stats()
        eng.tiers.poll()
        time.sleep(0.01)


def page_bytes(eng, rid_pages):
    return [eng.pool.pages[p].clone() for p in rid_pages]


def test_prefix_served_from_l2_then_l3_bit_identical(bf16_model, tmp_path):
    eng = tiered_engine(bf16_model, tmp_path)
    first = run_all(eng, [greedy("a", n=8)])["a"]
    settle(eng, lambda: eng.tiers.stats()["l3_written"] >= 4)
    l1_pages = eng.cache.match(PROMPT, "", max_pages=4).pages
    original = page_bytes(eng, l1_pages)

    eng.cache.flush()                                   # L1 forgets; L2 and L3 keep the pages
    b = run_all(eng, [greedy("b", n=8)])["b"]
    assert b[3].cached_tokens == 64 and b[3].cached_by_tier == {"l1": 0, "l2": 64, "l3": 0}
    back = page_bytes(eng, eng.cache.match(PROMPT, "", max_pages=4).pages)
    assert len(back) == 4 and all(torch.equal(x, y) for x, y in zip(back, original))

    eng.cache.flush()
    eng.tiers.host.clear()                              # only L3 still has them
    c = run_all(eng, [greedy("c", n=8)])["c"]
    assert c[3].cached_tokens == 64 and c[3].cached_by_tier == {"l1": 0, "l2": 0, "l3": 64}
    back = page_bytes(eng, eng.cache.match(PROMPT, "", max_pages=4).pages)
    assert len(back) == 4 and all(torch.equal(x, y) for x, y in zip(back, original))
    tokens, horizon = alone(bf16_model, greedy("ref", n=8))
    for out in (first, b, c):
        assert out[0][:horizon] == tokens[:horizon]
    assert eng.pool.allocator.num_free == eng.pool.num_pages


def test_corrupt_l3_page_is_recomputed(bf16_model, tmp_path):
    eng = tiered_engine(bf16_model, tmp_path)
    run_all(eng, [greedy("a", n=4)])
    settle(eng, lambda: eng.tiers.stats()["l3_written"] >= 4)
    keys = eng.tiers.keys("", PROMPT, 4)
    blob = bytearray(eng.tiers.storage.get_batch([keys[1]])[0])
    blob[-5] ^= 0xFF                                    # flip a payload byte
    eng.tiers.storage.put_batch([(keys[1], bytes(blob))])
    eng.cache.flush()
    eng.tiers.host.clear()
    c = run_all(eng, [greedy("c", n=4)])["c"]
    assert c[3].cached_by_tier == {"l1": 0, "l2": 0, "l3": 16}   # page 0 only; 1 fails its checksum
    assert eng.tiers.stats()["l3_corrupt"] == 1


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_write_policies(bf16_model, tmp_path, policy):
    eng = tiered_engine(bf16_model, tmp_path, write=policy, num_pages=8, storage=False)
    run_all(eng, [greedy("a", n=4)])
    eng.tiers.poll()
    if policy == "write_back":
        assert len(eng.tiers.host) == 0                 # nothing written until L1 evicts
        run_all(eng, [greedy("x", [(3 * i) % 90 + 1 for i in range(120)], n=4)])  # evicts a's pages
        assert len(eng.tiers.host) >= 4
    else:
        assert len(eng.tiers.host) == 0
        run_all(eng, [greedy("b", n=4)])                # first hit: still nothing
        run_all(eng, [greedy("c", n=4)])                # second hit: backed up
        settle(eng, lambda: len(eng.tiers.host) >= 4)
    assert eng.pool.allocator.num_free == eng.pool.num_pages


def test_slow_tier_is_skipped_for_recompute(bf16_model, tmp_path):
    """When L3 would take longer than recomputing (sglang#26305), the request recomputes."""
    eng = tiered_engine(bf16_model, tmp_path, assumed_l3_bytes_s=1.0, l3_latency_s=1.0)
    run_all(eng, [greedy("a", n=4)])
    settle(eng, lambda: eng.tiers.stats()["l3_written"] >= 4)
    eng.cache.flush()
    eng.tiers.host.clear()
    before = eng.tiers.stats()["prefetch_skipped_slow"]
    out = run_all(eng, [greedy("b", n=4)])["b"]
    assert out[3].cached_tokens == 0
    assert eng.tiers.stats()["prefetch_skipped_slow"] == before + 1   # decided once per request


def test_best_effort_uses_the_pages_it_reads_on_an_idle_server(bf16_model, tmp_path):
    """Issue 14, finding 12: best_effort read L3 pages, then admitted the request before
    they arrived, so an idle server recomputed them (l3 hits 0, reads > 0)."""
    eng = tiered_engine(bf16_model, tmp_path, prefetch="best_effort", prefetch_timeout_s=60.0)
    run_all(eng, [greedy("a", n=4)])
    settle(eng, lambda: eng.tiers.stats()["l3_written"] >= 4)
    eng.cache.flush()
    eng.tiers.host.clear()
    eng.tiers.prefill_tok_s = 1.0          # recomputing looks slow: loading is worth a wait
    b = run_all(eng, [greedy("b", n=4)])["b"]
    stats = eng.tiers.stats()
    assert b[3].cached_by_tier == {"l1": 0, "l2": 0, "l3": 64}
    assert stats["l3_read"] == stats["l3_hit_pages"] == 4


class GatedStore:
    """A storage backend whose reads wait until ``gate`` is set."""

    def __init__(self, inner):
        self.inner, self.gate = inner, threading.Event()

    def get_batch(self, keys):
        assert self.gate.wait(10)
        return self.inner.get_batch(keys)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_best_effort_holds_a_request_no_longer_than_recomputing_takes(bf16_model, tmp_path):
    now = [0.0]
    eng = tiered_engine(bf16_model, tmp_path, prefetch="best_effort", clock=lambda: now[0])
    run_all(eng, [greedy("a", n=4)])
    settle(eng, lambda: eng.tiers.stats()["l3_written"] >= 4)
    eng.cache.flush()
    eng.tiers.host.clear()
    gated = eng.tiers.storage = eng.tiers.worker.storage = GatedStore(eng.tiers.storage)
    eng.add_request(greedy("b", n=4))
    eng.add_request(greedy("c", [(5 * i) % 90 + 1 for i in range(12)], n=4))  # < 1 page
    eng.step()
    assert [s.request_id for s in eng.scheduler.running] == ["c"]   # b waits; c goes first
    now[0] += eng.tiers._recompute_s(4) + 1e-3                      # waiting no longer pays
    eng.step()
    assert {s.request_id for s in eng.scheduler.running} == {"b", "c"}
    gated.gate.set()
    out = run_all(eng, [])
    assert out["b"][3].cached_tokens == 0 and out["b"][3].completion_tokens == 4
    assert eng.tiers.stats()["l3_read"] == 4      # read too late for b: kept in L2 for later
    assert len(eng.tiers.host) >= 4
