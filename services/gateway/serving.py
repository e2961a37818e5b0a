"""From a validated OpenAI request to the engine and back.

1. ``prepare_*``: check the model name and unsupported options, bound the
   prompt's length in characters (``check_prompt_chars``), tokenize (chat template
   for chat), check the context budget, map to SamplingParams. These are
   synchronous and slow for big prompts: the callers run them on the Preparer's
   threads (preparer.py), never on the event loop.
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
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine.types import GenerateRequest, RequestOutput, SamplingParams
from ..errors import (ContextLengthExceededError, InvalidRequestError, ModelNotFoundError,
                      NibbleError)
from .errors import ClientDisconnected, error_body
from .protocol import (ChatCompletionRequest, ChatFormatter, CompletionFormatter,
                       CompletionRequest, SamplingFields, Formatter, new_request_id)

log = logging.getLogger(__name__)
T = TypeVar("T")

# No token of any tokenizer we load spans more characters than this on average over a
# prompt; a longer text cannot fit the context, so it is refused before tokenizing it.
MAX_CHARS_PER_TOKEN = 32


@dataclass
class Prepared:
    """A request ready for the engine, plus how to shape its response."""

    gen_req: GenerateRequest
    stream: bool
    fmt: Formatter


class EngineOutputError(NibbleError):
    """The engine failed a request after admitting it (RequestOutput.error)."""


# ---------------------------------------------------------------- preparation

def check_model(engine: Any, requested: str | None) -> None:
    """A missing model field means the served one; any other name is a 404."""
    if requested is not None and requested != engine.model_name:
        raise ModelNotFoundError(f"The model '{requested}' does not exist; "
                                 f"this server serves '{engine.model_name}'.")


def _check_common(body: SamplingFields) -> None:
    if body.n not in (None, 1):
        raise InvalidRequestError("n must be 1: several choices per request are not supported",
                                  param="n")
    if body.top_k is not None and body.top_k < -1:
        raise InvalidRequestError("top_k must be -1, 0 (off) or >= 1", param="top_k")


def check_token_ids(tokenizer: Any, ids: list[int], param: str) -> None:
    vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(vocab, int) and ids and max(ids) >= vocab:
        raise InvalidRequestError(f"token id {max(ids)} is out of range (vocab size {vocab})",
                                  param=param)


def resolve_max_tokens(requested: int | None, prompt_len: int, context_length: int,
                       param: str) -> int:
    """OpenAI's context check: prompt + completion must fit; absent max_tokens fills it."""
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty", param=param)
    if requested is None:
        requested = context_length - prompt_len
        if requested < 1:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {context_length} tokens. However, your "
                f"prompt is {prompt_len} tokens, which leaves no room for completion tokens. "
                "Please reduce the length of the prompt.", param=param,
                code="context_length_exceeded")
    elif prompt_len + requested > context_length:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            f"for the completion (max_tokens)). Please reduce the length of the prompt or "
            "max_tokens.", param=param, code="context_length_exceeded")
    return requested


def check_prompt_chars(n_chars: int, context_length: int, param: str) -> None:
    """Refuse a prompt of ``n_chars`` characters that cannot fit ``context_length`` tokens,
    without spending the time to tokenize it (the exact check follows tokenization)."""
    limit = context_length * MAX_CHARS_PER_TOKEN
    if n_chars > limit:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"prompt is {n_chars} characters long, more than any prompt that fits ({limit} "
            "characters at most). Please reduce the length of the prompt.", param=param,
            code="context_length_exceeded")


def sampling_params(body: SamplingFields, max_tokens: int) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k in (None, 0) else body.top_k,
        seed=body.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
    )


def _finish_prepare(engine: Any, body: SamplingFields, ids: list[int], max_tokens: int | None,
                    param: str, prefix: str, fmt_cls: type[Formatter]) -> Prepared:
    max_tokens = resolve_max_tokens(max_tokens, len(ids), engine.context_length, param)
    rid = new_request_id(prefix)
    stream = bool(body.stream)
    include_usage = stream and bool(body.stream_options and body.stream_options.include_usage)
    gen_req = GenerateRequest(request_id=rid, prompt_token_ids=ids,
                              sampling=sampling_params(body, max_tokens),
                              cache_salt=body.cache_salt)
    return Prepared(gen_req, stream, fmt_cls(rid, engine.model_name, include_usage))


def completion_prompt_ids(tokenizer: Any, prompt: str | list, context_length: int) -> list[int]:
    """``str | list[int] | [str] | [list[int]]`` -> token ids (batches of >1 are rejected)."""
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidRequestError("only one prompt per request is supported",
                                          param="prompt")
            prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), context_length, "prompt")
        # Raw text: the tokenizer adds BOS if its config says so (as vLLM does).
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    ids = list(prompt)
    check_token_ids(tokenizer, ids, "prompt")
    return ids


def prepare_completion(engine: Any, body: CompletionRequest) -> Prepared:
    check_model(engine, body.model)
    _check_common(body)
    if body.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    if body.logprobs:
        raise InvalidRequestError("logprobs are not supported", param="logprobs")
    if body.best_of not in (None, 1):
        raise InvalidRequestError("best_of must be 1", param="best_of")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    ids = completion_prompt_ids(engine.tokenizer, body.prompt, engine.context_length)
    return _finish_prepare(engine, body, ids, body.max_tokens, "prompt", "cmpl",
                           CompletionFormatter)


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template takes them: text-only content, joined parts."""
    out = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"messages[{i}]: only 'text' content parts are supported, "
                        f"got '{part.type}'", param=f"messages[{i}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out


def prepare_chat(engine: Any, body: ChatCompletionRequest) -> Prepared:
    check_model(engine, body.model)
    _check_common(body)
    if body.logprobs:
        raise InvalidRequestError("logprobs are not supported", param="logprobs")
    messages = chat_messages(body)
    check_prompt_chars(sum(len(m["content"]) for m in messages), engine.context_length,
                       "messages")
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _finish_prepare(engine, body, ids, max_tokens, "messages", "chatcmpl", ChatFormatter)


# ---------------------------------------------------------------- generation

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


async def _collect(gen: AsyncIterator[RequestOutput]) -> tuple[str, RequestOutput]:
    parts, last = [], None
    async with contextlib.aclosing(gen):
        async for out in gen:
            parts.append(out.text_delta)
            last = out
            if out.finished:
                break
    if last is None or not last.finished:
        raise EngineOutputError("the engine ended the request without finishing it")
    return "".join(parts), last


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class AbortGuard:
    """Aborts one request in the engine once, unless it was marked finished first."""

    def __init__(self, engine: Any, request_id: str):
        self.engine, self.request_id, self.done = engine, request_id, False

    def finish(self) -> None:
        self.done = True

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            log.info("aborting %s: the client went away or its stream ended early",
                     self.request_id)
            self.engine.abort(self.request_id)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that, however the response ends, closes its body iterator and
    runs ``on_close`` (the engine abort), even when the body was never iterated."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self.on_close()


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
            if out.text_delta:
                yield _sse(fmt.text_chunk(out.text_delta))
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
        guard()
        await gen.aclose()


Track = Callable[[AsyncIterator[RequestOutput]], AsyncIterator[RequestOutput]]


async def respond(engine: Any, request: Request, p: Prepared, track: Track | None = None
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
            text, last = await race_disconnect(request, _collect(gen))
    except (ClientDisconnected, asyncio.CancelledError):
        guard()
        raise
    except EngineOutputError:
        guard()
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
    return JSONResponse(p.fmt.full(text, last.finish_reason, last.usage))

