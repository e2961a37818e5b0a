"""Every route of the gateway with non-streaming requests, against the fake engine."""

from __future__ import annotations

import re

import pytest

from nibble.services.engine.types import SamplingParams


def test_models_lists_the_served_model(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake-model"]
    card = body["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "nibble"
    assert card["max_model_len"] == 64 and isinstance(card["created"], int)
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert client.get("/v1/models/other").status_code == 404


def test_health_follows_the_engine(client, engine):
    assert client.get("/health").status_code == 200
    engine.healthy = False
    assert client.get("/health").status_code == 503


def test_health_is_503_when_the_check_raises(client, engine):
    def boom():
        raise RuntimeError("dead")
    engine.is_healthy = boom
    assert client.get("/health").status_code == 503


def test_server_info_is_the_engines(client):
    r = client.get("/get_server_info")
    assert r.status_code == 200
    assert r.json()["kv_pool"] == {"free_pages": 10, "total_pages": 10}


def test_completion_full_schema(client, engine):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "abc",
                                             "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "text_completion"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.requests[-1].prompt_token_ids == [97, 98, 99]
    assert engine.requests[-1].request_id == body["id"]
    assert engine.aborted == []


def test_chat_full_schema(client, engine):
    r = client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "system", "content": "s"},
                                            {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello, world!", "refusal": None}
    assert choice["finish_reason"] == "stop" and choice["index"] == 0
    prompt = "<system>s\n<user>hi\n<assistant>"
    assert engine.requests[-1].prompt_token_ids == [ord(c) for c in prompt]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == 13
    assert body["usage"]["total_tokens"] == len(prompt) + 13


def test_chat_content_parts_and_developer_role(client, engine):
    msgs = [{"role": "developer", "content": "d"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]
    r = client.post("/v1/chat/completions", json={"messages": msgs})
    assert r.status_code == 200, r.text
    prompt = "<system>d\n<user>a\nb\n<assistant>"
    assert engine.requests[-1].prompt_token_ids == [ord(c) for c in prompt]


@pytest.mark.parametrize("prompt, ids", [
    ("xy", [120, 121]),
    ([5, 6, 7], [5, 6, 7]),
    (["xy"], [120, 121]),
    ([[5, 6]], [5, 6]),
])
def test_completion_prompt_forms(client, engine, prompt, ids):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == ids


def test_sampling_parameters_are_mapped(client, engine):
    r = client.post("/v1/completions", json={
        "prompt": "p", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "seed": 123, "stop": ["\n", "", "END"], "ignore_eos": True, "stop_token_ids": [2],
        "presence_penalty": 0.0, "some_unknown_field": {"x": 1}})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].sampling == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=123, stop=("\n", "END"),
        stop_token_ids=(2,), ignore_eos=True)


def test_defaults_and_null_fields(client, engine):
    r = client.post("/v1/completions", json={"prompt": "abcd", "temperature": None,
                                             "top_p": None, "stop": "x", "top_k": 0, "n": 1})
    assert r.status_code == 200, r.text
    s = engine.requests[-1].sampling
    assert s.max_tokens == 64 - 4          # absent max_tokens fills the context
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (1.0, 1.0, -1, None, ("x",))


def test_max_completion_tokens_wins(client, engine):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "q"}], "max_tokens": 9,
        "max_completion_tokens": 3})
    assert r.status_code == 200
    assert engine.requests[-1].sampling.max_tokens == 3
    assert r.json()["choices"][0]["message"]["content"] == "Hel"


def test_request_ids_are_unique(client, engine):
    ids = {client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).json()["id"]
           for _ in range(20)}
    assert len(ids) == 20
    assert {r.request_id for r in engine.requests} == ids


def test_cached_tokens_are_reported(FakeEngine, make_client):
    client = make_client(FakeEngine(cached_tokens=2))
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_cache_salt_is_passed_through(client, engine):
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "cache_salt": "t1"})
    assert engine.requests[-1].cache_salt == "t1"


def test_prompt_filling_the_context_exactly_is_accepted(client, engine):
    r = client.post("/v1/completions", json={"prompt": "a" * 60, "max_tokens": 4})
    assert r.status_code == 200, r.text
