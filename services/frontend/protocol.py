"""OpenAI wire format: the request models (validated by FastAPI).

Requests are pydantic models that ignore unknown fields, as OpenAI-compatible
servers do. They validate strictly (``true`` is no token id, ``"1"`` no integer)
and refuse text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``),
so that what the published schema (/openapi.json) calls valid is exactly what
is accepted; options Nibble does not support accept only their "off" value.
The responses are built in responses.py.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema



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


MAX_CHOICES = 16
Choices = whole(ge=1, le=MAX_CHOICES)           # n: choices per request
NoTools = only(list, [], "tools are a chat feature: use /v1/chat/completions")
NoToolChoice = only(Text, "none", "tool_choice is a chat feature: use /v1/chat/completions")
MAX_TOOLS = 128
# OpenAI's function names: what every tool-call syntax can carry verbatim
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
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
    n: Choices | None = None                          # choices; the prompt is computed once
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
    response_format: ResponseFormat | None = None
    regex: Text | None = None                         # extension (SGLang): output matches it
    ebnf: Text | None = None                          # extension (SGLang): an EBNF grammar


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool | None = False                       # the prompt's text (and logprobs) first
    tools: NoTools = None
    tool_choice: NoToolChoice = None
    logprobs: CompletionLogprobs | None = None
    best_of: OneBestOf = None
    suffix: NoSuffix = None


class ContentPart(_Request):
    type: PartType
    text: Text


class CalledFunction(_Request):
    name: FunctionName
    arguments: Text                                 # JSON text of an object


class ToolCallIn(_Request):
    """A call of an earlier assistant turn, as the client sends it back."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None      # assistant: the calls it made
    tool_call_id: Text | None = None                # tool: the call this result answers


class FunctionDef(_Request):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None        # JSON Schema of the arguments object
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Positive | None = None   # wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None         # default true


def new_request_id(prefix: str) -> str:
    """Server-unique id such as ``chatcmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"
