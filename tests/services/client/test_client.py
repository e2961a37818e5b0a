"""The SDK against a scripted server: typed results, retries with backoff on UNAVAILABLE
only (never INVALID_ARGUMENT), typed errors, the API key and TLS options."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from nibble.client import (AsyncClient, Choice, Client, GenerateResult, InvalidArgument,
                           NibbleClientError, NotFound, PermissionDenied, ResourceExhausted,
                           RetryPolicy, StreamChunk, Unauthenticated, Unavailable, Usage)
from nibble.client._common import build_request
from nibble.client.errors import from_rpc_error
from nibble.proto.nibble.v1 import nibble_pb2 as pb

FAST = RetryPolicy(max_attempts=3, initial_backoff=0.001, max_backoff=0.002)


def test_generate_returns_a_typed_result(stub_server):
    servicer, target = stub_server
    with Client(target, api_key="sk-1", retry=FAST) as c:
        r = c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                       temperature=0, stop="\n", cache_salt="s", request_id="mine")
    assert r == GenerateResult("r", "ab", (1, 2), "length", Usage(3, 2, 1, {"l1": 1}),
                               content="ab", choices=(Choice(0, "ab", (1, 2), "length", content="ab"),))
    assert r.usage.total_tokens == 5
    req = servicer.requests[0]
    assert req.chat.messages[0].content == "hi" and req.request_id == "mine"
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0
    assert list(req.sampling.stop) == ["\n"] and req.cache_salt == "s"
    assert not req.sampling.HasField("top_p")            # unset: the server's default
    assert servicer.metadata[0]["authorization"] == "Bearer sk-1"


def test_stream_yields_chunks(stub_server):
    _, target = stub_server
    with Client(target, retry=FAST) as c:
        chunks = list(c.stream([5, 6], max_tokens=2))
    assert [type(ch) for ch in chunks] == [StreamChunk, StreamChunk]
    assert chunks[0].finish_reason is None and not chunks[0].finished
    assert chunks[1].finish_reason == "length" and chunks[1].token_ids == (2,)


def test_unavailable_is_retried_until_it_succeeds(stub_server):
    servicer, target = stub_server
    servicer.fail_times = 2
    with Client(target, retry=FAST) as c:
        assert c.generate("hi").text == "ab"
        assert c.health() == "SERVING"
    assert servicer.calls == {"Generate": 3, "Check": 3}


def test_retries_stop_after_max_attempts(stub_server):
    servicer, target = stub_server
    servicer.fail_times = 5
    with Client(target, retry=FAST) as c:
        with pytest.raises(Unavailable, match="scripted failure 3"):
            c.generate("hi")
        with pytest.raises(Unavailable):
            c.server_info()
    assert servicer.calls == {"Generate": 3, "GetServerInfo": 3}


@pytest.mark.parametrize("code, exc", [
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
    (grpc.StatusCode.NOT_FOUND, NotFound),
    (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
])
def test_other_codes_are_never_retried(stub_server, code, exc):
    servicer, target = stub_server
    servicer.fail_times, servicer.fail_code, servicer.fail_param = 5, code, "temperature"
    with Client(target, retry=FAST) as c:
        with pytest.raises(exc) as info:
            c.generate("hi")
    assert servicer.calls == {"Generate": 1}
    assert info.value.code == code and info.value.param == "temperature"
    assert isinstance(info.value, NibbleClientError)


def test_no_retry_once_the_stream_started(stub_server):
    servicer, target = stub_server
    servicer.fail_after_first_chunk = True
    got = []
    with Client(target, retry=FAST) as c:
        with pytest.raises(Unavailable, match="mid-stream"):
            for chunk in c.stream("hi"):
                got.append(chunk)
    assert len(got) == 1 and servicer.calls == {"Generate": 1}


def test_timeout_bounds_the_retries(stub_server):
    servicer, target = stub_server
    servicer.fail_times = 100
    slow = RetryPolicy(max_attempts=100, initial_backoff=0.05, max_backoff=0.05, multiplier=1)
    with Client(target, retry=slow, timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            c.generate("hi")
        assert time.monotonic() - t0 < 2
    assert 1 < servicer.calls["Generate"] < 100


def test_async_client_retries_and_maps_errors(stub_server):
    servicer, target = stub_server

    async def main():
        async with AsyncClient(target, api_key="k", retry=FAST) as c:
            servicer.fail_times = 2
            result = await c.generate("hi")
            chunks = [ch async for ch in c.stream("hi")]
            aborted = await c.abort("r")
            n_all = await c.abort_all()
            info = await c.server_info()
            await c.flush_cache()
            status = await c.health()
            servicer.fail_times, servicer.fail_code = 10, grpc.StatusCode.INVALID_ARGUMENT
            servicer.calls.clear()
            with pytest.raises(InvalidArgument):
                await c.generate("hi")
            return result, chunks, aborted, n_all, info, status

    result, chunks, aborted, n_all, info, status = asyncio.run(main())
    assert result.text == "ab" and len(chunks) == 2
    assert (aborted, n_all, status) == (True, 3, "SERVING")
    assert (info.model, info.context_length, dict(info.details)) == ("m", 8, {"a": 1})
    assert servicer.calls == {"Generate": 1}
    assert servicer.metadata[0]["authorization"] == "Bearer k"


def test_retry_policy_rules():
    with pytest.raises(ValueError, match="INVALID_ARGUMENT"):
        RetryPolicy(retry_codes=frozenset({grpc.StatusCode.INVALID_ARGUMENT}))
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    p = RetryPolicy(initial_backoff=0.1, max_backoff=0.3, multiplier=2)
    assert all(0 <= p.delay(1) <= 0.1 and 0 <= p.delay(5) <= 0.3 for _ in range(50))


def test_build_request_needs_one_prompt():
    with pytest.raises(ValueError):
        build_request(None, None)
    with pytest.raises(ValueError):
        build_request("hi", [{"role": "user", "content": "x"}])
    assert build_request([1, 2], None).token_ids.ids == [1, 2]
    assert build_request("hi", None, stop=["a", "b"]).sampling.stop == ["a", "b"]
    assert not build_request("hi", None).HasField("cache_salt")


def test_unknown_codes_get_the_root_class():
    class Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DATA_LOSS

        def details(self):
            return "lost"

    e = from_rpc_error(Err())
    assert type(e) is NibbleClientError and e.code == grpc.StatusCode.DATA_LOSS
    assert str(e) == "DATA_LOSS: lost"


def test_sdk_does_not_import_the_server():
    import subprocess
    import sys
    code = ("import sys, nibble.client; "
            "assert 'torch' not in sys.modules and 'nibble.services' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
