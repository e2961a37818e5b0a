"""/openapi.json documents what the gateway really answers (the schemathesis run relies on it)."""

from __future__ import annotations

import jsonschema
import pytest

from nibble.services.config import ServerConfig
from nibble.services.gateway.openapi import OPENAI_ERROR


@pytest.fixture
def schema(client):
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def _ops(schema):
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            yield method, path, op


def test_errors_are_documented_as_openai_errors(schema):
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for method, path, op in _ops(schema):
        responses = op["responses"]
        assert "422" not in responses, (method, path)
        for code in ("401", "403", "413", "500", "503"):
            assert code in responses, (method, path, code)
    ops = {(m, p): op["responses"] for m, p, op in _ops(schema)}
    for key in (("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                ("post", "/abort_request"), ("get", "/kv_events")):
        assert "400" in ops[key], key
    assert "404" in ops[("get", "/v1/models/{model_id}")]
    ref = ops[("post", "/v1/completions")]["400"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/OpenAIError"}


def test_streams_and_metrics_have_their_content_types(schema):
    ok = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "text/plain" in metrics


def test_token_ids_are_bounded_by_the_vocabulary(schema, engine):
    prompt = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    ints = [b["items"] for b in prompt["anyOf"] if b.get("type") == "array"
            and b["items"].get("type") == "integer"]
    assert ints and ints[0]["maximum"] == engine.tokenizer.vocab_size - 1


def _check(schema, method: str, path: str, r) -> None:
    content = schema["paths"][path][method]["responses"][str(r.status_code)]["content"]
    body_schema = content["application/json"]["schema"]
    if "$ref" in body_schema:
        body_schema = OPENAI_ERROR
    jsonschema.validate(r.json(), body_schema)


def test_real_answers_match_their_documentation(FakeEngine, make_client):
    client = make_client(FakeEngine(), ServerConfig(max_request_body_bytes=1024))
    schema = client.get("/openapi.json").json()
    cases = [
        ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("post", "/v1/completions", {"prompt": ""}),                       # 400
        ("post", "/v1/completions", {"prompt": "x", "model": "other"}),    # 404
        ("post", "/v1/completions", {"prompt": "x" * 2000}),               # 413
        ("post", "/abort_request", {"rid": "nope"}),                       # 404
        ("post", "/abort_request", {}),                                    # 400
    ]
    seen = set()
    for method, path, body in cases:
        r = client.post(path, json=body)
        seen.add(r.status_code)
        _check(schema, method, path, r)
    assert seen == {200, 400, 404, 413}
    for path in ("/v1/models", "/v1/models/fake-model", "/health"):
        _check(schema, "get", path if path != "/v1/models/fake-model" else
               "/v1/models/{model_id}", client.get(path))
