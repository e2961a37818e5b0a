"""bench/_step_trace.py: the step histogram through /metrics' exposition, and trace summaries."""

from __future__ import annotations

import io
import json

from nibble.bench._step_trace import parse_steps, step_deltas, summarize_trace
from nibble.services.engine.step_stats import StepShape, StepTimer
from nibble.services.metrics import Metrics


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def run(timer: StepTimer, clock: Clock, intervals_ms, shape: StepShape) -> None:
    timer.begin()
    for ms in intervals_ms:
        clock.t += ms / 1e3
        timer.landed(shape)


def scrape(timer: StepTimer) -> dict:
    text = Metrics(stats=lambda: {"step_intervals": timer.snapshot()}).render()[0].decode()
    return parse_steps(text)


def test_histogram_round_trip_and_run_deltas():
    clock, timer = Clock(), StepTimer(clock=Clock())
    timer.clock = clock
    dec, mix = StepShape(8, 0, 0, 0.0), StepShape(8, 2048, 30000, 7300.0)
    run(timer, clock, [11] * 50, dec)
    before = scrape(timer)
    assert before["decode"]["count"] == 50 and "mixed" not in before
    run(timer, clock, [11] * 98 + [180, 1800], dec)
    run(timer, clock, [140] * 10 + [250], mix)
    got = step_deltas(before, scrape(timer))
    assert got["decode"]["count"] == 100
    assert got["decode"]["p50_le_ms"] == 15.0          # 11 ms falls under the 15 ms bound
    assert got["decode"]["p99_le_ms"] == 200.0         # the 99th of 100 is the 180 ms step
    assert abs(got["decode"]["mean_ms"] - (98 * 11 + 180 + 1800) / 100) < 1e-6
    assert got["mixed"] == {**got["mixed"], "count": 11, "p50_le_ms": 150.0,
                            "p99_le_ms": 300.0}


def test_p99_past_the_last_bound_is_none():
    clock, timer = Clock(), StepTimer(clock=Clock())
    timer.clock = clock
    run(timer, clock, [9000], StepShape(0, 100, 0, 100.0))
    assert step_deltas({}, scrape(timer))["prefill"]["p99_le_ms"] is None


def test_trace_summary_names_the_slowest_steps(tmp_path):
    clock, trace = Clock(), io.StringIO()
    timer = StepTimer(trace, clock=clock)
    run(timer, clock, [10, 12, 11], StepShape(4, 0, 0, 0.0))
    run(timer, clock, [120, 310], StepShape(4, 1500, 29000, 5100.0))
    path = tmp_path / "steps.jsonl"
    path.write_text(trace.getvalue())
    got = summarize_trace(path, top=2)
    assert got["kinds"]["decode"] == {"count": 3, "p50_ms": 11.0, "p99_ms": 12.0, "max_ms": 12.0}
    assert got["kinds"]["mixed"]["max_ms"] == 310.0
    assert [s["interval_ms"] for s in got["slowest"]] == [310.0, 120.0]
    assert got["slowest"][0]["prefix_tokens"] == 29000
    json.dumps(got)
    assert summarize_trace(tmp_path / "missing.jsonl") is None
    assert "pauses" not in got          # a trace without the meter's fields


def test_trace_summary_adds_up_the_host_pauses(tmp_path):
    lines = [{"kind": "decode", "interval_ms": 9.0, "gc_ms": 0.5, "gc_runs": 1, "gc_full": 0,
              "device_mallocs": 0, "alloc_retries": 0},
             {"kind": "mixed", "interval_ms": 210.0, "gc_ms": 80.25, "gc_runs": 2, "gc_full": 1,
              "device_mallocs": 2, "alloc_retries": 1}]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = summarize_trace(path)
    assert got["pauses"] == {"gc_ms": 80.75, "gc_runs": 3, "gc_full": 1, "device_mallocs": 2,
                             "alloc_retries": 1}
    assert got["slowest"][0]["gc_ms"] == 80.25
