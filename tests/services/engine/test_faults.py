"""Finding 2 of issue 14: one failing request must not fail the others.

Faults are injected into a real small engine: a runner that raises for one
request's step or turns its logits NaN, and real pages planted with NaN bytes
in the prefix cache (L1) or the host tier (L2). The other requests of the same
batch must produce exactly their fault-free greedy tokens, the culprit ends
alone with a RequestFaultError (or, when reused pages were the cause, is
recomputed to the right answer with those pages gone from L1 and L2), and every
page comes back.
"""

from __future__ import annotations

import pytest

from nibble.services.engine.types import FinishReason
from nibble.services.errors import DeviceFaultError

from .conftest import make_engine
from .faulty import inject, no_grad_poison, pages_balance, run_outputs
from .test_engine import PROMPT, greedy

PROMPTS = {f"r{i}": PROMPT[4 * i:4 * i + 21 + 5 * i] for i in range(4)}


def batch(n=10):
    return [greedy(rid, p, n=n) for rid, p in PROMPTS.items()]


@pytest.fixture(scope="module")
def clean(fp32_model):
    """Fault-free greedy tokens of the four requests, run as one batch."""
    got = run_outputs(make_engine(fp32_model), batch())
    return {rid: v[0] for rid, v in got.items()}


def test_an_exception_for_one_request_fails_it_alone(fp32_model, clean):
    eng = make_engine(fp32_model)
    runner = inject(eng, raise_for={"r2"})
    got = run_outputs(eng, batch())
    for rid in ("r0", "r1", "r3"):
        assert got[rid][0] == clean[rid] and got[rid][2] is None, rid
    tokens, reason, error, etype = got["r2"]
    assert tokens == [] and reason is FinishReason.ABORT
    assert etype == "RequestFaultError" and "injected fault" in error
    # 10 steps (prefill + 9 decodes); bisecting the first: [r0 r1] ok, [r2 r3] fails,
    # [r2] fails, [r3] ok.
    assert runner.executions == 10 + 4
    assert eng.num_request_faults == 1
    pages_balance(eng)


def test_nan_logits_mid_decode_fail_only_that_request(fp32_model, clean):
    eng = make_engine(fp32_model)
    runner = inject(eng)
    got = run_outputs(eng, batch(), on_step=lambda i: runner.nan_for.update({"r1"} if i == 4 else ()))
    for rid in ("r0", "r2", "r3"):
        assert got[rid][0] == clean[rid] and got[rid][2] is None, rid
    tokens, reason, error, etype = got["r1"]
    assert tokens == clean["r1"][:4]                # what it streamed before the fault stands
    assert (reason, etype) == (FinishReason.ABORT, "RequestFaultError") and "non-finite" in error
    # Its pages (prompt cached at prefill) are gone from the prefix cache: they may be the poison.
    assert eng.cache.match(PROMPTS["r1"], "", max_pages=1).pages == []
    pages_balance(eng)


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_poisoned_cached_pages_are_dropped_and_the_request_recomputed(fp32_model, kv):
    """bf16: NaN K/V -> NaN logits (row check); nvfp4: NaN block scales -> the quantizer
    raises on the next layer's K/V (bisection). Either way the victim is recomputed."""
    shared = PROMPT[:48]
    victim, bystander = greedy("victim", shared + [5, 6, 7]), greedy("other", PROMPT[50:69])
    ref = run_outputs(make_engine(fp32_model, kv=kv), [victim, bystander])
    eng = make_engine(fp32_model, kv=kv)
    run_outputs(eng, [greedy("warm", shared + [9], n=2)])
    cached = eng.cache.match(shared + [1], "", max_pages=3).pages
    assert len(cached) == 3
    no_grad_poison(eng.pool, cached[1])
    got = run_outputs(eng, [victim, bystander])
    for rid in ("victim", "other"):
        assert got[rid][0] == ref[rid][0] and got[rid][2] is None, rid
    assert eng.num_fault_recomputes == 1 and eng.num_request_faults == 1
    assert not eng.cache.is_cached(cached[1])       # the poison left L1
    again = run_outputs(eng, [greedy("again", shared + [5, 6, 7])])["again"]
    assert again[0] == ref["victim"][0] and eng.num_request_faults == 1
    pages_balance(eng)


def test_poisoned_l2_pages_are_dropped_from_l2(fp32_model, tmp_path):
    from .test_tiers import settle, tiered_engine
    shared = PROMPT[:48]
    ref = run_outputs(tiered_engine(fp32_model, tmp_path / "ref", storage=False),
                      [greedy("victim", shared + [5, 6, 7])])["victim"][0]
    eng = tiered_engine(fp32_model, tmp_path, storage=False)
    run_outputs(eng, [greedy("warm", shared + [9], n=2)])
    keys = eng.tiers.keys("", shared, 3)
    settle(eng, lambda: all(k in eng.tiers.host for k in keys))
    eng.cache.flush()                               # L1 forgets; the pages come back from L2
    host = eng.tiers.host
    host.data[host.slot(keys[1])].fill_(0xFF)
    got = run_outputs(eng, [greedy("victim", shared + [5, 6, 7])])["victim"]
    assert got[0] == ref and got[2] is None and eng.num_fault_recomputes == 1
    assert eng.tiers.drain()
    slot = host.slot(keys[1])                       # re-backed-up from the recompute, or absent
    assert slot is None or not bool((host.data[slot] == 0xFF).all())
    pages_balance(eng)


def test_a_request_failing_even_without_reused_pages_is_not_retried_forever(fp32_model):
    eng = make_engine(fp32_model)
    run_outputs(eng, [greedy("warm", PROMPT[:40], n=2)])
    runner = inject(eng, raise_for={"bad"})
    got = run_outputs(eng, [greedy("bad", PROMPT[:40] + [3]), greedy("ok", PROMPT[60:75])])
    assert got["bad"][3] == "RequestFaultError" and got["ok"][2] is None
    assert eng.num_fault_recomputes == 1 and eng.num_request_faults == 2   # one recompute only
    assert runner.executions < 20
    pages_balance(eng)


def test_a_device_fault_is_not_isolated(fp32_model):
    eng = make_engine(fp32_model)
    runner = inject(eng, raise_for={"r1"}, exc=RuntimeError(
        "CUDA error: an illegal memory access was encountered"))
    for r in batch():
        eng.add_request(r)
    with pytest.raises(DeviceFaultError, match="illegal memory access"):
        eng.step()
    assert runner.executions == 1                   # nothing re-run on a broken device


def test_failures_in_a_row_with_nothing_running_cleanly_mean_a_broken_engine(fp32_model):
    eng = make_engine(fp32_model)
    eng.max_fault_streak = 3
    runner = inject(eng, raise_for={"a", "b", "c", "d", "e"})
    assert run_outputs(eng, [greedy("a", PROMPT[:20])])["a"][3] == "RequestFaultError"
    assert run_outputs(eng, [greedy("b", PROMPT[:21])])["b"][3] == "RequestFaultError"
    assert eng.fault_streak == 2
    for r in (greedy("c", PROMPT[:22]), greedy("ok", PROMPT[30:50])):
        eng.add_request(r)
    eng.step()                                      # c fails, but "ok" runs: a working engine
    assert eng.fault_streak == 1
    eng.abort("ok")
    eng.add_request(greedy("d", PROMPT[:23]))
    eng.step()
    eng.add_request(greedy("e", PROMPT[:24]))
    with pytest.raises(DeviceFaultError, match="3 requests failed in a row"):
        eng.step()
    assert runner.raise_for
