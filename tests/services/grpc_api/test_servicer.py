"""nibble.v1.Nibble over a real gRPC server and the scripted fake engine: the streamed
messages, every status-code mapping, and that cancellation and deadlines abort the
engine request."""

from __future__ import annotations

import json

import grpc
import pytest

from nibble.proto.nibble.v1 import nibble_pb2 as pb
from nibble.services.errors import (EngineDeadError, OutOfPagesError, QueueFullError)

from .conftest import run, serving, wait_for

Code = grpc.StatusCode


def text_req(text="hi", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(**sampling))


async def collect(conn, req, **kw) -> list[pb.GenerateResponse]:
    return [m async for m in conn.stub.Generate(req, **kw)]


async def status_of(conn, req, **kw) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(conn, req, **kw)
    return info.value


def test_generate_streams_tokens_text_and_usage(FakeEngine):
    engine = FakeEngine("Hello", cached_tokens=2)

    async def main():
        async with serving(engine) as c:
            req = text_req("hi", max_tokens=10, temperature=0.5, top_p=0.9, top_k=5, seed=7,
                           stop=["\n"], stop_token_ids=[3], ignore_eos=True)
            req.cache_salt = "salt"
            return await collect(c, req)

    msgs = run(main())
    assert "".join(m.text for m in msgs) == "Hello"
    assert [t for m in msgs for t in m.token_ids] == [ord(ch) for ch in "Hello"]
    assert [m.finished for m in msgs] == [False] * 4 + [True]
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens,
            last.usage.cached_tokens) == (2, 5, 2)
    (req,) = engine.requests
    assert {m.request_id for m in msgs} == {req.request_id}   # no name given: the engine's id
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (10, 0.5, 0.9, 5, 7)
    assert (s.stop, s.stop_token_ids, s.ignore_eos) == (("\n",), (3,), True)
    assert req.cache_salt == "salt" and req.prompt_token_ids == [ord("h"), ord("i")]


def test_defaults_match_http(FakeEngine):
    engine = FakeEngine("abc", context_length=64)

    async def main():
        async with serving(engine) as c:
            return await collect(c, pb.GenerateRequest(text="hi"))

    run(main())
    s = engine.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (1.0, 1.0, -1, None)
    assert s.max_tokens == 64 - 2          # absent max_tokens fills the context, as in HTTP
    assert engine.requests[0].cache_salt is None


def test_chat_and_token_id_prompts(FakeEngine):
    engine = FakeEngine("ok")

    async def main():
        async with serving(engine) as c:
            chat = pb.GenerateRequest(request_id="mine", chat=pb.ChatMessages(messages=[
                pb.ChatMessage(role="developer", content="be brief"),
                pb.ChatMessage(role="user", content="hi")]))
            msgs = await collect(c, chat)
            ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                     sampling=pb.SamplingParams(max_tokens=1))
            return msgs, await collect(c, ids)

    chat_msgs, id_msgs = run(main())
    assert {m.request_id for m in chat_msgs} == {"mine"}
    expected = "<system>be brief\n<user>hi\n<assistant>"
    assert engine.requests[0].prompt_token_ids == [ord(ch) for ch in expected]
    assert engine.requests[0].request_id != "mine"       # the engine id stays server-unique
    assert engine.requests[1].prompt_token_ids == [5, 6, 7]
    assert id_msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("req, param", [
    (pb.GenerateRequest(), "prompt"),
    (text_req(temperature=3.0), "temperature"),
    (text_req(top_p=0.0), "top_p"),
    (text_req(top_k=-2), "top_k"),
    (text_req(max_tokens=0), "max_tokens"),
    (text_req("x" * 70), "prompt"),                                   # context exceeded
    (text_req("hi", max_tokens=100), "prompt"),                        # context exceeded
    (pb.GenerateRequest(text=""), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "prompt"),
    (pb.GenerateRequest(chat=pb.ChatMessages()), "messages"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot")])),
     "messages[0].role"),
])
def test_bad_input_is_invalid_argument(FakeEngine, req, param):
    engine = FakeEngine()

    async def main():
        async with serving(engine) as c:
            return await status_of(c, req)

    err = run(main())
    assert err.code() == Code.INVALID_ARGUMENT, err
    assert err.details()
    assert dict(err.trailing_metadata())["nibble-error-param"] == param
    assert engine.requests == []          # never reached the engine


@pytest.mark.parametrize("exc, code", [
    (QueueFullError("the request queue is full"), Code.RESOURCE_EXHAUSTED),
    (OutOfPagesError("no pages"), Code.UNAVAILABLE),
    (EngineDeadError("engine loop stopped"), Code.UNAVAILABLE),
    (RuntimeError("bug"), Code.INTERNAL),
])
def test_admission_failures_map_to_status(FakeEngine, exc, code):
    async def main():
        async with serving(FakeEngine(raise_before=exc)) as c:
            return await status_of(c, text_req())

    err = run(main())
    assert err.code() == code and str(exc) in err.details()
    assert dict(err.trailing_metadata())["nibble-error-type"] == type(exc).__name__


