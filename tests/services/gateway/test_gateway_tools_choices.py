"""Tool calls, n choices and echo through the gateway (scripted engine: the reply is fixed)."""

from __future__ import annotations

import json

import pytest

from .test_gateway_streaming import sse_events

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n' \
       '</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
       "max_tokens": 200}


@pytest.fixture
def caller(FakeEngine, make_client):  # noqa: N803
    engine = FakeEngine(reply=CALL, context_length=4096)
    return engine, make_client(engine)


def test_a_call_in_the_output_becomes_tool_calls(caller):
    engine, client = caller
    r = client.post("/v1/chat/completions", json=ASK)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    # the model saw its tool: the template got the description
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt


def test_streamed_calls_send_the_name_then_argument_fragments(caller):
    _, client = caller
    events = sse_events(client, "/v1/chat/completions", ASK)
    assert events[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in events[:-1]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert len(calls) > 3 and all("name" not in c["function"] for c in calls[1:])
    args = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(args) == {"city": "Paris", "days": [1, 2]}
    assert not any(d.get("content") for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_the_same_text_is_content(caller):
    _, client = caller
    r = client.post("/v1/chat/completions", json={**ASK, "tools": None})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    r = client.post("/v1/chat/completions", json={**ASK, "tool_choice": "none"})
    assert r.json()["choices"][0]["message"]["content"] == CALL


def test_malformed_call_is_returned_as_content(FakeEngine, make_client):  # noqa: N803
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    client = make_client(FakeEngine(reply=bad, context_length=4096))
    r = client.post("/v1/chat/completions", json=ASK)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == bad and choice["finish_reason"] == "stop"


def test_n_choices_share_one_prompt_and_sum_usage(FakeEngine, make_client):  # noqa: N803
    engine = FakeEngine(reply="abc", context_length=4096)
    client = make_client(engine)
    r = client.post("/v1/completions", json={"prompt": "hello", "n": 3, "seed": 7,
                                              "max_tokens": 5})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == "abc" for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 9
    ids = [q.request_id for q in engine.requests]
    assert ids[1:] == [f"{ids[0]}-1", f"{ids[0]}-2"]
    assert [q.sampling.seed for q in engine.requests] == [7, 8, 9]


def test_n_choices_stream_with_their_indexes(FakeEngine, make_client):  # noqa: N803
    client = make_client(FakeEngine(reply="xy", context_length=4096))
    events = sse_events(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 5,
        "stream_options": {"include_usage": True}})
    chunks = [e for e in events[:-1] if e["choices"]]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(m["delta"].get("content", "") for m in mine) == "xy"
        assert [m["finish_reason"] for m in mine][-1] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == 4


def test_echo_puts_the_prompt_first(FakeEngine, make_client):  # noqa: N803
    client = make_client(FakeEngine(reply="!", context_length=4096))
    r = client.post("/v1/completions", json={"prompt": "hello", "echo": True, "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "hello!"
    events = sse_events(client, "/v1/completions", {"prompt": "hey", "echo": True,
                                                    "max_tokens": 2})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "hey!"
