"""Host pauses in a step (services/engine/pauses.py): GC time and allocator segments."""

from __future__ import annotations

import gc
import io
import json

import pytest

from nibble.services.engine.pauses import PauseMeter, freeze_startup_objects, thaw_startup_objects
from nibble.services.engine.step_stats import StepShape, StepTimer


class StepClock:
    """Each read advances by ``step`` seconds."""

    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


class Counters:
    def __init__(self):
        self.mallocs = self.retries = 0

    def __call__(self) -> dict:
        return {"num_device_alloc": self.mallocs, "num_alloc_retries": self.retries}


@pytest.fixture
def no_auto_gc():
    enabled = gc.isenabled()
    gc.disable()                       # only the collections the test makes
    yield
    if enabled:
        gc.enable()


def test_meter_times_each_collection_and_resets(no_auto_gc):
    counters = Counters()
    meter = PauseMeter(clock=StepClock(0.25), alloc_stats=counters)
    try:
        gc.collect(0)
        gc.collect()                   # a full (generation 2) collection
        counters.mallocs, counters.retries = 3, 1
        got = meter.take()
        assert got == {"gc_ms": 500.0, "gc_runs": 2, "gc_full": 1, "device_mallocs": 3,
                       "alloc_retries": 1}
        counters.mallocs = 4
        assert meter.take() == {"gc_ms": 0.0, "gc_runs": 0, "gc_full": 0, "device_mallocs": 1,
                                "alloc_retries": 0}
    finally:
        meter.close()
    assert meter._on_gc not in gc.callbacks
    gc.collect()
    assert meter.take()["gc_runs"] == 0, "a closed meter still counted"


def test_trace_lines_carry_the_pauses_and_idle_time_is_dropped(no_auto_gc):
    counters = Counters()
    buf = io.StringIO()
    timer = StepTimer(buf, clock=lambda: 0.0,
                      pauses=PauseMeter(clock=StepClock(0.01), alloc_stats=counters))
    gc.collect()                       # while idle: belongs to no step
    counters.mallocs = 2
    timer.begin()
    gc.collect()
    counters.mallocs = 3
    timer.landed(StepShape(decodes=2, chunk_tokens=64, prefix_tokens=0, cost=64.0))
    line = json.loads(buf.getvalue().splitlines()[0])
    timer.close()
    assert line["kind"] == "mixed"
    assert (line["gc_ms"], line["gc_runs"], line["gc_full"]) == (10.0, 1, 1)
    assert line["device_mallocs"] == 1


def test_freeze_moves_startup_objects_out_of_reach():
    keep = [[i] for i in range(1000)]
    try:
        assert freeze_startup_objects() >= len(keep)
        assert gc.get_freeze_count() >= len(keep)
    finally:
        thaw_startup_objects()
    assert gc.get_freeze_count() == 0
