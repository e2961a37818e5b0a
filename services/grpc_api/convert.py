"""Protobuf messages <-> the engine's types, through the shared request code (frontend/).

A ``GenerateRequest`` becomes the equivalent OpenAI request model
(``ChatCompletionRequest`` for ``chat``, ``CompletionRequest`` for ``text`` or
``token_ids``), which is validated and prepared exactly as over HTTP: field
ranges, model name, chat template, tokenization, context check, SamplingParams.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from nibble.proto.nibble.v1 import nibble_pb2 as pb

from ..engine.client import EngineClient
from ..engine.types import FinishReason, RequestOutput
from ..errors import InvalidRequestError
from ..frontend.errors import main_error, param_from_loc
from ..frontend.prepare import Prepared, prepare_chat, prepare_completion
from ..frontend.protocol import ChatCompletionRequest, CompletionRequest

OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed")
FINISH_REASONS = {FinishReason.STOP: pb.FINISH_REASON_STOP,
                  FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                  FinishReason.ABORT: pb.FINISH_REASON_ABORT}


def _fields(msg: pb.GenerateRequest) -> dict[str, Any]:
    """The OpenAI body fields ``msg`` sets (unset optional fields stay absent: defaults)."""
    s = msg.sampling
    out: dict[str, Any] = {f: getattr(s, f) for f in OPTIONAL_SAMPLING if s.HasField(f)}
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    out["ignore_eos"] = s.ignore_eos
    if msg.model:
        out["model"] = msg.model
    if msg.HasField("cache_salt"):
        out["cache_salt"] = msg.cache_salt
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


def prepare(engine: EngineClient, msg: pb.GenerateRequest) -> Prepared:
    """Validate ``msg`` and build the engine request (raises InvalidRequestError,
    ContextLengthExceededError or ModelNotFoundError as the HTTP path does)."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("the request has no prompt: set one of text, token_ids "
                                  "or chat", param="prompt")
    fields = _fields(msg)
    try:
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
            body = ChatCompletionRequest.model_validate({**fields, "messages": messages})
        else:
            prompt = msg.text if kind == "text" else list(msg.token_ids.ids)
            body = CompletionRequest.model_validate({**fields, "prompt": prompt})
    except ValidationError as exc:
        raise _invalid(exc) from None
    if kind == "chat":
        return prepare_chat(engine, body)
    return prepare_completion(engine, body)


def response(out: RequestOutput, request_id: str) -> pb.GenerateResponse:
    """One engine update as one streamed message (``request_id``: the caller's name for it)."""
    u = out.usage
    usage = pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                     cached_tokens=u.cached_tokens, cached_tokens_by_tier=u.cached_by_tier or {})
    return pb.GenerateResponse(
        request_id=request_id, token_ids=out.new_token_ids, text=out.text_delta,
        finished=out.finished,
        finish_reason=FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=usage)
