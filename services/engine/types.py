"""Named types for every hop of a request through the engine.

``GenerateRequest`` (from a client) -> ``ScheduledBatch`` (scheduler picks the
step's work) -> ``WorkerOutput`` (model runner's result) -> ``RequestOutput``
(the engine core's update of one request, streamed back to the client).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .grammar_spec import GrammarSpec


MAX_TOP_LOGPROBS = 20                      # OpenAI's bound for top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one sampled token, and the most likely alternatives."""

    token_id: int
    logprob: float                         # log_softmax of the sampler's logits (after
                                           # penalties and temperature), natural log
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), best first


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
    min_p: float = 0.0                     # drop tokens below min_p x the top token's probability
    min_tokens: int = 0                    # EOS and stop tokens are masked until this many
    presence_penalty: float = 0.0          # subtracted once from every token already generated
    frequency_penalty: float = 0.0         # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0        # divides (>0) / multiplies (<0) logits of seen tokens
                                           # (prompt and output), as in HF and vLLM
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)
    logprobs: int | None = None            # None: off; N: the chosen token's logprob + top N
    grammar: GrammarSpec | None = None     # structured output: what the text must match
    prompt_logprobs: int | None = None     # N: each prompt token's logprob (from the model's
                                           # raw logits) + top N; computes the whole prompt

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def overlappable(self) -> bool:
        """A step of this request may be launched before the previous one's token reaches
        the host (no penalties, min_tokens or grammar: those need the host's tokens)."""
        return not self.needs_history and self.grammar is None and self.prompt_logprobs is None

    @property
    def needs_history(self) -> bool:
        """The logits depend on the tokens so far (penalties) or on how many were generated
        (min_tokens): the sampler needs them from the host, so such steps are not overlapped."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0)

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
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", param="min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens must be in [0, max_tokens]", param="min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2]", param=name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError("repetition_penalty must be in (0, 2]",
                                      param="repetition_penalty")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]",
                                      param="logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
                                          param="top_logprobs")


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
    logprobs: list[TokenLogprob] | None = None   # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token, when asked for:
                                           # one per prompt token; the first has logprob
                                           # and top None


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
    num_output: int = 0                    # tokens the request has generated so far (min_tokens)
    history: tuple[int, ...] | None = None  # prompt + generated tokens, for penalties only
    next_token: int | None = None          # prompt_logprobs: the prompt token after this chunk


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
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # rows that asked for them
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # per request:
                                           # the logprobs of the prompt tokens after each
                                           # position of its chunk
