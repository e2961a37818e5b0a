"""gRPC input limits: message size, unparsable strings, preparation off the event loop."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2

from nibble.proto.nibble.v1 import nibble_pb2 as pb
from nibble.services.config import ServerConfig
from nibble.services.grpc_api.decode import METHODS

from .conftest import run, serving

LIMIT = 4096
RELEASE_TIMEOUT_S = 5      # only ends a deadlock; the test then fails on the order of events


def test_message_over_the_limit_is_resource_exhausted(FakeEngine):
    engine = FakeEngine(context_length=100_000)

    async def main():
        async with serving(engine, ServerConfig(max_request_body_bytes=LIMIT)) as c:
            with pytest.raises(grpc.aio.AioRpcError) as big:
                await c.stub.Generate(pb.GenerateRequest(text="x" * (LIMIT + 1))).read()
            ok = [m async for m in c.stub.Generate(pb.GenerateRequest(
                text="x" * (LIMIT - 100), sampling=pb.SamplingParams(max_tokens=1)))]
            return big.value.code(), ok

    code, ok = run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ok[-1].finished and len(engine.requests) == 1


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (payloads under 128 bytes)."""
    return bytes([(number << 3) | 2, len(payload)]) + payload


SURROGATE = b"\xed\xa0\x80"        # U+D800 encoded as if it were a character: not UTF-8


def _chat(role: bytes, content: bytes) -> bytes:
    return _field(5, _field(1, _field(1, role) + _field(2, content)))


@pytest.mark.parametrize("method, raw", [
    ("Generate", _field(3, b"a" + SURROGATE)),                           # text
    ("Generate", _field(2, SURROGATE) + _field(3, b"hi")),               # model
    ("Generate", _field(1, SURROGATE) + _field(3, b"hi")),               # request_id
    ("Generate", _field(7, SURROGATE) + _field(3, b"hi")),               # cache_salt
    ("Generate", _field(6, _field(6, SURROGATE)) + _field(3, b"hi")),    # sampling.stop
    ("Generate", _chat(b"user", SURROGATE)),                              # chat content
    ("Generate", _chat(SURROGATE, b"hi")),                                # chat role
    ("Abort", _field(1, SURROGATE)),                                     # request_id
    ("Generate", b"\x1a\x05ab"),                                         # truncated
])
def test_unparsable_request_is_invalid_argument(FakeEngine, method, raw):
    engine = FakeEngine()
    response_type = METHODS[method][1]

    async def main():
        async with serving(engine) as c:
            path = f"/nibble.v1.Nibble/{method}"
            call = (c.channel.unary_stream if method == "Generate" else c.channel.unary_unary)(
                path, request_serializer=lambda b: b,
                response_deserializer=response_type.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if method == "Generate":
                    [m async for m in call(raw)]
                else:
                    await call(raw)
            ok = [m async for m in c.stub.Generate(pb.GenerateRequest(text="hi"))]
            return err.value, ok

    err, ok = run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "not a valid nibble.v1." in err.details()
    assert ok[-1].finished and len(engine.requests) == 1        # the server carries on


def test_every_method_is_registered():
    service = pb.DESCRIPTOR.services_by_name["Nibble"]
    assert set(METHODS) == set(service.methods_by_name)
    for name, (request, response, streams) in METHODS.items():
        method = service.methods_by_name[name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            request.DESCRIPTOR.full_name, response.DESCRIPTOR.full_name)
        assert method.server_streaming == streams


class BlockingTokenizer:
    """``encode`` of a long text waits for ``release``, then records "prepared"."""

    def __init__(self, inner, order: list[str]):
        self.inner, self.order = inner, order
        self.entered, self.release = threading.Event(), threading.Event()
        self.vocab_size = inner.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) >= 1000:
            self.entered.set()
            self.release.wait(RELEASE_TIMEOUT_S)
            self.order.append("prepared")
            text = text[:8]
        return self.inner.encode(text, add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_health_answers_while_a_huge_prompt_is_prepared(FakeEngine):
    engine = FakeEngine(context_length=1_000_000)
    order: list[str] = []
    engine.tokenizer = tok = BlockingTokenizer(engine.tokenizer, order)

    async def main():
        async with serving(engine) as c:
            big = asyncio.ensure_future(c.stub.Generate(pb.GenerateRequest(
                text="x" * 200_000, sampling=pb.SamplingParams(max_tokens=1))).read())
            await asyncio.to_thread(tok.entered.wait, RELEASE_TIMEOUT_S)
            status = await c.health.Check(health_pb2.HealthCheckRequest())
            order.append("health")
            tok.release.set()
            return status.status, await big

    status, first = run(main())
    assert order == ["health", "prepared"], "the event loop waited for the tokenizer"
    assert status == health_pb2.HealthCheckResponse.SERVING and first.request_id
