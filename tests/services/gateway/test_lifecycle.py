"""How ``nibble serve`` ends: a signal drains and exits 0, a second one forces the exit, a
dead engine exits 1 (in-process, fake engine, fake uvicorn server, stepped clock)."""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace

from nibble.services.frontend.drain import Drain
from nibble.services.gateway.lifecycle import EXIT_ENGINE_DEAD, EXIT_OK, ServeLifecycle
from nibble.services.frontend.tracking import InFlight


class StepClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        await asyncio.sleep(0)


class FakeGrpc:
    def __init__(self) -> None:
        self.stopped_with: float | None = None

    async def stop(self, grace: float) -> None:
        self.stopped_with = grace


def lifecycle(engine, timeout: float = 30.0):
    server = SimpleNamespace(should_exit=False, force_exit=False)
    drain = Drain(InFlight(), StepClock())
    grpc = FakeGrpc()
    return ServeLifecycle(server, drain, engine, timeout, grpc, poll_s=0.5), server, grpc


def test_signal_drains_then_exits_0(FakeEngine):
    engine = FakeEngine()
    life, server, grpc = lifecycle(engine)

    async def main():
        task = asyncio.ensure_future(life.run())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not server.should_exit and not life.drain.draining
        life.on_signal(signal.SIGTERM)
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert life.exit_code == EXIT_OK and server.should_exit and not server.force_exit
    assert life.drain.draining and grpc.stopped_with is not None


def test_second_signal_forces(FakeEngine):
    life, server, _ = lifecycle(FakeEngine())
    life.drain.inflight.track("stuck", None)      # never finishes: the drain would wait 30 s
    life.on_signal(signal.SIGTERM)
    life.on_signal(signal.SIGINT)
    assert server.force_exit and server.should_exit

    async def main():
        await asyncio.wait_for(life.run(), 5)

    asyncio.run(main())
    assert life.drain.clock.now() < 30.0           # cut at once, not after the timeout
    assert life.drain.inflight.marked == {"stuck"}


def test_dead_engine_exits_1(FakeEngine, caplog):
    engine = FakeEngine()
    engine.dead_reason = "engine stopped after a device fault: RuntimeError: CUDA error"
    life, server, grpc = lifecycle(engine)

    async def main():
        task = asyncio.ensure_future(life.run())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()                     # healthy: nothing happens
        engine.healthy = False
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert life.exit_code == EXIT_ENGINE_DEAD and server.should_exit
    assert life.drain.draining and grpc.stopped_with is not None
    assert "device fault" in caplog.text and "exiting with status 1" in caplog.text


def test_engine_dying_during_the_drain_exits_1(FakeEngine):
    engine = FakeEngine()
    life, server, _ = lifecycle(engine)
    life.drain.inflight.track("r1", None)
    life.drain.clock.sleep = _dies_after(engine, life.drain.clock.sleep)
    life.on_signal(signal.SIGTERM)
    asyncio.run(asyncio.wait_for(life.run(), 5))
    assert life.exit_code == EXIT_ENGINE_DEAD and server.should_exit


def _dies_after(engine, sleep):
    async def dying_sleep(seconds: float) -> None:
        engine.healthy = False
        await sleep(seconds)
    return dying_sleep


def test_a_raising_health_check_counts_as_dead(FakeEngine):
    engine = FakeEngine()
    engine.is_healthy = lambda: 1 / 0
    life, server, _ = lifecycle(engine)
    asyncio.run(asyncio.wait_for(life.run(), 5))
    assert life.exit_code == EXIT_ENGINE_DEAD
