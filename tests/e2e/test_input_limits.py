"""End to end: lone surrogates and oversized requests against a real ``nibble serve``.

The tiny dummy model has a real ``tokenizers`` tokenizer (which cannot take a lone
surrogate: this used to be a 500) and a chat template. The server runs with a
64 KiB body limit, which gRPC messages share.
"""

from __future__ import annotations

import json

import httpx
import pytest

from nibble.bench._server import free_port
from nibble.client import Client, ResourceExhausted, RetryPolicy
from nibble.proto.nibble.v1 import nibble_pb2 as pb

from .conftest import Server
from .tiny_model import tiny_server_args

pytestmark = pytest.mark.slow
LIMIT = 64 * 1024
LONE = "\ud800"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    grpc_port = free_port()
    srv = Server(tmp, [*tiny_server_args(tmp / "model"), "--grpc-port", str(grpc_port),
                       "--max-request-body-bytes", str(LIMIT)])
    srv.wait_healthy()
    yield srv, f"127.0.0.1:{grpc_port}"
    assert srv.stop() == 0


def post_json(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi " + LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": LONE}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/abort_request", {"rid": LONE}, "rid"),
])
def test_lone_surrogate_is_400(served, path, body, param):
    srv, _ = served
    r = post_json(f"{srv.url}{path}", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = post_json(f"{srv.url}/v1/completions", {"prompt": "hi \U0001F600", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_body_over_the_limit_is_413(served):
    srv, _ = served
    body = json.dumps({"prompt": "a" * LIMIT}).encode()
    r = httpx.post(f"{srv.url}/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():                      # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(LIMIT // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    try:
        r = httpx.post(f"{srv.url}/v1/completions", content=chunks(), timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
    except httpx.TransportError:
        pass     # the server answered and closed before the client finished sending
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def test_grpc_message_over_the_limit_is_resource_exhausted(served):
    _, target = served
    with Client(target, timeout=60, retry=RetryPolicy(max_attempts=1)) as c:
        with pytest.raises(ResourceExhausted):
            c.generate("a" * LIMIT, max_tokens=2)
        assert c.generate("hello", max_tokens=2).usage.completion_tokens >= 1
    assert pb.GenerateRequest(text="a" * LIMIT).ByteSize() > LIMIT
