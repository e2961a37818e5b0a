"""Prefill on one engine, decode on another: pages handed over, leases, nothing leaks."""

from __future__ import annotations

import dataclasses

import pytest

from nibble.services.errors import OutOfPagesError
from nibble.services.engine.kv_connector import KVConnector
from nibble.services.engine.types import GenerateRequest, SamplingParams

from .conftest import make_engine
from .test_engine import PROMPT, alone, greedy, run_all


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def connected(model, clock=None, **kw):
    """An engine with a connector (a disaggregated worker's), and that connector."""
    eng = make_engine(model, **kw)
    conn = KVConnector(clock or FakeClock())
    eng.attach_connector(conn)
    return eng, conn


def prefill_on(p_eng, req):
    """Run ``req`` on the prefill engine for its first token, keeping its pages."""
    pre = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=1),
                              hold_pages=True)
    p_eng.add_request(pre)
    first = None
    while p_eng.has_unfinished():
        for o in p_eng.step():
            first = o.new_token_ids[0] if o.new_token_ids else first
    pages, tokens = p_eng.connector.held_pages(req.request_id)
    return first, pages, tokens


def test_handoff_matches_colocated_and_frees_everything(bf16_model):
    (p_eng, p_conn), (d_eng, d_conn) = connected(bf16_model), connected(bf16_model)
    req = greedy("r", n=10)
    first, src_pages, tokens = prefill_on(p_eng, req)
    res = d_conn.reserve(req, lease_s=30)
    assert tokens == len(PROMPT) == res.num_tokens and len(res.new_pages) == len(src_pages)
    for s, d in zip(src_pages, res.new_pages):          # what a transport does
        d_eng.pool.pages[d].copy_(p_eng.pool.pages[s])
    assert p_conn.release_held("r")
    out = [d_eng.add_prefilled(req, first)]
    while d_eng.has_unfinished():
        out += d_eng.step()
    tokens_out = [t for o in out for t in o.new_token_ids]
    ref, horizon = alone(bf16_model, greedy("ref", n=10))
    assert len(tokens_out) == 10 and tokens_out[:horizon] == ref[:horizon]
    assert out[-1].finished and out[-1].usage.completion_tokens == 10
    for eng in (p_eng, d_eng):
        assert eng.pool.allocator.num_free == eng.pool.num_pages
        eng.kv.check_integrity()


def test_decode_worker_reuses_its_cached_prefix(bf16_model):
    d_eng, conn = connected(bf16_model)
    run_all(d_eng, [greedy("warm", n=2)])
    res = conn.reserve(greedy("r"), lease_s=30)
    assert len(res.prefix_pages) == 4 and len(res.new_pages) == 1    # 70 tokens: 4 cached + 1
    assert conn.cancel("r") and not conn.cancel("r")
    assert d_eng.pool.allocator.num_free == d_eng.pool.num_pages


def test_expired_lease_frees_pages_and_install_then_fails(bf16_model):
    clock = FakeClock()
    d_eng, conn = connected(bf16_model, clock)
    req = greedy("r")
    conn.reserve(req, lease_s=0.01)
    assert d_eng.pool.allocator.num_free < d_eng.pool.num_pages
    clock.now += 0.005
    assert conn.expire() == []
    clock.now += 0.015
    assert conn.expire() == ["r"]
    assert d_eng.pool.allocator.num_free == d_eng.pool.num_pages
    with pytest.raises(Exception, match="no live reservation"):
        d_eng.add_prefilled(req, 5)
    assert not d_eng.has_unfinished()


def test_heartbeat_keeps_the_lease(bf16_model):
    clock = FakeClock()
    d_eng, conn = connected(bf16_model, clock)
    conn.reserve(greedy("r"), lease_s=0.05)
    for _ in range(4):
        clock.now += 0.02
        assert conn.extend("r", 0.05)
        assert conn.expire() == []
    clock.now += 0.06                                   # the heartbeats stop: the lease ends
    assert conn.expire() == ["r"] and not conn.extend("r", 0.05)


def test_reserve_refuses_when_full(bf16_model):
    d_eng, conn = connected(bf16_model, num_pages=6)
    conn.reserve(GenerateRequest("a", PROMPT[:60], SamplingParams(max_tokens=4)), 30)
    with pytest.raises(OutOfPagesError):
        conn.reserve(GenerateRequest("b", PROMPT[:60], SamplingParams(max_tokens=4)), 30)
    conn.cancel("a")
    assert d_eng.pool.allocator.num_free == 6