def test_unknown_model_is_not_found(FakeEngine):
    async def main():
        async with serving(FakeEngine()) as c:
            ok = await collect(c, pb.GenerateRequest(text="hi", model="fake-model"))
            return ok, await status_of(c, pb.GenerateRequest(text="hi", model="other"))

    ok, err = run(main())
    assert ok[-1].finished
    assert err.code() == Code.NOT_FOUND and "other" in err.details()


@pytest.mark.parametrize("knob", ["raise_after", "error_after"])
def test_failure_mid_stream_is_internal_and_aborts(FakeEngine, knob):
    fault = (2, RuntimeError("boom")) if knob == "raise_after" else (2, "engine fault")
    engine = FakeEngine("abcdef", **{knob: fault})
    got = []

    async def main():
        async with serving(engine) as c:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for m in c.stub.Generate(text_req()):
                    got.append(m)
            return info.value

    err = run(main())
    assert err.code() == Code.INTERNAL
    assert ("boom" if knob == "raise_after" else "engine fault") in err.details()
    assert len(got) == 2
    if knob == "raise_after":        # the engine never finished it: it must be aborted
        assert engine.aborted == [engine.requests[0].request_id]


def test_client_cancel_aborts_the_engine_request(FakeEngine):
    engine = FakeEngine("abcdef", hang_after=2)

    async def main():
        async with serving(engine) as c:
            call = c.stub.Generate(text_req())
            assert (await call.read()).text == "a"
            assert (await call.read()).text == "b"
            await wait_for(lambda: engine.hanging)
            call.cancel()
            await wait_for(lambda: engine.aborted)
            assert not c.server.servicer.owned and not c.server.servicer.inflight

    run(main())
    assert engine.aborted == [engine.requests[0].request_id]


def test_deadline_aborts_the_engine_request(FakeEngine):
    engine = FakeEngine("abcdef", hang_after=1)

    async def main():
        async with serving(engine) as c:
            err = await status_of(c, text_req(), timeout=0.3)
            await wait_for(lambda: engine.aborted)
            return err

    err = run(main())
    assert err.code() == Code.DEADLINE_EXCEEDED
    assert engine.aborted == [engine.requests[0].request_id]


def test_abort_by_name_ends_the_stream_with_abort(FakeEngine):
    engine = FakeEngine("abcdef", hang_after=1)

    async def main():
        async with serving(engine) as c:
            call = c.stub.Generate(pb.GenerateRequest(request_id="job-1", text="hi"))
            await call.read()
            dup = await status_of(c, pb.GenerateRequest(request_id="job-1", text="hi"))
            none = await c.stub.Abort(pb.AbortRequest(request_id="nope"))
            hit = await c.stub.Abort(pb.AbortRequest(request_id="job-1"))
            rest = []
            while (m := await call.read()) is not grpc.aio.EOF:
                rest.append(m)
            return dup, none, hit, rest

    dup, none, hit, rest = run(main())
    assert dup.code() == Code.ALREADY_EXISTS
    assert none.num_aborted == 0 and hit.num_aborted == 1
    assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert engine.aborted[0] == engine.requests[0].request_id


def test_abort_needs_exactly_one_target(FakeEngine):
    async def main():
        async with serving(FakeEngine()) as c:
            out = []
            for req in (pb.AbortRequest(), pb.AbortRequest(request_id="x", abort_all=True)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await c.stub.Abort(req)
                out.append(info.value.code())
            return out, (await c.stub.Abort(pb.AbortRequest(abort_all=True))).num_aborted

    codes, n = run(main())
    assert codes == [Code.INVALID_ARGUMENT] * 2 and n == 0


def test_server_info_and_flush_cache(FakeEngine):
    engine = FakeEngine("abcdef", hang_after=1)

    async def main():
        async with serving(engine) as c:
            info = await c.stub.GetServerInfo(pb.GetServerInfoRequest())
            await c.stub.FlushCache(pb.FlushCacheRequest())
            call = c.stub.Generate(text_req())
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await c.stub.FlushCache(pb.FlushCacheRequest())
            call.cancel()
            return info, busy.value

    info, busy = run(main())
    assert (info.model, info.context_length) == ("fake-model", 64)
    details = json.loads(info.json)
    assert details["kv_pool"]["total_pages"] == 10
    assert "sk-user" not in info.json and "sk-admin" not in info.json    # keys redacted
    assert engine.flushes == 1
    assert busy.code() == Code.FAILED_PRECONDITION
