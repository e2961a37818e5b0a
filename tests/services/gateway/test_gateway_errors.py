"""Every error case: status code and OpenAI's error body; the server survives each."""

from __future__ import annotations

import pytest

from nibble.services.errors import (EngineDeadError, InvalidRequestError, OutOfPagesError,
                                    QueueFullError)

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def assert_error(r, status: int, err_type: str, param=..., code=...) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == err_type
    if param is not ...:
        assert err["param"] == param
    if code is not ...:
        assert err["code"] == code
    return err


def test_context_overflow_is_400_with_the_numbers(client, engine):
    r = client.post("/v1/completions", json={"prompt": "a" * 60, "max_tokens": 5})
    err = assert_error(r, 400, "invalid_request_error", "prompt", "context_length_exceeded")
    for number in ("64", "65", "60", "5"):     # context, requested total, prompt, max_tokens
        assert number in err["message"]
    assert engine.requests == []               # never reached the engine


def test_chat_overflow_names_messages(client):
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1000})
    err = assert_error(r, 400, "invalid_request_error", "messages", "context_length_exceeded")
    assert "1000" in err["message"] and "64" in err["message"]


def test_prompt_leaving_no_room_without_max_tokens(client):
    r = client.post("/v1/completions", json={"prompt": "a" * 64})
    err = assert_error(r, 400, "invalid_request_error", "prompt", "context_length_exceeded")
    assert "64" in err["message"]
    r = client.post("/v1/completions", json={"prompt": "a" * 63})
    assert r.status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "a", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "a", "stream": {"x": 1}}, "stream"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": "maybe"}},
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "a", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "a", "suffix": "z"}, "suffix"),
    ("/v1/completions", {"prompt": "a", "tools": [{"type": "function"}]}, "tools"),
    ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1.0}}, "logit_bias.x"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [2**21]}, "prompt"),       # beyond the vocab
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "bad name", "parameters": {}}}]}, "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": USER, "tools": [TOOL, TOOL]}, "tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_requests_are_400_with_the_param(client, engine, path, body, param):
    err = assert_error(client.post(path, json=body), 400, "invalid_request_error", param)
    assert engine.requests == []
    assert err["message"]


@pytest.mark.parametrize("payload", [b"{not json", b'{"prompt": "a",}', b"", b"[1, 2]",
                                     b'"just a string"'])
def test_malformed_json_is_400(client, payload):
    r = client.post("/v1/completions", content=payload,
                    headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_request_error")


def test_template_rejection_is_400(client, engine):
    # The fake template rejects role "tool" content that is not a string: route a
    # rejection through apply_chat_template by making it raise.
    def bad_template(messages, add_generation_prompt=True):
        raise InvalidRequestError("template cannot render this conversation", param="messages")
    engine.tokenizer.apply_chat_template = bad_template
    r = client.post("/v1/chat/completions", json={"messages": USER})
    assert_error(r, 400, "invalid_request_error", "messages")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": USER}),
])
def test_unknown_model_is_404(client, engine, path, body):
    err = assert_error(client.post(path, json=body), 404, "invalid_request_error", "model",
                       "model_not_found")
    assert "gpt-4" in err["message"]
    assert engine.requests == []


def test_unknown_route_is_openai_404(client):
    assert_error(client.get("/v1/nothing"), 404, "invalid_request_error")
    assert_error(client.get("/v1/completions"), 405, "invalid_request_error")


@pytest.mark.parametrize("exc", [QueueFullError("queue is full"), OutOfPagesError("no pages")])
@pytest.mark.parametrize("stream", [False, True])
def test_retryable_is_503_with_retry_after(FakeEngine, make_client, exc, stream):
    client = make_client(FakeEngine(raise_before=exc))
    r = client.post("/v1/completions", json={"prompt": "a", "stream": stream})
    err = assert_error(r, 503, "service_unavailable", code=type(exc).__name__)
    assert int(r.headers["retry-after"]) >= 1
    assert str(exc) in err["message"]


def test_engine_invalid_request_is_400(FakeEngine, make_client):
    client = make_client(FakeEngine(raise_before=InvalidRequestError("bad ids", param="prompt")))
    assert_error(client.post("/v1/completions", json={"prompt": "a"}), 400,
                 "invalid_request_error", "prompt")


@pytest.mark.parametrize("stream", [False, True])
def test_other_nibble_error_is_500(FakeEngine, make_client, stream):
    client = make_client(FakeEngine(raise_before=EngineDeadError("engine loop stopped")))
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": stream})
    err = assert_error(r, 500, "server_error", code="EngineDeadError")
    assert err["message"] == "engine loop stopped"


@pytest.mark.parametrize("stream", [False, True])
def test_unexpected_exception_is_500_and_server_survives(FakeEngine, make_client, stream):
    engine = FakeEngine(raise_before=KeyError("oops"))
    client = make_client(engine)
    r = client.post("/v1/completions", json={"prompt": "a", "stream": stream})
    assert_error(r, 500, "server_error")
    engine.raise_before = None
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_engine_error_output_non_streaming_is_500(FakeEngine, make_client):
    client = make_client(FakeEngine(error_after=(1, "device lost")))
    err = assert_error(client.post("/v1/completions", json={"prompt": "a"}), 500, "server_error")
    assert err["message"] == "device lost"


def test_server_info_failure_is_500(client, engine):
    def boom():
        raise RuntimeError("no info")
    engine.server_info = boom
    assert_error(client.get("/get_server_info"), 500, "server_error")
    assert client.get("/health").status_code == 200


def test_non_json_content_type_says_so(client):
    r = client.post("/v1/completions", content=b'{"prompt": "a"}',
                    headers={"content-type": "application/x-www-form-urlencoded"})
    err = assert_error(r, 400, "invalid_request_error")
    assert "application/json" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_error_as_first_output_gets_an_http_status(FakeEngine, make_client, stream):
    """An engine that fails a request at admission via an error output (not an exception):
    nothing has been streamed yet, so the client gets a real HTTP error, not a 200."""
    engine = FakeEngine(error_after=(0, "admission failed"))
    r = make_client(engine).post("/v1/completions", json={"prompt": "a", "stream": stream})
    err = assert_error(r, 500, "server_error")
    assert err["message"] == "admission failed"
    assert engine.aborted == []
