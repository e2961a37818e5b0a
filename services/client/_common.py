"""What Client and AsyncClient share: request building, results, retries, channels."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from nibble.proto.nibble.v1 import nibble_pb2 as pb

from .errors import NibbleClientError
from .results import GenerateResult, StreamChunk, Usage

DEFAULT_TARGET = "127.0.0.1:30001"
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort"}


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


def build_request(prompt: str | Sequence[int] | None, messages: Sequence[Mapping[str, str]] | None,
                  *, max_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: str | Sequence[str] | None = None,
                  stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
                  cache_salt: str | None = None, model: str | None = None,
                  request_id: str | None = None) -> pb.GenerateRequest:
    """A GenerateRequest from ``prompt`` (text or token ids) or chat ``messages``
    (``[{"role": ..., "content": ...}]``); unset parameters take the server's defaults."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) or messages")
    optional = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k, "seed": seed}
    sampling = pb.SamplingParams(**{k: v for k, v in optional.items() if v is not None},
                                 stop=[stop] if isinstance(stop, str) else list(stop or ()),
                                 stop_token_ids=list(stop_token_ids or ()),
                                 ignore_eos=ignore_eos)
    req = pb.GenerateRequest(request_id=request_id or "", model=model or "", sampling=sampling)
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                                 for m in messages)
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def chunk_of(msg: pb.GenerateResponse) -> StreamChunk:
    u = msg.usage
    usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                  dict(u.cached_tokens_by_tier))
    return StreamChunk(msg.request_id, tuple(msg.token_ids), msg.text, msg.finished,
                       FINISH_REASONS.get(msg.finish_reason), usage)


class Collector:
    """Folds a stream's chunks into one GenerateResult."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.last: StreamChunk | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.texts.append(chunk.text)
        self.ids.extend(chunk.token_ids)
        self.last = chunk

    def result(self) -> GenerateResult:
        last = self.last
        if last is None or not last.finished:
            raise NibbleClientError("the stream ended without its final message",
                                    code=grpc.StatusCode.INTERNAL)
        return GenerateResult(last.request_id, "".join(self.texts), tuple(self.ids),
                              last.finish_reason or "stop", last.usage)


def credentials(secure: bool, root_certificates: bytes | None, private_key: bytes | None,
                certificate_chain: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel. Any certificate implies TLS;
    ``secure=True`` alone uses the system's root certificates."""
    if not (secure or root_certificates or private_key or certificate_chain):
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
