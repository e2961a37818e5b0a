"""Input the schema calls invalid is refused (400), and what it calls valid is served.

Lone surrogates (JSON ``"\\ud800"``) in any text field, lax coercions (``true`` as a
token id, ``"1"`` as an integer) and values the schema now rules out (``""``
prompts, batches) are 400 with the field named; none reaches the engine or
turns into a 500.
"""

from __future__ import annotations

import json

import pytest

from nibble.services.gateway.errors import error_body

LONE = "\ud800"
USER = [{"role": "user", "content": "hi"}]


def post_raw(client, path: str, body: dict):
    """POST ``body`` as json.dumps writes it (ensure_ascii: a surrogate travels as \\ud800)."""
    return client.post(path, content=json.dumps(body),
                       headers={"content-type": "application/json"})


def assert_400(r, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a" + LONE}, "prompt"),
    ("/v1/completions", {"prompt": [LONE]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "model": LONE}, "model"),
    ("/v1/completions", {"prompt": "a", "stop": LONE}, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["x", LONE]}, "stop"),
    ("/v1/completions", {"prompt": "a", "user": LONE}, "user"),
    ("/v1/completions", {"prompt": "a", "cache_salt": LONE}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok " + LONE}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": LONE, "text": "x"}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": LONE, "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": LONE}]},
     "messages[0].name"),
    ("/v1/chat/completions", {"messages": USER, "model": LONE}, "model"),
    ("/abort_request", {"rid": LONE}, "rid"),
])
def test_lone_surrogate_is_400_naming_the_field(client, engine, path, body, param):
    err = assert_400(post_raw(client, path, body), param)
    assert engine.requests == [] and engine.aborted == []
    err["message"].encode("utf-8")


def test_surrogate_sent_as_raw_bytes_is_400(client, engine):
    # CESU-8 bytes of U+D800: the JSON decoder turns them into a lone surrogate too.
    r = client.post("/v1/completions", content=b'{"prompt": "a\xed\xa0\x80"}',
                    headers={"content-type": "application/json"})
    assert_400(r, "prompt")
    assert engine.requests == []


def test_valid_astral_text_is_served(client, engine):
    r = post_raw(client, "/v1/completions", {"prompt": "emoji \U0001F600", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert engine.requests[0].prompt_token_ids[-1] == 0x1F600


@pytest.mark.parametrize("body, param", [
    ({"prompt": [[False]]}, "prompt"),
    ({"prompt": [True, 5]}, "prompt"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "stream": "true"}, "stream"),
    ({"prompt": "a", "stream": 1}, "stream"),
    ({"prompt": "a", "temperature": "0.5"}, "temperature"),
    ({"prompt": "a", "stop_token_ids": [False]}, "stop_token_ids[0]"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [""]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": "a", "seed": 2**53}, "seed"),
    ({"prompt": "a", "suffix": "x"}, "suffix"),
    ({"prompt": "a", "n": 1.5}, "n"),
])
def test_what_the_schema_rules_out_is_400(client, engine, body, param):
    assert_400(client.post("/v1/completions", json=body), param)
    assert engine.requests == []


@pytest.mark.parametrize("body", [
    {"prompt": "a", "max_tokens": 3.0, "top_k": 2.0, "n": 1.0},   # JSON Schema integers
    {"prompt": [[104, 105]], "seed": -(2**53 - 1)},
    {"prompt": ["hi"], "suffix": "", "echo": False, "best_of": 1, "logprobs": 0},
])
def test_what_the_schema_allows_is_served(client, engine, body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(engine.requests) == 1


def test_unsupported_options_keep_their_message(client):
    err = assert_400(client.post("/v1/completions", json={"prompt": "a", "best_of": 2}),
                     "best_of")
    assert "best_of must be 1" in err["message"]
    err = assert_400(client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        "messages[0].content")
    assert "only 'text' content parts" in err["message"]


def test_error_bodies_always_encode():
    body = error_body("unknown model '" + LONE + "'", "invalid_request_error", "p" + LONE)
    json.dumps(body, ensure_ascii=False).encode("utf-8")
    assert "\\ud800" in body["error"]["message"] and body["error"]["param"] == "p\\ud800"
