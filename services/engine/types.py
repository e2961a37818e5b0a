"""Named types for every hop of a request through the engine.

``GenerateRequest`` (from a client) -> ``ScheduledBatch`` (scheduler picks the
step's work) -> ``WorkerOutput`` (model runner's result) -> ``RequestOutput``
(the engine core's update of one request, streamed back to the client).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding controls (OpenAI semantics)."""

    max_tokens: int = 16                   # completion tokens to generate at most (>= 1)
    temperature: float = 1.0               # 0 = greedy
    top_p: float = 1.0                     # nucleus mass in (0, 1]
    top_k: int = -1                        # -1 = off
    seed: int | None = None                # per-request RNG seed for reproducible sampling
    stop: tuple[str, ...] = ()             # stop strings; never included in the output
    stop_token_ids: tuple[int, ...] = ()   # extra stop tokens besides the model's EOS
    ignore_eos: bool = False               # keep going past EOS (benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check(self) -> None:
        """Raise InvalidRequestError for controls no sampler accepts (checked once, when the
        request enters the engine; the sampler trusts them)."""
        from ..errors import InvalidRequestError   # types.py stays import-light
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}",
                                      param="max_tokens")
        if self.temperature < 0.0:
            raise InvalidRequestError("temperature must be >= 0", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError("top_k must be -1 (off) or >= 1", param="top_k")


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, stop token or stop string
    LENGTH = "length"    # max_tokens or context length reached
    ABORT = "abort"      # client disconnect, /abort_request or shutdown


@dataclass
class GenerateRequest:
    """A tokenized request as the engine receives it."""

    request_id: str                        # unique per server
    prompt_token_ids: list[int]            # already tokenized (chat template applied)
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None          # tenant namespace for prefix reuse
    hold_pages: bool = False               # prefill worker: keep the pages after finishing


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0                 # prompt tokens served from the prefix cache
    cached_by_tier: dict[str, int] | None = None  # the same split by tier: {"l1", "l2", "l3"}


@dataclass
class RequestOutput:
    """One streamed update for one request (``EngineCore.step`` makes them)."""

    request_id: str
    new_token_ids: list[int]               # tokens produced since the last update
    text_delta: str                        # detokenized text since the last update
    finished: bool
    finish_reason: FinishReason | None
    usage: Usage
    error: str | None = None               # set when the request failed inside the engine
    error_type: str | None = None          # that failure's exception class name (services.errors),
                                           # e.g. RequestFaultError (this request alone) or
                                           # DeviceFaultError (the engine is dead)


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    request_id: str
    token_ids: list[int]                   # tokens to run this step (a prefill chunk, or 1 decode token)
    start_pos: int                         # position of token_ids[0] in the sequence
    num_cached: int                        # tokens of this sequence already in KV pages before the step
    block_table: list[int]                 # the handle's page ids, covering start_pos + len(token_ids)
    sample: bool                           # True when this step's last token produces a new token
    sampling: SamplingParams               # how to pick that token


@dataclass(frozen=True)
class ScheduledBatch:
    """All work of one engine step: prefill chunks first, then decodes."""

    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True)
class WorkerOutput:
    """The model runner's result for one ScheduledBatch."""

    sampled: dict[str, int]                # request_id -> new token, for seqs with sample=True
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why its row was unusable
                                           # (non-finite logits); such a request has no token
