"""Typed results of the SDK (frozen dataclasses)."""

from __future__ import annotations

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
class StreamChunk:
    """One streamed update: the tokens and text produced since the previous chunk."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None               # "stop", "length" or "abort" on the last chunk
    usage: Usage                            # cumulative


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str                      # "stop", "length" or "abort"
    usage: Usage


@dataclass(frozen=True)
class ServerInfo:
    model: str
    context_length: int
    details: Mapping[str, Any]              # everything /get_server_info reports
