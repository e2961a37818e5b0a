"""What Client and AsyncClient share: results, retries, channels (requests: request.py)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

from nibble.proto.nibble.v1 import nibble_pb2 as pb

from .errors import NibbleClientError
from .request import build_request  # noqa: F401  (re-exported for the clients)
from .results import (Choice, GenerateResult, StreamChunk, TokenLogprob, ToolCall, TopLogprob,
                      Usage)

DEFAULT_TARGET = "127.0.0.1:30001"
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: before attempt ``n + 1`` the client sleeps
    ``uniform(0, min(max_backoff, initial_backoff * multiplier ** (n - 1)))`` seconds.

    Only ``retry_codes`` are retried (UNAVAILABLE by default; never INVALID_ARGUMENT),
    only before a stream's first chunk, and only while the call's timeout allows.
    ``max_attempts=1`` turns retries off."""

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    retry_codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE})

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_backoff < 0 or self.multiplier < 1:
            raise ValueError("RetryPolicy needs max_attempts >= 1, initial_backoff >= 0 and "
                             "multiplier >= 1")
        if grpc.StatusCode.INVALID_ARGUMENT in self.retry_codes:
            raise ValueError("INVALID_ARGUMENT is never retried: the same input fails again")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return random.uniform(0, cap)


class Deadline:
    """An overall time budget (None = unbounded) shared by every attempt of one call."""

    def __init__(self, timeout: float | None):
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else max(self.at - time.monotonic(), 0.0)


def retry_delay(policy: RetryPolicy, err: grpc.RpcError, attempt: int,
                deadline: Deadline) -> float | None:
    """How long to sleep before retrying ``err``, or None when it must be raised."""
    if attempt >= policy.max_attempts or err.code() not in policy.retry_codes:
        return None
    delay = policy.delay(attempt)
    left = deadline.remaining()
    if left is not None and left <= delay:
        return None
    return delay


def _logprobs(msg: pb.GenerateResponse) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.token, lp.logprob,
                              tuple(TopLogprob(t.token_id, t.token, t.logprob) for t in lp.top))
                 for lp in msg.logprobs)


def chunk_of(msg: pb.GenerateResponse) -> StreamChunk:
    u = msg.usage
    usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                  dict(u.cached_tokens_by_tier))
    calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls)
    return StreamChunk(msg.request_id, tuple(msg.token_ids), msg.text, msg.finished,
                       FINISH_REASONS.get(msg.finish_reason), usage, msg.index,
                       _logprobs(msg), calls, msg.content if msg.HasField("content") else None)


class Collector:
    """Folds a stream's chunks (of every choice) into one GenerateResult."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.ids: dict[int, list[int]] = {}
        self.lps: dict[int, list[TokenLogprob]] = {}
        self.last: dict[int, StreamChunk] = {}

    def add(self, chunk: StreamChunk) -> None:
        i = chunk.index
        self.texts.setdefault(i, []).append(chunk.text)
        self.ids.setdefault(i, []).extend(chunk.token_ids)
        self.lps.setdefault(i, []).extend(chunk.logprobs)
        self.last[i] = chunk

    def result(self) -> GenerateResult:
        if not self.last or not all(c.finished for c in self.last.values()):
            raise NibbleClientError("the stream ended without its final message",
                                    code=grpc.StatusCode.INTERNAL)
        choices = tuple(Choice(i, "".join(self.texts[i]), tuple(self.ids[i]),
                               self.last[i].finish_reason or "stop", tuple(self.lps[i]),
                               self.last[i].tool_calls,
                               self.last[i].content if self.last[i].tool_calls
                               else "".join(self.texts[i]))
                        for i in sorted(self.last))
        usages = [c.usage for c in self.last.values()]
        tiers: dict[str, int] = {}
        for u in usages:
            for k, v in u.cached_tokens_by_tier.items():
                tiers[k] = tiers.get(k, 0) + v
        usage = Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                      sum(u.cached_tokens for u in usages), tiers)
        first = choices[0]
        return GenerateResult(self.last[first.index].request_id, first.text, first.token_ids,
                              first.finish_reason, usage, first.logprobs, first.tool_calls,
                              first.content, choices)


def credentials(secure: bool, root_certificates: bytes | None, private_key: bytes | None,
                certificate_chain: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel. Any certificate implies TLS;
    ``secure=True`` alone uses the system's root certificates."""
    if not (secure or root_certificates or private_key or certificate_chain):
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
