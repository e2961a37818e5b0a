"""The SIGTERM drain over HTTP, on the fake engine, with an injected clock: new requests get
503 with Retry-After, /health 503, running requests finish within the timeout, the rest end
with an error event and [DONE] (non-streaming: 503)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from nibble.services.config import ServerConfig
from nibble.services.errors import ServerDrainingError
from nibble.services.gateway import create_app
from nibble.services.frontend.drain import Drain
from nibble.services.frontend.tracking import InFlight, tracked
from nibble.services.metrics import Metrics

from .conftest import LOCAL

STREAM = {"prompt": "ab", "max_tokens": 8, "stream": True}


class FakeClock:
    """Time moves only when someone sleeps on it; ``at(t, fn)`` runs ``fn`` once at time t."""

    def __init__(self) -> None:
        self.t = 0.0
        self.events: list[tuple[float, object]] = []

    def now(self) -> float:
        return self.t

    def at(self, t: float, fn) -> None:
        self.events.append((t, fn))

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        for event in [e for e in self.events if e[0] <= self.t]:
            self.events.remove(event)
            event[1]()
        await asyncio.sleep(0.001)     # let the requests' tasks run


def sse_events(body: str) -> list[str]:
    return [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def drained_app(engine, clock):
    app = create_app(engine, ServerConfig())
    app.state.drain.clock = clock
    return app


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, client=LOCAL),
                             base_url="http://nibble")


async def assert_refused(client: httpx.AsyncClient) -> None:
    for body in (STREAM, {**STREAM, "stream": False}):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "service_unavailable" and err["code"] == "ServerDrainingError"
        assert "shutting down" in err["message"]
    r = await client.get("/health")
    assert (r.status_code, r.json()) == (503, {"status": "draining"})
    assert (await client.get("/metrics")).status_code == 200
    assert (await client.get("/get_server_info")).status_code == 200


def test_running_stream_is_cut_after_the_timeout(FakeEngine):
    engine, clock = FakeEngine("abcdef", hang_after=2), FakeClock()
    app = drained_app(engine, clock)

    async def main():
        async with client_for(app) as client:
            assert (await client.get("/health")).status_code == 200
            running = asyncio.ensure_future(client.post("/v1/completions", json=STREAM))
            await until(lambda: engine.hanging)
            app.state.drain.begin()
            await assert_refused(client)
            report = await app.state.drain.run(10.0, engine.abort)
            return report, await running

    report, r = asyncio.run(main())
    assert (report.running_at_start, report.cut, report.left) == (1, 1, 0)
    assert 10.0 <= report.seconds < 10.5          # the fake clock: no real waiting
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "ServerDrainingError" and "graceful shutdown timeout" in err["message"]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "ab"
    assert set(engine.aborted) == {engine.requests[0].request_id}   # drain (+ stream guard)
    assert not app.state.inflight and app.state.drain.active_http == 0


def test_requests_that_finish_in_time_are_not_cut(FakeEngine):
    class Gated(FakeEngine):
        """Stops after the first output until ``gate`` opens."""

        async def _outputs(self, req):
            async for out in FakeEngine._outputs(self, req):
                yield out
                if not self.gate.is_set():
                    self.hanging.add(req.request_id)
                    await self.gate.wait()

    engine, clock = Gated("abcdef"), FakeClock()
    app = drained_app(engine, clock)

    async def main():
        engine.gate = asyncio.Event()
        clock.at(3.0, engine.gate.set)          # the request completes 3 s into the drain
        async with client_for(app) as client:
            running = asyncio.ensure_future(
                client.post("/v1/completions", json={**STREAM, "stream": False}))
            await until(lambda: engine.hanging)
            async def never(rid):
                pytest.fail(f"cut {rid}")

            report = await app.state.drain.run(10.0, never)
            return report, await running

    report, r = asyncio.run(main())
    assert (report.running_at_start, report.cut, report.left) == (1, 0, 0)
    assert 3.0 <= report.seconds < 3.5
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0] == {**r.json()["choices"][0], "text": "abcdef",
                                      "finish_reason": "stop"}
    assert engine.aborted == []


def test_non_streaming_request_cut_gets_503(FakeEngine):
    engine, clock = FakeEngine("abcdef", hang_after=1), FakeClock()
    app = drained_app(engine, clock)

    async def main():
        async with client_for(app) as client:
            running = asyncio.ensure_future(
                client.post("/v1/completions", json={**STREAM, "stream": False}))
            await until(lambda: engine.hanging)
            await app.state.drain.run(2.0, engine.abort)
            return await running

    r = asyncio.run(main())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "ServerDrainingError"


def test_force_cuts_at_once(FakeEngine):
    engine, clock = FakeEngine("abcdef", hang_after=1), FakeClock()
    app = drained_app(engine, clock)
    clock.at(0.5, app.state.drain.force)

    async def main():
        async with client_for(app) as client:
            running = asyncio.ensure_future(client.post("/v1/completions", json=STREAM))
            await until(lambda: engine.hanging)
            report = await app.state.drain.run(30.0, engine.abort)
            return report, await running

    report, r = asyncio.run(main())
    assert report.cut == 1 and report.seconds < 1.0
    assert sse_events(r.text)[-1] == "[DONE]"


def test_idle_server_drains_at_once(FakeEngine):
    engine, clock = FakeEngine(), FakeClock()
    app = drained_app(engine, clock)
    report = asyncio.run(app.state.drain.run(30.0, engine.abort))
    assert (report.running_at_start, report.cut, report.seconds) == (0, 0, 0.0)
    assert app.state.drain.draining


def test_after_the_cut_new_streams_fail_at_once():
    inflight = InFlight()
    inflight.track("r1", "t1")
    assert inflight.owned_by("r1", "t1") and not inflight.owned_by("r1", "t2")
    assert not inflight.owned_by("r2", None)
    assert inflight.cut() == ["r1"] and inflight.marked == {"r1"}

    async def source():
        yield None                      # never reached

    async def main():
        gen = tracked(source(), "r2", Metrics().start_request(), inflight)
        with pytest.raises(ServerDrainingError):
            await gen.__anext__()

    asyncio.run(main())
    inflight.untrack("r1")
    assert inflight == set() and not inflight.owners and not inflight.marked
