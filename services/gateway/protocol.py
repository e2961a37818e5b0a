"""OpenAI wire format: request models (validated by FastAPI) and response builders.

Requests are pydantic models that ignore unknown fields, as OpenAI-compatible
servers do. Responses are plain dicts in OpenAI's exact schema, built by the
two formatters below (one per endpoint); the serving code drives either one
through the same calls, so it never branches on the endpoint.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.types import FinishReason, Usage

TokenId = Annotated[int, Field(ge=0)]
# torch.Generator.manual_seed accepts this range; anything wider is a client error.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (null = default)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)            # extension; -1 or 0 = off
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None       # extension (vLLM)
    n: int | None = None                              # only 1 is supported
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False                   # extension (benchmarks)
    user: str | None = None
    cache_salt: str | None = None                     # extension: tenant namespace for prefix reuse


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool | None = False                         # not supported: 400 when true
    logprobs: int | None = Field(None, ge=0)          # not supported: 400 when set
    best_of: int | None = None                        # only 1 is supported
    suffix: str | None = None                         # not supported: 400 when set


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)   # wins over max_tokens
    logprobs: bool | None = False                            # not supported: 400 when true
    top_logprobs: int | None = None


def new_request_id(prefix: str) -> str:
    """Server-unique id such as ``chatcmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _prompt_details(usage) -> dict:
    """OpenAI's cached_tokens, plus Nibble's split by tier when the tiers are on (extension)."""
    details = {"cached_tokens": usage.cached_tokens}
    by_tier = getattr(usage, "cached_by_tier", None)
    if by_tier:
        details["cached_tokens_by_tier"] = dict(by_tier)
    return details


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": _prompt_details(usage),
    }


def finish_reason_str(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


class Formatter:
    """Builds one request's response objects; subclasses fix the endpoint's shapes."""

    object_full: str
    object_chunk: str

    def __init__(self, request_id: str, model: str, include_usage: bool = False):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage   # streaming only: usage null per chunk + final usage chunk

    def _envelope(self, obj: str, choices: list[dict], usage: Any = ...) -> dict[str, Any]:
        out = {"id": self.request_id, "object": obj, "created": self.created,
               "model": self.model, "system_fingerprint": None, "choices": choices}
        if usage is not ...:
            out["usage"] = usage
        return out

    def chunk(self, choice: dict) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [choice], None if self.include_usage else ...)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The final chunk of a stream with include_usage: empty choices, the usage."""
        return self._envelope(self.object_chunk, [], usage_dict(usage))

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    def text_chunk(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def finish_chunk(self, reason: FinishReason | None) -> dict[str, Any]:
        raise NotImplementedError

    def full(self, text: str, reason: FinishReason | None, usage: Usage) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    """``text_completion`` objects of /v1/completions."""

    object_full = object_chunk = "text_completion"

    @staticmethod
    def _choice(text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self.chunk(self._choice(text, None))

    def finish_chunk(self, reason: FinishReason | None) -> dict[str, Any]:
        return self.chunk(self._choice("", finish_reason_str(reason)))

    def full(self, text: str, reason: FinishReason | None, usage: Usage) -> dict[str, Any]:
        return self._envelope(self.object_full, [self._choice(text, finish_reason_str(reason))],
                              usage_dict(usage))


class ChatFormatter(Formatter):
    """``chat.completion`` / ``chat.completion.chunk`` objects of /v1/chat/completions."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _delta(self, delta: dict, reason: str | None) -> dict[str, Any]:
        return self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason})

    def start_chunks(self) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None)]

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._delta({"content": text}, None)

    def finish_chunk(self, reason: FinishReason | None) -> dict[str, Any]:
        return self._delta({}, finish_reason_str(reason))

    def full(self, text: str, reason: FinishReason | None, usage: Usage) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": None, "finish_reason": finish_reason_str(reason)}
        return self._envelope(self.object_full, [choice], usage_dict(usage))
