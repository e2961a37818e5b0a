"""``/openapi.json`` as the gateway really answers: statuses, bodies and this server's limits.

FastAPI's generated schema says every route answers 200 or 422, with any JSON.
The gateway answers 400 (not 422) for invalid requests and OpenAI's error body
for every failure (errors.py), streams SSE when asked, serves Prometheus text on
/metrics, and refuses max_tokens or token ids that this model cannot take. The
schema is patched once, on first request, so that a schema-driven client (the
schemathesis run in tests/e2e) can hold the server to it:

- every operation documents the error statuses any route may give (401/403 from
  the auth middleware, 413 from the body limit, 500, 503), plus 400 where it
  validates input and 404 where it looks something up, all with ``OpenAIError``;
- 200 bodies of the generation and model routes are described (JSON or SSE);
- prompt token ids are below the vocabulary size, when the engine tells it. (Whether
  prompt + max_tokens fit the context depends on the tokenized prompt, which no
  schema can say: that 400 carries the code ``context_length_exceeded``.)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ..frontend.protocol import MAX_CHOICES

ERROR_REF = {"$ref": "#/components/schemas/OpenAIError"}
NULLABLE_STR = {"anyOf": [{"type": "string"}, {"type": "null"}]}
OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": NULLABLE_STR,
                       "code": {"anyOf": [{"type": "string"}, {"type": "integer"},
                                          {"type": "null"}]}}}},
}
COMMON_ERRORS = (401, 403, 413, 500, 503)
EXTRA_ERRORS = {("post", "/v1/completions"): (400, 404),
                ("post", "/v1/chat/completions"): (400, 404),
                ("get", "/v1/models/{model_id}"): (404,),
                ("post", "/abort_request"): (400, 404),
                ("post", "/flush_cache"): (400,)}
REASONS = {400: "Invalid request", 401: "Missing or wrong API key", 403: "Not allowed",
           404: "Not found", 413: "Request body too large", 500: "Server error",
           503: "Busy, unhealthy or shutting down; retry"}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0}
                         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH = {"enum": ["stop", "length", "abort", "tool_calls", None]}
_INDEX = {"type": "integer", "minimum": 0, "maximum": MAX_CHOICES - 1}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"],
              "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                             "function": {"type": "object", "required": ["name", "arguments"],
                                          "properties": {"name": {"type": "string"},
                                                         "arguments": {"type": "string"}}}}}


def _envelope(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "minItems": 1,
                                       "maxItems": MAX_CHOICES,
                                       "items": choice},
                           "usage": _USAGE}}


COMPLETION = _envelope("text_completion", {
    "type": "object", "required": ["index", "text", "finish_reason"],
    "properties": {"index": _INDEX, "text": {"type": "string"}, "finish_reason": _FINISH}})
CHAT_COMPLETION = _envelope("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason"],
    "properties": {"index": _INDEX, "finish_reason": _FINISH, "message": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                       "tool_calls": {"type": "array", "items": _TOOL_CALL}}}}})
MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by"],
              "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                             "created": {"type": "integer"}, "owned_by": {"type": "string"},
                             "max_model_len": {"type": "integer"}}}
# OpenAPI 3.1: the schema of a text/event-stream describes one event.
SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}
OK_BODIES = {
    ("post", "/v1/completions"): {"application/json": {"schema": COMPLETION}, **SSE},
    ("post", "/v1/chat/completions"): {"application/json": {"schema": CHAT_COMPLETION}, **SSE},
    ("get", "/v1/models"): {"application/json": {"schema": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": MODEL_CARD}}}}},
    ("get", "/v1/models/{model_id}"): {"application/json": {"schema": MODEL_CARD}},
    ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}},
                          "application/openmetrics-text": {"schema": {"type": "string"}}},
    ("get", "/health"): {"application/json": {"schema": {
        "type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}}},
}
# /abort_request takes exactly one of {"rid": ...} and {"abort_all": true}.
ABORT_BODY = {"oneOf": [
    {"required": ["rid"], "properties": {"rid": {"type": "string"},
                                         "abort_all": {"const": False}}},
    {"required": ["abort_all"], "properties": {"abort_all": {"const": True},
                                               "rid": {"type": "null"}}}]}


def _patch_responses(method: str, path: str, op: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    codes = set(COMMON_ERRORS) | set(EXTRA_ERRORS.get((method, path), ()))
    if responses.pop("422", None) is not None:    # validation errors are 400 here (errors.py)
        codes.add(400)
    for code in sorted(codes):
        responses[str(code)] = {"description": REASONS[code],
                                "content": {"application/json": {"schema": ERROR_REF}}}
    if path == "/health":            # unhealthy: {"status": ...}, not an error body
        responses["503"] = {"description": REASONS[503], "content": {"application/json": {
            "schema": {"type": "object"}}}}
    ok = OK_BODIES.get((method, path))
    if ok is not None:
        responses.setdefault("200", {"description": "OK"})["content"] = ok


def _cap_integers(node: Any, maximum: int) -> None:
    """Set ``maximum`` on every integer schema under ``node``."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = maximum
        for value in node.values():
            _cap_integers(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _cap_integers(value, maximum)


def _server_limits(schemas: dict[str, Any], engine: Any) -> None:
    """This server's bounds: prompt token ids in the vocabulary."""
    vocab = getattr(getattr(engine, "tokenizer", None), "vocab_size", None)
    prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt")
    if isinstance(vocab, int) and vocab > 0 and prompt is not None:
        _cap_integers(prompt, vocab - 1)


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["OpenAIError"] = OPENAI_ERROR
    if "AbortRequestBody" in schemas:
        schemas["AbortRequestBody"].update(ABORT_BODY)
    _server_limits(schemas, getattr(app.state, "engine", None))
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            _patch_responses(method, path, op)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve the patched schema at /openapi.json (built once, on first request)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
