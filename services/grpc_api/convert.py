"""Protobuf messages <-> the engine's types, through the shared request code (frontend/).

A ``GenerateRequest`` becomes the equivalent OpenAI request model
(``ChatCompletionRequest`` for ``chat``, ``CompletionRequest`` for ``text`` or
``token_ids``), which is validated and prepared exactly as over HTTP: field
ranges, model name, chat template, tools, grammars, tokenization, context
check, SamplingParams.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from pydantic import ValidationError

from nibble.proto.nibble.v1 import nibble_pb2 as pb

from ..engine.client import EngineClient
from ..engine.types import FinishReason, RequestOutput, TokenLogprob
from ..errors import InvalidRequestError
from ..frontend.errors import main_error, param_from_loc
from ..frontend.prepare import Prepared, prepare_chat, prepare_completion
from ..frontend.protocol import ChatCompletionRequest, CompletionRequest
from ..frontend.tool_parsers import Parsed

OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")
OPTIONAL_REQUEST = ("parallel_tool_calls", "regex", "ebnf", "n")
FINISH_REASONS = {FinishReason.STOP: pb.FINISH_REASON_STOP,
                  FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                  FinishReason.ABORT: pb.FINISH_REASON_ABORT}


def _json_field(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"{param} is not JSON: {exc}", param=param) from None


def _fields(msg: pb.GenerateRequest) -> dict[str, Any]:
    """The OpenAI body fields ``msg`` sets (unset optional fields stay absent: defaults)."""
    s = msg.sampling
    out: dict[str, Any] = {f: getattr(s, f) for f in OPTIONAL_SAMPLING if s.HasField(f)}
    out.update({f: getattr(msg, f) for f in OPTIONAL_REQUEST if msg.HasField(f)})
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
    out["ignore_eos"] = s.ignore_eos
    if msg.model:
        out["model"] = msg.model
    if msg.HasField("cache_salt"):
        out["cache_salt"] = msg.cache_salt
    if msg.HasField("response_format"):
        rf = msg.response_format
        out["response_format"] = {"type": rf.type}
        if rf.json_schema:
            out["response_format"]["json_schema"] = {
                "name": "schema", "strict": rf.strict,
                "schema": _json_field(rf.json_schema, "response_format.json_schema")}
    return out


def _chat_fields(msg: pb.GenerateRequest) -> dict[str, Any]:
    """Messages, tools and tool choice of a chat request, in the OpenAI body's shape."""
    messages = []
    for m in msg.chat.messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            entry["name"] = m.name
        if m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        messages.append(entry)
    out: dict[str, Any] = {"messages": messages}
    if msg.tools:
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            **({"parameters": _json_field(t.parameters_json, f"tools[{i}].parameters_json")}
               if t.parameters_json else {})}} for i, t in enumerate(msg.tools)]
    if msg.HasField("tool_choice"):
        tc = msg.tool_choice
        out["tool_choice"] = (tc.mode if tc.WhichOneof("choice") == "mode" else
                              {"type": "function", "function": {"name": tc.function}})
    if msg.HasField("logprobs"):
        out.update(logprobs=True, top_logprobs=msg.logprobs)
    return out


def _invalid(exc: ValidationError) -> InvalidRequestError:
    errors = exc.errors()
    first = main_error(errors)
    loc = tuple(first.get("loc", ()))
    where = param_from_loc(loc) or "request"
    msg = f"Invalid request: {first.get('msg', 'validation failed')} (at '{where}')"
    if len(errors) > 1:
        msg += f" and {len(errors) - 1} more error(s)"
    return InvalidRequestError(msg, param=param_from_loc(loc))


def prepare(engine: EngineClient, msg: pb.GenerateRequest, tool_parser: str = "auto"
            ) -> Prepared:
    """Validate ``msg`` and build the engine request (raises InvalidRequestError,
    ContextLengthExceededError or ModelNotFoundError as the HTTP path does)."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("the request has no prompt: set one of text, token_ids "
                                  "or chat", param="prompt")
    fields = _fields(msg)
    try:
        if kind == "chat":
            body = ChatCompletionRequest.model_validate({**fields, **_chat_fields(msg)})
        else:
            prompt = msg.text if kind == "text" else list(msg.token_ids.ids)
            extra = {"echo": msg.echo} if msg.echo else {}
            if msg.HasField("logprobs"):
                extra["logprobs"] = msg.logprobs
            if msg.tools or msg.HasField("tool_choice"):
                extra["tools"] = [{"type": "function"}]      # refused with its message
            body = CompletionRequest.model_validate({**fields, **extra, "prompt": prompt})
    except ValidationError as exc:
        raise _invalid(exc) from None
    if kind == "chat":
        return prepare_chat(engine, body, tool_parser)
    return prepare_completion(engine, body)


def _logprobs(lps: list[TokenLogprob] | None, text: Callable[[int], str] | None
              ) -> list[pb.TokenLogprob]:
    if not lps or text is None:
        return []
    # an echoed prompt's first token has no logprob: NaN (proto doubles cannot be null)
    return [pb.TokenLogprob(token_id=lp.token_id, token=text(lp.token_id),
                            logprob=float("nan") if lp.logprob is None else lp.logprob,
                            top=[pb.TopLogprob(token_id=t, token=text(t), logprob=v)
                                 for t, v in lp.top or ()]) for lp in lps]


def response(out: RequestOutput, request_id: str, index: int = 0,
             token_text: Callable[[int], str] | None = None, parsed: Parsed | None = None,
             text: str | None = None) -> pb.GenerateResponse:
    """One engine update of choice ``index`` as one streamed message (``request_id``: the
    caller's name for the request). ``parsed``: the tool calls of the choice's whole
    output, on its last message; ``text`` replaces the update's text (echo: the prompt's
    text, and its logprobs before the update's when the request asked for them)."""
    u = out.usage
    usage = pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                     cached_tokens=u.cached_tokens, cached_tokens_by_tier=u.cached_by_tier or {})
    reason = FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    msg = pb.GenerateResponse(
        request_id=request_id, token_ids=out.new_token_ids,
        text=out.text_delta if text is None else text, finished=out.finished,
        finish_reason=reason, usage=usage, index=index,
        logprobs=_logprobs(((out.prompt_logprobs or []) if text is not None else [])
                           + (out.logprobs or []), token_text))
    if parsed is not None and parsed.calls:
        msg.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                              for c in parsed.calls)
        if parsed.content is not None:
            msg.content = parsed.content
        if out.finish_reason is FinishReason.STOP:
            msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    return msg
