"""OpenAI wire format: request models (validated by FastAPI) and response builders.

Requests are pydantic models that ignore unknown fields, as OpenAI-compatible
servers do. They validate strictly (``true`` is no token id, ``"1"`` no integer)
and refuse text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``),
so that what the published schema (/openapi.json) calls valid is exactly what
is accepted; options Nibble does not support accept only their "off" value.

Responses are plain dicts in OpenAI's exact schema, built by the two formatters
below (one per endpoint); the serving code drives either one through the same
calls, so it never branches on the endpoint.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from ..engine.types import FinishReason, TokenLogprob, Usage


def valid_unicode(text: str) -> str:
    """``text`` unchanged, or ValueError for a lone surrogate (JSON's ``"\\ud800"`` decodes
    to one): it cannot be encoded as UTF-8, so no tokenizer, hash or response can take it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the text is not valid Unicode: a lone surrogate at "
                             f"character {exc.start}") from None
    return text


def integral(value: Any) -> Any:
    """JSON Schema counts ``75.0`` as an integer; strict validation then refuses only what
    is not a whole number (``true``, ``"75"``, ``75.5``)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def whole(**bounds: int) -> Any:
    """An integer type with ``Field`` bounds (ge/le) that takes integral floats. The bounds
    come before the validator so that the JSON schema shows them as minimum/maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(integral)]


Text = Annotated[str, AfterValidator(valid_unicode)]
NonEmptyText = Annotated[Text, Field(min_length=1)]
Int = whole()
TokenId = whole(ge=0)
Positive = whole(ge=1)
TopK = whole(ge=-1)                                   # -1 or 0 = off
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# JSON's safe integers (what any client can send exactly; torch.Generator.manual_seed
# takes more). A wider bound could not be checked exactly by a client that reads
# numbers as doubles, so schema-driven clients would disagree with the server.
MAX_SAFE_INT = 2**53 - 1
Seed = whole(ge=-MAX_SAFE_INT, le=MAX_SAFE_INT)


def only(tp: Any, off: Any, message: str) -> Any:
    """A field Nibble supports only at its "off" value ``off`` (or null): the schema says
    so, and any other value is refused with ``message``."""
    def check(value: Any) -> Any:
        if value is not None and value != off:
            raise ValueError(message)
        return value
    return Annotated[tp | None, AfterValidator(check),
                     WithJsonSchema({"anyOf": [{"const": off}, {"type": "null"}]})]


def _text_part(kind: str) -> str:
    if kind != "text":
        raise ValueError(f"only 'text' content parts are supported, got '{valid_unicode(kind)}'")
    return kind


OneChoice = only(Int, 1, "n must be 1: several choices per request are not supported")
NoEcho = only(bool, False, "echo is not supported")
NoTools = only(list, [], "tools (tool calling) are not supported yet")
NoToolChoice = only(Text, "none", "tool_choice is not supported yet (tool calling)")
CompletionLogprobs = whole(ge=0, le=5)         # OpenAI's bound for /v1/completions
TopLogprobs = whole(ge=0, le=20)
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
NonNegative = whole(ge=0)
TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,8})$"
# {"token id": bias}; the schema says it with patternProperties, which generators honour
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], Annotated[float, Field(ge=-100.0,
                                                                              le=100.0)]] | None,
    WithJsonSchema({"anyOf": [{"type": "object", "additionalProperties": False,
                               "patternProperties": {TOKEN_ID_KEY: {
                                   "type": "number", "minimum": -100, "maximum": 100}}},
                              {"type": "null"}]})]
