"""From a validated OpenAI request to the engine and back.

1. ``frontend/prepare.py``: validation, template, tokenization, context check
   (on the Preparer's threads, never on the event loop).
2. ``respond``: start ``engine.generate``. Errors the engine raises before its
   first output become proper HTTP errors (nothing has been sent yet).
3. Streaming: SSE chunks; non-streaming: one JSON body.
Whatever way a request ends early (client gone, cancelled, error), the engine
gets ``abort(request_id)`` so its KV pages are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine.client import EngineClient
from ..engine.types import RequestOutput, TokenLogprob
from ..errors import NibbleError
from ..frontend.errors import EngineOutputError
from ..frontend.prepare import Prepared
from ..frontend.tracking import AbortGuard
from .errors import ClientDisconnected, error_body

log = logging.getLogger(__name__)
T = TypeVar("T")


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _consume_result(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()   # mark retrieved; the caller already moved on


async def race_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` unless the client disconnects first (then ClientDisconnected)."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.add_done_callback(_consume_result)
    task.cancel()
    raise ClientDisconnected()


async def _first_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        raise EngineOutputError("the engine ended the request without any output") from None


async def _collect(gen: AsyncIterator[RequestOutput]
                   ) -> tuple[str, RequestOutput, list[TokenLogprob]]:
    parts, last, lps = [], None, []
    async with contextlib.aclosing(gen):
        async for out in gen:
            parts.append(out.text_delta)
            lps += out.logprobs or []
            last = out
            if out.finished:
                break
    if last is None or not last.finished:
        raise EngineOutputError("the engine ended the request without finishing it")
    return "".join(parts), last, lps


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that, however the response ends, closes its body iterator and
    runs ``on_close`` (the engine abort), even when the body was never iterated."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self.on_close()


async def _sse_stream(p: Prepared, gen: AsyncIterator[RequestOutput], first: RequestOutput,
                      guard: AbortGuard) -> AsyncIterator[str]:
    """SSE events of one request; aborts it in the engine unless it finished normally."""
    rid, fmt = p.gen_req.request_id, p.fmt
    try:
        for chunk in fmt.start_chunks():
            yield _sse(chunk)
        out = first
        while True:
            if out.error:
                if out.finished:
                    guard.finish()
                raise EngineOutputError(out.error)
            if out.text_delta or out.logprobs:
                yield _sse(fmt.text_chunk(out.text_delta, out.logprobs))
            if out.finished:
                break
            out = await gen.__anext__()
        guard.finish()
        yield _sse(fmt.finish_chunk(out.finish_reason))
        if fmt.include_usage:
            yield _sse(fmt.usage_chunk(out.usage))
        yield "data: [DONE]\n\n"
    except Exception as exc:   # headers are out: report in-band, as OpenAI does
        if not isinstance(exc, NibbleError):
            log.exception("request %s failed mid-stream", rid)
        else:
            log.warning("request %s failed mid-stream: %s", rid, exc)
        yield _sse(error_body(str(exc) or type(exc).__name__, "server_error", None,
                              type(exc).__name__))
        yield "data: [DONE]\n\n"
    finally:
        await guard()
        await gen.aclose()


Track = Callable[[AsyncIterator[RequestOutput]], AsyncIterator[RequestOutput]]


async def respond(engine: EngineClient, request: Request, p: Prepared, track: Track | None = None
                  ) -> Response:
    """Run a prepared request; stream it as SSE or return one JSON body.

    ``track`` wraps the engine's output stream (metrics, in-flight set: tracking.py)."""
    rid = p.gen_req.request_id
    guard = AbortGuard(engine, rid)
    gen = engine.generate(p.gen_req)
    if track is not None:
        gen = track(gen)
    try:
        if p.stream:
            first = await race_disconnect(request, _first_output(gen))
        else:
            text, last, lps = await race_disconnect(request, _collect(gen))
    except (ClientDisconnected, asyncio.CancelledError, EngineOutputError):
        await guard()
        raise
    if p.stream:
        if first.error and first.finished:   # failed before any output: a proper status
            await gen.aclose()
            raise EngineOutputError(first.error)
        return ClosingStreamingResponse(
            _sse_stream(p, gen, first, guard), guard, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if last.error:
        raise EngineOutputError(last.error)
    return JSONResponse(p.fmt.full(text, last.finish_reason, last.usage, lps))

