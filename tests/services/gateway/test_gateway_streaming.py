"""SSE streaming: OpenAI's exact chunk schema, include_usage, [DONE], in-band errors."""

from __future__ import annotations

import json

from nibble.services.errors import EngineDeadError


def sse_events(client, path: str, body: dict) -> list:
    """POST a streaming request; return the decoded ``data:`` payloads ([DONE] as a str)."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_chat_stream_chunk_schema(client, engine):
    events = sse_events(client, "/v1/chat/completions", CHAT)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "system_fingerprint", "choices"}
        assert c["object"] == "chat.completion.chunk" and c["model"] == "fake-model"
        assert len(c["choices"]) == 1
        assert set(c["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "H"}, {"content": "e"},
                      {"content": "l"}, {}]
    assert reasons == [None, None, None, None, "length"]
    assert engine.aborted == []


def test_completion_stream_chunk_schema(client, engine):
    events = sse_events(client, "/v1/completions", {"prompt": "x", "max_tokens": 20})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert all("usage" not in c for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "Hello, world!"
    assert chunks[-1]["choices"] == [{"index": 0, "text": "", "logprobs": None,
                                      "finish_reason": "stop"}]


def test_include_usage_final_chunk(FakeEngine, make_client):
    client = make_client(FakeEngine(cached_tokens=1))
    body = {**CHAT, "stream_options": {"include_usage": True}}
    events = sse_events(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert all(c["usage"] is None for c in chunks)          # OpenAI: null on every other chunk
    assert last["choices"] == []
    prompt_len = len("<user>hi\n<assistant>")
    assert last["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3,
                             "total_tokens": prompt_len + 3,
                             "prompt_tokens_details": {"cached_tokens": 1}}


def test_include_usage_on_completions(client):
    events = sse_events(client, "/v1/completions", {
        "prompt": "ab", "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] == 4


def test_stream_options_ignored_without_stream(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 4


def test_engine_error_output_mid_stream_is_reported_in_band(FakeEngine, make_client):
    engine = FakeEngine(error_after=(2, "kv pool corrupted"))
    events = sse_events(make_client(engine), "/v1/completions", {"prompt": "x", "max_tokens": 9})
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "kv pool corrupted"
    assert events[-2]["error"]["type"] == "server_error"
    assert engine.aborted == []        # the engine already finished it


def test_engine_exception_mid_stream_aborts_and_reports(FakeEngine, make_client):
    engine = FakeEngine(raise_after=(2, EngineDeadError("engine loop died")))
    client = make_client(engine)
    events = sse_events(client, "/v1/completions", {"prompt": "x", "max_tokens": 9})
    assert events[-2]["error"]["message"] == "engine loop died"
    assert events[-2]["error"]["code"] == "EngineDeadError"
    assert engine.aborted == [engine.requests[-1].request_id]
    engine.raise_after = None           # the server still serves
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_unexpected_exception_mid_stream(FakeEngine, make_client):
    engine = FakeEngine(raise_after=(1, ValueError("bug")))
    events = sse_events(make_client(engine), "/v1/chat/completions", CHAT)
    assert "bug" in events[-2]["error"]["message"]
    assert engine.aborted == [engine.requests[-1].request_id]


def test_streamed_text_equals_full_text(client):
    full = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 30}).json()
    events = sse_events(client, "/v1/chat/completions", {**CHAT, "max_tokens": 30})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1])
    assert text == full["choices"][0]["message"]["content"] == "Hello, world!"
