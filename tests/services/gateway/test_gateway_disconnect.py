"""A client that goes away mid-request gets its request aborted in the engine.

The app is driven as a raw ASGI callable so the test controls exactly when the
client's ``http.disconnect`` arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import pytest

from nibble.services.gateway import create_app

USER = [{"role": "user", "content": "hi"}]


async def call_app(app, path: str, body: dict, disconnect_after: float | None,
                   spec_version: str = "2.3", send_fails_after_disconnect: bool = False) -> list:
    """Run one request; the client disconnects ``disconnect_after`` s after sending it."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone = asyncio.Event()
    sent: list[dict] = []

    async def receive():
        if pending:
            return pending.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def hang_up():
        await asyncio.sleep(disconnect_after)
        gone.set()

    async def send(message):
        if gone.is_set() and send_fails_after_disconnect:
            raise OSError("connection reset")
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80)}
    timer = asyncio.create_task(hang_up()) if disconnect_after is not None else None
    with contextlib.suppress(Exception):    # a server may see the failed send as an error
        await asyncio.wait_for(app(scope, receive, send), timeout=5)
    if timer is not None:
        timer.cancel()
    return sent


def body_text(sent: list) -> str:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 10, "stream": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10, "stream": True}),
])
def test_disconnect_mid_stream_aborts(FakeEngine, path, body):
    engine = FakeEngine(hang_after=3)        # 3 tokens out, then waits forever
    t0 = time.monotonic()
    sent = asyncio.run(call_app(create_app(engine), path, body, disconnect_after=0.2))
    assert time.monotonic() - t0 < 2.0
    rid = engine.requests[0].request_id
    assert engine.aborted == [rid]
    assert sent[0]["status"] == 200
    assert "[DONE]" not in body_text(sent)


def test_disconnect_mid_stream_when_send_fails(FakeEngine):
    """Servers on ASGI spec 2.4 report a disconnect only by failing the next send."""
    engine = FakeEngine(delay=0.05)
    body = {"prompt": "x", "max_tokens": 10, "stream": True}
    asyncio.run(call_app(create_app(engine), "/v1/completions", body, disconnect_after=0.12,
                         spec_version="2.4", send_fails_after_disconnect=True))
    assert engine.aborted == [engine.requests[0].request_id]


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_first_token_aborts(FakeEngine, caplog, stream):
    engine = FakeEngine(hang_after=0)        # no output at all until aborted
    body = {"messages": USER, "max_tokens": 10, "stream": stream}
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR):
        sent = asyncio.run(call_app(create_app(engine), "/v1/chat/completions", body, 0.1))
    assert time.monotonic() - t0 < 2.0       # noticed at once, not at the 5 s test timeout
    assert engine.aborted == [engine.requests[0].request_id]
    assert all(m.get("status") not in (200, 500) for m in sent)
    # Closing the engine stream while its cancelled read was still running raised
    # "aclose(): asynchronous generator is already running": a 500 and a traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 10}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10}),
])
def test_disconnect_non_streaming_aborts(FakeEngine, path, body):
    engine = FakeEngine(hang_after=2)
    t0 = time.monotonic()
    sent = asyncio.run(call_app(create_app(engine), path, body, disconnect_after=0.1))
    assert time.monotonic() - t0 < 2.0
    assert engine.aborted == [engine.requests[0].request_id]
    assert all(m.get("status") != 200 for m in sent)


@pytest.mark.parametrize("stream", [False, True])
def test_completed_request_is_not_aborted(FakeEngine, stream):
    engine = FakeEngine()
    body = {"prompt": "x", "max_tokens": 5, "stream": stream}
    sent = asyncio.run(call_app(create_app(engine), "/v1/completions", body, None))
    assert sent[0]["status"] == 200
    assert engine.aborted == []
    text = body_text(sent)
    assert ("[DONE]" in text) if stream else json.loads(text)["choices"][0]["text"] == "Hello"


def test_server_keeps_serving_after_disconnects(FakeEngine):
    engine = FakeEngine(hang_after=1)
    app = create_app(engine)

    async def scenario():
        body = {"prompt": "x", "max_tokens": 5, "stream": True}
        await asyncio.gather(*(call_app(app, "/v1/completions", body, 0.05) for _ in range(5)))
        engine.hang_after = None
        return await call_app(app, "/v1/completions", {"prompt": "x", "max_tokens": 2}, None)

    sent = asyncio.run(scenario())
    assert len(engine.aborted) == 5 and len(set(engine.aborted)) == 5
    assert json.loads(body_text(sent))["choices"][0]["text"] == "He"
