"""Admin routes: /flush_cache, /abort_request, /get_server_info, /health; queue full -> 503.

Requests that must stay open while an admin call arrives run concurrently in one
event loop through httpx's ASGI transport (which returns a response once it is
complete, so a stream is read whole after it ended).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from nibble.services.config import ServerConfig
from nibble.services.errors import QueueFullError
from nibble.services.gateway import create_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
COMPLETION = {"prompt": "ab", "max_tokens": 10}


def sse_payloads(text: str) -> list:
    blocks = [b for b in text.split("\n\n") if b]
    out = []
    for b in blocks:
        assert b.startswith("data: "), b
        data = b[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def run_with_hanging(engine, n: int, admin_call, stream: bool = True, path="/v1/chat/completions",
                     body=CHAT):
    """Start ``n`` requests that hang in the engine, then ``admin_call(client)``; returns
    (admin response, [responses of the n requests])."""
    app = create_app(engine, ServerConfig())

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=10) as c:
            tasks = [asyncio.create_task(c.post(path, json={**body, "stream": stream}))
                     for _ in range(n)]
            await wait_for(lambda: len(engine.hanging) == n)
            admin = await admin_call(c)
            done = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
            return admin, done

    return asyncio.run(main())


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", COMPLETION)])
def test_abort_by_rid_ends_the_stream_with_abort(FakeEngine, path, body):
    engine = FakeEngine(hang_after=2)

    async def abort(c):
        (rid,) = engine.active
        return await c.post("/abort_request", json={"rid": rid})

    admin, (resp,) = run_with_hanging(engine, 1, abort, path=path, body=body)
    assert admin.status_code == 200 and admin.json() == {"success": True, "num_aborted": 1}
    assert resp.status_code == 200
    events = sse_payloads(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert chunks[0]["id"] == engine.requests[0].request_id
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
                   or "" for c in chunks)
    assert text == "He"                       # the two tokens before the hang
    assert engine.aborted == [engine.requests[0].request_id]


def test_abort_non_streaming_returns_abort(FakeEngine):
    engine = FakeEngine(hang_after=1)

    async def abort(c):
        return await c.post("/abort_request", json={"rid": next(iter(engine.active))})

    admin, (resp,) = run_with_hanging(engine, 1, abort, stream=False)
    assert admin.status_code == 200
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["message"]["content"] == "H"


def test_abort_all_ends_every_stream(FakeEngine):
    engine = FakeEngine(hang_after=1)

    async def abort_all(c):
        return await c.post("/abort_request", json={"abort_all": True})

    admin, resps = run_with_hanging(engine, 3, abort_all)
    assert admin.status_code == 200 and admin.json()["num_aborted"] == 3
    for r in resps:
        chunks = sse_payloads(r.text)[:-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests)


def test_abort_all_when_idle(client, engine):
    r = client.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 200 and r.json() == {"success": True, "num_aborted": 0}


def test_abort_unknown_rid_is_404(client, engine):
    client.post("/v1/completions", json=COMPLETION)           # finished: no longer in flight
    for rid in ("chatcmpl-nope", engine.requests[0].request_id):
        r = client.post("/abort_request", json={"rid": rid})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "request_not_found" and rid in err["message"]
    assert engine.aborted == []


@pytest.mark.parametrize("body", [{}, {"abort_all": False}, {"rid": "x", "abort_all": True},
                                  {"rid": 5}, {"abort_all": "maybe"}])
def test_abort_bad_body_is_400(client, engine, body):
    r = client.post("/abort_request", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert engine.aborted == []


def test_flush_cache_when_idle(client, engine):
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    assert engine.flushes == 1


def test_flush_cache_is_post_only(client, engine):
    assert client.get("/flush_cache").status_code == 405
    assert engine.flushes == 0


def test_flush_cache_while_running_is_400_and_changes_nothing(FakeEngine):
    engine = FakeEngine(hang_after=1)

    async def flush_then_abort(c):
        r = await c.post("/flush_cache")
        await c.post("/abort_request", json={"abort_all": True})
        return r

    admin, (resp,) = run_with_hanging(engine, 1, flush_then_abort)
    assert admin.status_code == 400
    err = admin.json()["error"]
    assert err["code"] == "requests_running" and "running" in err["message"]
    assert engine.flushes == 0
    assert resp.status_code == 200


def test_get_server_info_and_health(client, engine):
    info = client.get("/get_server_info")
    assert info.status_code == 200 and info.json()["model"] == "fake-model"
    assert client.get("/health").json() == {"status": "ok"}
    engine.healthy = False
    assert client.get("/health").status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_503_with_retry_after(FakeEngine, make_client, stream):
    engine = FakeEngine(raise_before=QueueFullError("the request queue is full (max 4)"))
    r = make_client(engine).post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "QueueFullError" and "queue is full" in err["message"]
