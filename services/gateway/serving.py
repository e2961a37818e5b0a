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
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine.client import EngineClient
from ..engine.types import RequestOutput
from ..errors import NibbleError
from ..frontend.errors import EngineOutputError
from ..frontend.choices import ChoiceStreams, Track, choice_requests, total_usage
from ..frontend.prepare import Prepared
from ..frontend.responses import Choice
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
    # Let the cancellation land: until it has, the engine stream the task awaits is still
    # running and closing it (the caller's next step) raises "already running".
    await asyncio.wait({task})
    raise ClientDisconnected()


async def _collect(streams: ChoiceStreams) -> list[RequestOutput]:
    """Run every choice to its end: the last output of each, its text and logprobs joined
    into ``text_delta`` / ``logprobs``."""
    first = await streams.first()
    n = len(streams.reqs)
    parts, lps, last = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n

    def add(i: int, out: RequestOutput) -> None:
        parts[i].append(out.text_delta)
        lps[i] += (out.prompt_logprobs or []) + (out.logprobs or [])    # echo: prompt first
        last[i] = out

    add(0, first)
    async for i, out in streams.rest(first):
        add(i, out)
    if any(o is None or not o.finished for o in last):
        raise EngineOutputError("the engine ended the request without finishing it")
    for i in range(n):
        streams.finish(i)
        last[i] = dataclasses.replace(last[i], text_delta="".join(parts[i]), logprobs=lps[i])
    return last


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


async def _sse_stream(p: Prepared, streams: ChoiceStreams, first: RequestOutput
                      ) -> AsyncIterator[str]:
    """SSE events of one request's choices; aborts those that did not finish normally."""
    rid, fmt, usages = p.gen_req.request_id, p.fmt, {}
    try:
        for chunk in fmt.start_chunks():
            yield _sse(chunk)
        if p.echo:       # the choices share the prompt and its logprobs (choice 0's)
            for i in range(p.fmt.n):
                for chunk in fmt.text_chunks(i, p.echo, first.prompt_logprobs):
                    yield _sse(chunk)

        async def outputs():
            yield 0, first
            async for pair in streams.rest(first):
                yield pair
        async for i, out in outputs():
            if out.error:
                if out.finished:
                    streams.finish(i)
                raise EngineOutputError(out.error)
            if out.text_delta or out.logprobs:
                for chunk in fmt.text_chunks(i, out.text_delta, out.logprobs):
                    yield _sse(chunk)
            if out.finished:
                streams.finish(i)
                usages[i] = out.usage
                for chunk in fmt.finish_chunks(i, out.finish_reason):
                    yield _sse(chunk)
        if fmt.include_usage:
            yield _sse(fmt.usage_chunk(total_usage([usages[i] for i in sorted(usages)])))
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
        await streams.close()


async def respond(engine: EngineClient, request: Request, p: Prepared, track: Track | None = None
                  ) -> Response:
    """Run a prepared request (its ``n`` choices); stream it as SSE or return one JSON body.

    ``track`` wraps the engine's output stream (metrics, in-flight set: tracking.py)."""
    streams = ChoiceStreams(engine, choice_requests(p.gen_req, p.fmt.n), track)
    try:
        if p.stream:
            first = await race_disconnect(request, streams.first())
        else:
            lasts = await race_disconnect(request, _collect(streams))
    except BaseException:      # client gone, cancelled, engine error: free the choices
        await streams.close()
        raise
    if p.stream:
        if first.error and first.finished:   # failed before any output: a proper status
            streams.finish(0)
            await streams.close()
            raise EngineOutputError(first.error)
        return ClosingStreamingResponse(
            _sse_stream(p, streams, first), streams.close, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await streams.close()
    for out in lasts:
        if out.error:
            raise EngineOutputError(out.error)
    choices = [Choice(p.echo + o.text_delta, o.finish_reason, o.logprobs or []) for o in lasts]
    return JSONResponse(p.fmt.full(choices, total_usage([o.usage for o in lasts])))
