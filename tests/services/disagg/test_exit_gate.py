"""ExitGate: a dead worker exits only after the calls in flight have answered."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from nibble.services.disagg.exit_gate import ExitGate, serving


class FakeLoop:
    """``call_later`` that records; ``run(t)`` fires what is due by time ``t``."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, object, tuple]] = []
        self.now = 0.0

    def call_later(self, delay, fn, *args):
        self.timers.append((self.now + delay, fn, args))

    def advance(self, dt: float) -> None:
        self.now += dt
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, fn, args in sorted(due, key=lambda t: t[0]):
            fn(*args)


def make_gate():
    loop, exits = FakeLoop(), []
    gate = ExitGate(70, exit_fn=exits.append, call_later=loop.call_later, flush_s=1.0,
                    max_wait_s=30.0)
    return gate, loop, exits


def test_an_idle_worker_exits_after_the_flush_delay():
    gate, loop, exits = make_gate()
    gate.request_exit("engine dead")
    loop.advance(0.9)
    assert exits == []
    loop.advance(0.2)
    assert exits == [70]


def test_the_exit_waits_for_the_call_in_flight_then_for_its_reply():
    gate, loop, exits = make_gate()
    gate.enter()                      # the call that hit the fault, still answering
    gate.request_exit("engine dead")
    gate.request_exit("engine dead")  # the next poll asks again: one exit, one log
    loop.advance(5.0)
    assert exits == []
    gate.leave()
    loop.advance(0.9)
    assert exits == []
    loop.advance(0.2)
    assert exits == [70]
    loop.advance(100.0)               # the hard deadline fires too; os._exit never returns
    assert exits == [70, 70]


def test_a_call_that_never_ends_cannot_hold_the_process():
    gate, loop, exits = make_gate()
    gate.enter()
    gate.request_exit("engine dead")
    loop.advance(29.0)
    assert exits == []
    loop.advance(1.5)
    assert exits == [70]


def test_calls_before_any_fault_never_exit():
    gate, loop, exits = make_gate()
    gate.enter()
    gate.leave()
    loop.advance(100.0)
    assert exits == [] and gate.in_flight == 0


class Worker:
    def __init__(self, gate):
        self.gate = gate
        self.seen: list[int] = []

    @serving
    async def call(self, fail: bool):
        self.seen.append(self.gate.in_flight)
        if fail:
            raise RuntimeError("lost a rank")
        return 1

    @serving
    async def stream(self, n: int):
        for i in range(n):
            self.seen.append(self.gate.in_flight)
            yield i


def test_serving_counts_coroutines_and_generators_and_their_failures():
    gate, _, _ = make_gate()
    w = Worker(gate)

    async def main():
        assert await w.call(False) == 1
        with pytest.raises(RuntimeError, match="lost a rank"):
            await w.call(True)
        assert [x async for x in w.stream(2)] == [0, 1]
        agen = w.stream(5)
        await agen.__anext__()
        await agen.aclose()           # a reader that goes away still leaves the count

    asyncio.run(main())
    assert w.seen == [1, 1, 1, 1, 1] and gate.in_flight == 0


def test_without_a_running_loop_the_exit_is_timed_by_a_thread():
    """A stream finalized off the event loop (garbage collected) still schedules the exit."""
    import threading
    exited = threading.Event()
    gate = ExitGate(70, exit_fn=lambda code: exited.set(), flush_s=0.0, max_wait_s=60.0)
    gate.request_exit("engine dead")
    assert exited.wait(10)


def test_every_serving_method_of_the_worker_is_counted():
    """A method that serves a request but is not counted could lose its reply to the exit;
    only the router's own polls (identity, gauges, events) and the cache flush stay out."""
    from nibble.services.disagg.worker import EngineWorker
    public = {n for n, f in vars(EngineWorker).items() if not n.startswith("_") and
              (inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f))}
    counted = {n for n in public if hasattr(getattr(EngineWorker, n), "__wrapped__")}
    assert public - counted == {"info", "stats", "kv_events", "flush_cache", "abort_all"}
    assert counted == {"abort", "reserve", "extend_lease", "cancel", "decode", "generate",
                       "prefill"}
