"""Step timing (services/engine/step_stats.py): intervals by kind, the trace, the engine's hooks."""

from __future__ import annotations

import io
import json

import pytest

from nibble.services.engine.step_stats import StepShape, StepTimer, shape_of
from nibble.services.engine.types import ScheduledSeq, SamplingParams

from .conftest import make_engine
from .test_engine import PROMPT, greedy, run_all


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def entry(rid, start, n):
    return ScheduledSeq(rid, list(range(1, n + 1)), start, start, [], True, SamplingParams(), 0,
                        None, None)


def test_shape_tells_decodes_from_chunks_and_weighs_costs():
    prompts = {"a": 100, "b": 40, "c": 10}
    rows = [entry("a", 64, 36), entry("b", 40, 1), entry("c", 0, 10), entry("c2", 12, 1)]
    prompts["c2"] = 12
    shape = shape_of(rows, prompts.__getitem__, cost_ctx=0)
    assert shape == StepShape(decodes=2, chunk_tokens=46, prefix_tokens=64, cost=46.0)
    assert shape.kind == "mixed"
    weighed = shape_of(rows, prompts.__getitem__, cost_ctx=100)
    assert weighed.cost == pytest.approx(36 * (1 + (64 + 18) / 100) + 10 * (1 + 5 / 100))
    assert shape_of(rows[1:2], prompts.__getitem__, 0).kind == "decode"
    assert shape_of(rows[2:3], prompts.__getitem__, 0).kind == "prefill"


def test_intervals_by_kind_without_idle_time():
    clock, trace = Clock(), io.StringIO()
    timer = StepTimer(trace, clock=clock)
    dec, mix = StepShape(4, 0, 0, 0.0), StepShape(3, 512, 4096, 700.0)
    timer.begin()
    clock.t += 0.012
    timer.landed(dec)                 # 12 ms since the step began
    clock.t += 0.180
    timer.landed(mix)                 # 180 ms
    timer.idle()
    clock.t += 50.0                   # nothing to do: not an interval
    timer.begin()
    clock.t += 0.009
    timer.landed(dec)
    snap = timer.snapshot()
    assert set(snap) == {"decode", "mixed"}
    assert snap["decode"]["count"] == 2 and snap["decode"]["sum"] == pytest.approx(0.021)
    assert snap["mixed"]["count"] == 1 and snap["mixed"]["sum"] == pytest.approx(0.18)
    cum = dict((le, c) for le, c in snap["mixed"]["buckets"])
    assert cum[0.15] == 0 and cum[0.2] == 1            # cumulative, by upper bound
    assert dict((le, c) for le, c in snap["decode"]["buckets"])[0.01] == 1
    json.dumps(snap)                                   # plain JSON: no infinities
    lines = [json.loads(x) for x in trace.getvalue().splitlines()]
    assert [x["kind"] for x in lines] == ["decode", "mixed", "decode"]
    assert [x["interval_ms"] for x in lines] == [12.0, 180.0, 9.0]
    assert lines[1] == {**lines[1], "decodes": 3, "chunk_tokens": 512, "prefix_tokens": 4096,
                        "cost": 700.0}


def test_trace_is_bounded():
    trace = io.StringIO()
    timer = StepTimer(trace, clock=Clock(), max_trace_lines=3)
    timer.begin()
    for _ in range(10):
        timer.landed(StepShape(1, 0, 0, 0.0))
    assert len(trace.getvalue().splitlines()) == 3
    assert timer.snapshot()["decode"]["count"] == 10     # still counted


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_traces_every_step(fp32_model, tmp_path, overlap):
    path = tmp_path / "steps.jsonl"
    eng = make_engine(fp32_model, overlap=overlap, chunked_prefill_size=16,
                      max_prefill_tokens=40, step_trace_file=str(path))
    reqs = [greedy("a", PROMPT[:21], n=12), greedy("b", PROMPT[25:70], n=3)]
    run_all(eng, reqs)
    stats = eng.stats()["step_intervals"]
    eng.step_timer.close()
    steps = [json.loads(x) for x in path.read_text().splitlines()]
    assert sum(s["chunk_tokens"] for s in steps) == 21 + 45
    # b's chunks start at 0, 16, 32 and a's second chunk at 16: attention over those prefixes
    assert sum(s["prefix_tokens"] for s in steps) == 16 + 16 + 32
    decodes = sum(s["decodes"] for s in steps)
    assert decodes == 11 + 2 if not overlap else decodes >= 13   # overlap: one step late
    assert {s["kind"] for s in steps} == {"prefill", "mixed", "decode"}
    assert sum(v["count"] for v in stats.values()) == len(steps)
    assert all(s["interval_ms"] >= 0 for s in steps)
    # host side of each step: scheduling, the forward's plan + enqueue (on CPU the forward
    # runs while it is enqueued; a synchronous step's enqueue lies inside its interval, a
    # launched one's overlapped the step before), the pause meter's counts
    assert all(s["sched_ms"] >= 0 and s["enqueue_ms"] > 0 for s in steps)
    if not overlap:
        assert all(s["enqueue_ms"] <= s["interval_ms"] + 1e-3 for s in steps[1:])
    assert all({"gc_ms", "device_mallocs"} <= s.keys() for s in steps)
