"""AsyncEngine on a real engine thread: fault isolation, a dead device, the queue gate.

Finding 2 (only a device fault ends everything, and then health says so) and
finding 9 (``--max-queued-requests`` counts the requests that really wait) of
issue 14. The engine thread is held with a blocking ``call`` where a test needs
it to stand still; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import threading

from nibble.services.engine.types import GenerateRequest, SamplingParams
from nibble.services.errors import EngineDeadError, QueueFullError

from .conftest import make_engine
from .faulty import async_engine, collect, inject
from .test_engine import PROMPT, greedy


def _hold(engine):
    """Park the engine thread in a ``call`` until ``release`` is set; ``parked`` is set once
    it is there. Returns ``(release, parked, task)``."""
    release, parked = threading.Event(), threading.Event()

    def park():
        parked.set()
        release.wait(30)
    return release, parked, asyncio.ensure_future(engine.call(park))


def test_one_bad_request_in_a_batch_fails_alone(fp32_model):
    async def main():
        eng = async_engine(make_engine(fp32_model))
        try:
            inject(eng.core, raise_for={"bad"})
            release, _, held = _hold(eng)
            reqs = [greedy("a", PROMPT[:20], n=5), greedy("bad", PROMPT[20:45], n=5),
                    greedy("b", PROMPT[45:70], n=5)]
            tasks = [asyncio.ensure_future(collect(eng, r)) for r in reqs]
            asyncio.get_running_loop().call_soon(release.set)   # after every submission
            await held
            a, bad, b = await asyncio.gather(*tasks)
            assert [len(o.new_token_ids) for o in a] == [1] * 5 and a[-1].error is None
            assert [len(o.new_token_ids) for o in b] == [1] * 5 and b[-1].error is None
            assert len(bad) == 1 and bad[0].error_type == "RequestFaultError"
            assert eng.is_healthy() and eng.dead_reason is None
        finally:
            await eng.shutdown()
    asyncio.run(main())


def test_a_device_fault_fails_everything_and_turns_health_off(fp32_model):
    async def main():
        eng = async_engine(make_engine(fp32_model))
        try:
            inject(eng.core, raise_for={"b"}, exc=RuntimeError(
                "CUDA error: an illegal memory access was encountered"))
            release, _, held = _hold(eng)
            reqs = [greedy(r, PROMPT[10 * i:10 * i + 20], n=5) for i, r in enumerate("abc")]
            tasks = [asyncio.ensure_future(collect(eng, r)) for r in reqs]
            asyncio.get_running_loop().call_soon(release.set)
            await held
            for outs in await asyncio.gather(*tasks):
                assert outs[-1].finished and outs[-1].error_type == "DeviceFaultError"
            assert not eng.is_healthy() and "illegal memory access" in eng.dead_reason
            late = await collect(eng, greedy("late", PROMPT[:10]))
            assert isinstance(late, EngineDeadError)
            # A submission that raced past the health check is answered, not left hanging.
            raced = eng._stream("raced", ("add", greedy("raced", PROMPT[:10])))
            out = [o async for o in raced]
            assert out[-1].error_type == "EngineDeadError"
        finally:
            await eng.shutdown()
    asyncio.run(main())


def test_max_queued_requests_0_admits_a_request_on_an_idle_server(fp32_model):
    async def main():
        eng = async_engine(make_engine(fp32_model), max_queued_requests=0)
        try:
            outs = await collect(eng, greedy("only", PROMPT[:12], n=3))
            assert not isinstance(outs, Exception), outs
            assert outs[-1].finished and outs[-1].error is None
        finally:
            await eng.shutdown()
    asyncio.run(main())


def test_a_burst_fills_the_running_slots_and_the_queue(fp32_model):
    """2 running slots + 2 queue slots: a burst of 12 on an idle server admits 4."""
    async def main():
        eng = async_engine(make_engine(fp32_model, max_running_requests=2),
                           max_running_requests=2, max_queued_requests=2)
        try:
            release, _, held = _hold(eng)          # the engine admits nothing during the burst
            sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            tasks = [asyncio.ensure_future(collect(eng, GenerateRequest(
                f"q{i}", PROMPT[i:i + 12], sp))) for i in range(12)]
            asyncio.get_running_loop().call_soon(release.set)
            await held
            results = await asyncio.gather(*tasks)
            served = [r for r in results if not isinstance(r, Exception)]
            refused = [r for r in results if isinstance(r, QueueFullError)]
            assert (len(served), len(refused)) == (4, 8)
            assert all(r[-1].error is None and len(r) == 3 for r in served)
            assert eng.gate.counts() == (0, 0, 0)
            # Capacity is back: the next burst is admitted again.
            again = await asyncio.gather(*(collect(eng, GenerateRequest(f"z{i}", PROMPT[:9], sp))
                                           for i in range(3)))
            assert not any(isinstance(r, Exception) for r in again)
        finally:
            await eng.shutdown()
    asyncio.run(main())


def test_a_running_request_does_not_count_as_queued(fp32_model):
    """One request running (engine parked mid-stream) and --max-queued-requests 1: one
    more is admitted to wait, the next is refused."""
    async def main():
        eng = async_engine(make_engine(fp32_model, max_running_requests=1),
                           max_running_requests=1, max_queued_requests=1)
        try:
            sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            gen = eng.generate(GenerateRequest("run", PROMPT[:12], sp))
            first = await gen.__anext__()               # it is running now
            release, parked, held = _hold(eng)
            await asyncio.to_thread(parked.wait, 30)
            assert first.new_token_ids and eng.gate.counts() == (0, 1, 0)
            waiting = asyncio.ensure_future(collect(eng, GenerateRequest("wait", PROMPT[:8], sp)))
            refused = asyncio.ensure_future(collect(eng, GenerateRequest("no", PROMPT[:8], sp)))
            asyncio.get_running_loop().call_soon(release.set)
            await held
            assert isinstance(await refused, QueueFullError)
            await gen.aclose()                          # abort the running one
            assert (await waiting)[-1].error is None
        finally:
            await eng.shutdown()
    asyncio.run(main())


def test_an_idle_engine_takes_back_the_pages_its_backups_held(bf16_model, tmp_path):
    """A write-through backup pins its L1 pages until the tier worker is done; the engine
    must apply that on its own when no request comes after (no next step), or the pages
    stay in use forever on an idle server (the soak bench's leak)."""
    from .test_tiers import tiered_engine

    async def main():
        core = tiered_engine(bf16_model, tmp_path, storage=False)
        eng = async_engine(core)
        try:
            # 62 prompt tokens + 4 generated: the 4th page fills on the last step, so its
            # backup starts after the engine's last poll
            outs = await collect(eng, greedy("a", PROMPT[:62], n=4))
            assert outs[-1].finished and outs[-1].error is None
            worker = core.tiers.worker
            for _ in range(2000):                       # wait (bounded) for the copy itself
                if not worker.busy():
                    break
                await asyncio.sleep(0.005)
            assert not worker.busy()
            await eng.call(lambda: None)                # one idle loop turn after the copy
            await eng.call(lambda: None)
            alloc = core.pool.allocator
            assert await eng.call(lambda: alloc.num_free) == core.pool.num_pages
        finally:
            await eng.shutdown()
    asyncio.run(main())
