"""Big inputs: preparation off the event loop, the prompt-length bound, the body limit (413)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from nibble.services.config import ServerConfig
from nibble.services.gateway import create_app
from nibble.services.frontend.prepare import MAX_CHARS_PER_TOKEN

RELEASE_TIMEOUT_S = 5      # only ends a deadlock; the test then fails on the order of events


class BlockingTokenizer:
    """Wraps a tokenizer: ``encode`` of a long text signals ``entered`` and waits for
    ``release``, then records "prepared" in ``order`` (shared with the test)."""

    def __init__(self, inner, order: list[str], min_chars: int = 1000):
        self.inner, self.order, self.min_chars = inner, order, min_chars
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []
        self.vocab_size = inner.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) >= self.min_chars:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            self.release.wait(RELEASE_TIMEOUT_S)
            self.order.append("prepared")
            text = text[:8]
        return self.inner.encode(text, add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def _health_during_preparation(app, tok: BlockingTokenizer, path: str, body: dict):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        big = asyncio.create_task(client.post(path, json=body))
        await asyncio.to_thread(tok.entered.wait, RELEASE_TIMEOUT_S)
        health = await client.get("/health")
        tok.order.append("health")
        tok.release.set()
        return health, await big


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x" * 200_000, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 200_000}],
                              "max_tokens": 1}),
])
def test_health_answers_while_a_huge_prompt_is_prepared(FakeEngine, path, body):
    engine = FakeEngine(context_length=1_000_000)
    order: list[str] = []
    engine.tokenizer = tok = BlockingTokenizer(engine.tokenizer, order)
    health, big = asyncio.run(_health_during_preparation(create_app(engine), tok, path, body))
    assert order == ["health", "prepared"], "the event loop waited for the tokenizer"
    assert health.status_code == 200 and big.status_code == 200, big.text
    assert tok.threads and all(t.startswith("nibble-prepare") for t in tok.threads)


def test_prompt_far_over_the_context_is_refused_before_tokenizing(FakeEngine, make_client):
    engine = FakeEngine(context_length=64)
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, add_special_tokens=False: calls.append(text) or encode(
        text, add_special_tokens)
    client = make_client(engine)
    limit = 64 * MAX_CHARS_PER_TOKEN
    r = client.post("/v1/completions", json={"prompt": "z" * (limit + 1)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    assert str(limit) in err["message"] and "characters" in err["message"]
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "system", "content": "s" * (limit // 2)},
        {"role": "user", "content": [{"type": "text", "text": "u" * (limit // 2 + 1)}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert calls == [] and engine.requests == []
    # At the bound: tokenized, then refused by the exact token count instead.
    r = client.post("/v1/completions", json={"prompt": "z" * limit})
    assert r.json()["error"]["code"] == "context_length_exceeded" and len(calls) == 1
    assert "tokens" in r.json()["error"]["message"]


LIMIT = 2048


@pytest.fixture
def limited(engine, make_client):
    return make_client(engine, ServerConfig(max_request_body_bytes=LIMIT))


def _assert_413(r) -> None:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert str(LIMIT) in err["message"]


def test_declared_body_over_the_limit_is_413(limited, engine):
    body = b'{"prompt": "' + b"a" * LIMIT + b'"}'
    _assert_413(limited.post("/v1/completions", content=body,
                             headers={"content-type": "application/json"}))
    _assert_413(limited.post("/abort_request", content=body,
                             headers={"content-type": "application/json"}))
    assert engine.requests == []
    ok = limited.post("/v1/completions", json={"prompt": "a" * (LIMIT - 100), "max_tokens": 1})
    assert ok.status_code != 413


def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000), "headers": [(b"content-type", b"application/json")]}


async def _send_chunked(app, path: str, chunks: list[bytes]) -> tuple[int, list[dict]]:
    """POST ``chunks`` without a Content-Length; returns (chunks the app pulled, messages sent)."""
    pulled = 0

    async def receive() -> dict:
        nonlocal pulled
        if pulled < len(chunks):
            pulled += 1
            return {"type": "http.request", "body": chunks[pulled - 1],
                    "more_body": pulled < len(chunks)}
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app(_scope(path), receive, send)
    return pulled, sent


def test_streamed_body_over_the_limit_is_413_without_reading_the_rest(engine):
    app = create_app(engine, ServerConfig(max_request_body_bytes=LIMIT))
    chunks = [b'{"prompt": "'] + [b"a" * 1000] * 100 + [b'"}']
    pulled, sent = asyncio.run(_send_chunked(app, "/v1/completions", chunks))
    assert sent[0]["status"] == 413
    crossing = 4                       # 12 + 1000 + 1000 <= LIMIT < 12 + 3 * 1000
    assert pulled == crossing, "read past the chunk that crossed the limit"
    assert b"request_too_large" in b"".join(m.get("body", b"") for m in sent[1:])
    assert engine.requests == []


def test_streamed_body_under_the_limit_is_served(engine):
    app = create_app(engine, ServerConfig(max_request_body_bytes=LIMIT))
    chunks = [b'{"prompt": "', b"a" * 50, b'", "max_tokens": 2}']
    pulled, sent = asyncio.run(_send_chunked(app, "/v1/completions", chunks))
    assert sent[0]["status"] == 200 and pulled == 3
    assert len(engine.requests) == 1
