"""Prefix reuse, tenant isolation, capacity-driven admission and flush through EngineCore."""

from __future__ import annotations

import pytest

from nibble.kernels import PageLayout
from nibble.services.engine.types import GenerateRequest, SamplingParams

from .conftest import make_engine
from .test_engine import PROMPT, alone, run_all


def req(rid, prompt=PROMPT, n=6, salt=None):
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0.0,
                                                             ignore_eos=True), cache_salt=salt)


def test_second_request_reuses_the_prefix_and_agrees(bf16_model):
    eng = make_engine(bf16_model)
    first = run_all(eng, [req("a")])["a"]
    again = run_all(eng, [req("b")])["b"]
    assert first[3].cached_tokens == 0
    assert again[3].cached_tokens == 64               # (70 - 1) // 16 full pages
    tokens, horizon = alone(bf16_model, req("c"))
    assert again[0][:horizon] == tokens[:horizon]
    assert eng.stats()["cache_hit_rate"] == pytest.approx(64 / 140)


def test_tenants_never_share_a_prefix(bf16_model):
    eng = make_engine(bf16_model)
    run_all(eng, [req("a", salt="tenant-a")])
    assert run_all(eng, [req("b", salt="tenant-b")])["b"][3].cached_tokens == 0
    assert run_all(eng, [req("c")])["c"][3].cached_tokens == 0
    assert run_all(eng, [req("d", salt="tenant-a")])["d"][3].cached_tokens == 64


def test_disabled_radix_cache_reuses_nothing(bf16_model):
    eng = make_engine(bf16_model, radix=False)
    run_all(eng, [req("a")])
    assert run_all(eng, [req("b")])["b"][3].cached_tokens == 0
    assert eng.stats()["num_cached_pages"] == 0


def test_multi_turn_history_grows_cached_tokens(bf16_model):
    eng = make_engine(bf16_model)
    history, cached = list(PROMPT[:20]), []
    for turn in range(4):
        out = run_all(eng, [req(f"t{turn}", history, n=8)])[f"t{turn}"]
        cached.append(out[3].cached_tokens)
        history = history + out[0] + [(5 * turn + 11) % 90 + 1 for _ in range(9)]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached


def test_flush_cache_refused_while_running_then_clears(bf16_model):
    eng = make_engine(bf16_model)
    eng.add_request(req("a", n=20))
    eng.step()
    assert eng.flush_cache() is False and eng.has_unfinished()
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["num_cached_pages"] > 0
    assert eng.flush_cache() is True and eng.stats()["num_cached_pages"] == 0
    assert run_all(eng, [req("b")])["b"][3].cached_tokens == 0


def test_abort_all_frees_everything(bf16_model):
    eng = make_engine(bf16_model)
    for i in range(3):
        eng.add_request(req(f"r{i}", PROMPT[i:], n=40))
    eng.step()
    outs = eng.abort_all()
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"]
    assert all(o.finish_reason.value == "abort" for o in outs)
    assert eng.pool.allocator.num_free == eng.pool.num_pages and not eng.has_unfinished()


def resident(model, kv, pool_bytes):
    page_nbytes = PageLayout(kv, model.arch.num_layers, model.arch.num_kv_heads,
                             model.arch.head_dim, 16).page_nbytes
    eng = make_engine(model, kv=kv, num_pages=pool_bytes // page_nbytes, max_running_requests=256,
                      max_prefill_tokens=100_000)
    for i in range(40):                                 # 40 equal requests of 40 + 8 tokens
        eng.add_request(req(f"r{i}", PROMPT[i:i + 40], n=8))
    eng.step()
    return len(eng.scheduler.running), eng.scheduler.num_preemptions


def test_iso_capacity_nvfp4_keeps_1_78x_the_requests_of_fp8(fp32_model):
    a = fp32_model.arch
    fp8_page = PageLayout("fp8_e4m3", a.num_layers, a.num_kv_heads, a.head_dim, 16).page_nbytes
    pool_bytes = 27 * fp8_page                          # 27 fp8 pages == 48 nvfp4 pages
    fp8, p1 = resident(fp32_model, "fp8_e4m3", pool_bytes)
    nv, p2 = resident(fp32_model, "nvfp4", pool_bytes)
    assert (fp8, nv) == (9, 16) and p1 == p2 == 0       # 3 pages per request, none preempted
    assert nv / fp8 == pytest.approx(16 / 9, rel=0.01)


def test_computed_prompt_tokens_count_only_what_the_model_runs(bf16_model):
    eng = make_engine(bf16_model)
    computed = lambda: eng.stats()["prompt_tokens_computed"]  # noqa: E731
    run_all(eng, [req("a", salt="tenant-a")])
    assert computed() == 70                          # the whole prompt, decode steps excluded
    run_all(eng, [req("b", salt="tenant-b")])
    assert computed() == 140                         # another tenant: computed again in full
    run_all(eng, [req("c", salt="tenant-a")])
    assert computed() == 146                         # 64 reused, 6 computed
