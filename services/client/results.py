"""Typed results of the SDK (frozen dataclasses)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0                  # prompt tokens served from the prefix cache
    cached_tokens_by_tier: Mapping[str, int] = field(default_factory=dict)  # l1/l2/l3

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float                          # natural log


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob (after temperature and penalties, before a grammar's
    mask) and the most likely alternatives, best first."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str                          # JSON text of an object

    def parsed_arguments(self) -> dict[str, Any]:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class StreamChunk:
    """One streamed update of choice ``index``: the tokens and text produced since that
    choice's previous chunk."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None               # "stop", "length", "abort" or "tool_calls"
    usage: Usage                            # cumulative for this choice
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # of this chunk's tokens, when asked for
    tool_calls: tuple[ToolCall, ...] = ()   # the choice's calls, on its last chunk
    content: str | None = None              # with tool_calls: the text around them


@dataclass(frozen=True)
class Choice:
    index: int
    text: str                               # the whole output (calls included)
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None              # the text without the calls (None: calls only)


@dataclass(frozen=True)
class GenerateResult:
    """A finished request; the top-level fields are choice 0's, ``choices`` has all n."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str                      # "stop", "length", "abort" or "tool_calls"
    usage: Usage                            # the prompt once, completions of every choice
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None
    choices: tuple[Choice, ...] = ()


@dataclass(frozen=True)
class ServerInfo:
    model: str
    context_length: int
    details: Mapping[str, Any]              # everything /get_server_info reports
