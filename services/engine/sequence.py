"""Per-request state the scheduler and engine keep between steps."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nibble.tiering import PageId
from nibble.tiering.kv_cache_manager import Handle

from .types import FinishReason, GenerateRequest, TokenLogprob, Usage


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # holds pages, scheduled every step
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request's tokens and where its KV lives.

    ``token_ids`` is prompt + generated tokens. The first ``num_computed`` of
    them have K/V stored in the pages of ``handle`` (the KV cache manager's;
    None while the sequence holds no pages).
    """

    request: GenerateRequest
    token_ids: list[int]
    num_prompt: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    handle: Handle | None = None
    cached_tokens: int = 0                 # prompt tokens reused from the prefix cache (first admission)
    admitted: bool = False                 # admitted at least once (cached_tokens is final)
    cached_by_tier: dict[str, int] | None = None  # cached_tokens split l1/l2/l3 (tiers on)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    reused_tokens: int = 0                 # tokens of this run whose KV came from elsewhere (prefix
                                           # cache, L2/L3, a prefill worker), not computed here
    num_faults: int = 0                    # steps this request failed in (fault isolation)
    no_reuse: bool = False                 # recompute without any cached page (after a fault)
    num_pending: int = 0                   # overlap scheduling: trailing token_ids that are
                                           # placeholders for tokens still on the device
    incarnation: int = 0                   # bumped when a fault rolls the sequence back or it
                                           # ends: an in-flight step's token for it is dropped
    prompt_lps: dict[int, TokenLogprob] | None = None  # prompt_logprobs: position -> logprob
                                           # (a recomputed chunk overwrites its positions)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def namespace(self) -> str:
        """Prefix-cache namespace (tenant and cache_salt); requests share KV only within one."""
        return self.request.cache_salt or ""

    @property
    def pages(self) -> list[PageId]:
        """The block table (a copy; ``pages[i]`` holds tokens ``i*page_size ..``)."""
        return list(self.handle.pages) if self.handle is not None else []

    @property
    def num_pages(self) -> int:
        return self.handle.num_pages if self.handle is not None else 0

    @property
    def num_output(self) -> int:
        """Generated tokens known on the host (placeholders not counted)."""
        return len(self.token_ids) - self.num_prompt - self.num_pending

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:len(self.token_ids) - self.num_pending]

    @property
    def fully_scheduled(self) -> bool:
        """Overlap scheduling: the tokens in flight already reach max_tokens, so the
        sequence needs no further step (it ends when they land)."""
        return self.num_pending > 0 and \
            self.num_output + self.num_pending >= self.request.sampling.max_tokens

    @property
    def remaining(self) -> int:
        """Tokens still to run before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    def pages_needed_total(self, page_size: int) -> int:
        """Pages this sequence holds once it has produced all of max_tokens."""
        total = self.num_prompt + self.request.sampling.max_tokens
        return -(-total // page_size)

    def usage(self) -> Usage:
        return Usage(self.num_prompt, self.num_output, self.cached_tokens, self.cached_by_tier)