OneBestOf = only(Int, 1, "best_of must be 1")
NoSuffix = only(str, "", "suffix is not supported")
PartType = Annotated[str, AfterValidator(_text_part), WithJsonSchema({"const": "text"})]
# Text, token ids, or a batch of exactly one of either (batches are not supported).
Prompt = (NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
          | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class JsonSchemaFormat(_Request):
    name: Text
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: Text | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (null = default)."""

    model: Text | None = None
    max_tokens: Positive | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: TopK | None = None         # extension; -1 or 0 = off
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None       # extension (vLLM)
    n: OneChoice = None                               # only 1 is supported
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False                   # extension (benchmarks)
    user: Text | None = None
    cache_salt: Text | None = None                    # extension: tenant namespace for prefix reuse
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)   # extension (vLLM)
    min_p: float | None = Field(None, ge=0.0, le=1.0)                 # extension (vLLM)
    min_tokens: NonNegative | None = None                             # extension (vLLM)
    logit_bias: LogitBias = None
    tools: NoTools = None
    tool_choice: NoToolChoice = None
    response_format: ResponseFormat | None = None
    regex: Text | None = None                         # extension (SGLang): output matches it
    ebnf: Text | None = None                          # extension (SGLang): an EBNF grammar


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: NoEcho = False
    logprobs: CompletionLogprobs | None = None
    best_of: OneBestOf = None
    suffix: NoSuffix = None


class ContentPart(_Request):
    type: PartType
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Positive | None = None   # wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None


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

    def __init__(self, request_id: str, model: str, include_usage: bool = False,
                 token_text: Callable[[int], str] | None = None):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage   # streaming only: usage null per chunk + final usage chunk
        self.token_text = token_text         # set when the request asked for logprobs
        self.offset = 0                      # completions: text offset of the next token

    def logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The endpoint's ``logprobs`` object for ``lps`` (None when not asked for)."""
        return None

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

    def text_chunk(self, text: str, lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def finish_chunk(self, reason: FinishReason | None) -> dict[str, Any]:
        raise NotImplementedError

    def full(self, text: str, reason: FinishReason | None, usage: Usage,
             lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        raise NotImplementedError


# JSON has no -inf: a token the processed logits rule out (a bias of -100, min_tokens, a top
# entry beyond the finite ones) is reported at OpenAI's floor
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class CompletionFormatter(Formatter):
    """``text_completion`` objects of /v1/completions."""

    object_full = object_chunk = "text_completion"

    @staticmethod
    def _choice(text: str, reason: str | None, logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (legacy shape)."""
        if self.token_text is None or lps is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps],
                "top_logprobs": [{self.token_text(t): _lp(v) for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def text_chunk(self, text: str, lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return self.chunk(self._choice(text, None, self.logprobs(lps)))

    def finish_chunk(self, reason: FinishReason | None) -> dict[str, Any]:
        return self.chunk(self._choice("", finish_reason_str(reason)))

    def full(self, text: str, reason: FinishReason | None, usage: Usage,
             lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        choice = self._choice(text, finish_reason_str(reason), self.logprobs(lps or []))
        return self._envelope(self.object_full, [choice], usage_dict(usage))


class ChatFormatter(Formatter):
    """``chat.completion`` / ``chat.completion.chunk`` objects of /v1/chat/completions."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _delta(self, delta: dict, reason: str | None, logprobs: dict | None = None
               ) -> dict[str, Any]:
        return self.chunk({"index": 0, "delta": delta, "logprobs": logprobs,
                           "finish_reason": reason})

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    def logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
        if self.token_text is None or lps is None:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                            for lp in lps], "refusal": None}

    def start_chunks(self) -> list[dict[str, Any]]:
        return [self._delta({"role": "assistant", "content": ""}, None)]

    def text_chunk(self, text: str, lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return self._delta({"content": text}, None, self.logprobs(lps))

    def finish_chunk(self, reason: FinishReason | None) -> dict[str, Any]:
        return self._delta({}, finish_reason_str(reason))

    def full(self, text: str, reason: FinishReason | None, usage: Usage,
             lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": self.logprobs(lps or []),
                  "finish_reason": finish_reason_str(reason)}
        return self._envelope(self.object_full, [choice], usage_dict(usage))
