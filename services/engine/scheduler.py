"""Continuous-batching scheduler with prefix reuse, capacity-driven admission and preemption.

Each step every running sequence gets ``min(remaining, chunked_prefill_size,
budget)`` tokens: one for a decode, a chunk for a prefill; decodes go first. With
``chunk_cost_context`` a chunk's cost grows with its cached prefix
(``step_budget.py``), so chunks of a long prompt shrink as it proceeds.
Waiting requests are admitted (FCFS, or longest prefix match first with
``lpm``) while the batch has room and the pool can hold them: a request is
admitted only if the free pages, minus a reserve for the tokens the running
requests will still decode (scaled by ``schedule_conservativeness``), cover it
to its last token. On admission the longest cached prefix is locked and only
the rest is computed (extend path). If a running sequence still cannot grow,
the newest unscheduled sequence is preempted: its computed pages go into the
prefix cache, its references are dropped, and it is recomputed (mostly from
that cache) later. Nothing is dropped.

Pages come only from the ``KVCacheManager`` (``kv``): ``match`` -> ``ready``
(a tier prefetch may hold the request) -> ``admit`` (lock, load from L2,
room check, first chunk's pages) -> ``grow`` each step -> ``commit`` /
``release``. A disaggregated worker's ``KVConnector`` adds hooks
(``matched_tokens``, ``on_allocated``, ``on_finished``).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from nibble.tiering.kv_cache_manager import KVCacheManager, PageId

from ..config import SchedulerConfig
from ..errors import InvalidRequestError
from .sequence import Sequence, SeqStatus
from .step_budget import chunk_cost, max_chunk
from .types import ScheduledBatch, ScheduledSeq

log = logging.getLogger(__name__)
LPM_MAX_QUEUE = 128   # beyond this, lpm's per-step matching costs more than it saves
IDLE_WAIT_S = 0.001   # an empty step with requests queued: only prefetches hold them


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """``kv``: the KV cache manager (the only cache interface the scheduler uses);
    ``connector``: the disaggregation connector (``kv_connector.KVConnector``), or
    None for colocated serving."""

    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, connector=None):
        self.cfg = cfg
        self.kv = kv
        self.connector = connector
        self.page_size = kv.page_size
        # 0: the budget counts tokens; else chunks are cost-weighted (step_budget.py). -1
        # (from the model) is resolved by the builder; a bare scheduler counts tokens.
        self.cost_ctx = max(0, cfg.chunk_cost_context)
        self.min_chunk = max(self.page_size, cfg.chunked_prefill_size // 8)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0                      # totals, for metrics and tests
        self.prompt_tokens_admitted = 0
        self.cached_tokens_admitted = 0
        # Called with a request id when the request first gets a running slot (admission gate).
        self.on_start: Callable[[str], None] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- pages ----
    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` pages for ``num_tokens`` more tokens; False if the pool is short."""
        return self.kv.grow(seq.handle, seq.num_computed + num_tokens)

    def cache_computed(self, seq: Sequence, upto: int | None = None) -> None:
        """Offer the sequence's fully computed pages (of its first ``upto`` tokens, default
        all computed ones) to the prefix cache."""
        if seq.handle is not None:
            n = seq.num_computed if upto is None else min(upto, seq.num_computed)
            self.kv.commit(seq.handle, seq.token_ids[:n])

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Cache what is reusable (unless ``cache`` is False), then drop the sequence's page
        references, tail first."""
        if seq.handle is None:
            return
        if cache:
            self.cache_computed(seq)
        self.kv.release(seq.handle)
        seq.handle = None

    def _future_pages(self, seq: Sequence) -> float:
        """Pages ``seq`` still needs: all for its current tokens, plus the decode part scaled by
        ``schedule_conservativeness`` (1 = hold back every future token: no preemption;
        0 = count none: admit eagerly and preempt when pages run out)."""
        now = _ceil_div(len(seq.token_ids), self.page_size)
        return max(0, now - seq.num_pages) + self.future_decode_pages(seq)

    def future_decode_pages(self, seq: Sequence) -> float:
        """Pages ``seq`` may claim after its current tokens, scaled by the conservativeness."""
        later = seq.pages_needed_total(self.page_size) - _ceil_div(len(seq.token_ids),
                                                                   self.page_size)
        return self.cfg.schedule_conservativeness * max(0, later)

    def reserved_pages(self) -> float:
        """Pages the running sequences may still claim."""
        return sum(self._future_pages(s) for s in self.running)

    # ---- policy ----
    def _preempt(self, victim: Sequence) -> None:
        log.info("preempting %s (%d tokens) to free pages", victim.request_id, victim.num_computed)
        self.running.remove(victim)
        self.release(victim)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)

    def _order_waiting(self) -> None:
        if self.cfg.schedule_policy == "lpm" and self.kv.cache is not None and \
                1 < len(self.waiting) <= LPM_MAX_QUEUE:
            ranked = sorted(self.waiting, key=lambda s: -self.kv.match(s).num_pages)
            self.waiting = deque(ranked)

    def _try_admit(self, seq: Sequence, budget: float, alone: bool) -> int | None:
        """Admit ``seq`` with its cached prefix; return its first chunk size.

        0: not enough room (stop admitting); None: its prefetch is still running.
        """
        if seq.num_pending:          # preempted with a token in flight: admit once it lands
            return None
        hit = self.kv.match(seq)
        if not self.kv.ready(seq, hit):
            return None
        if not self._chunk(seq, budget, hit.num_pages * self.page_size, alone):
            return 0                 # only a sliver of the budget is left: admit next step
        handle = self.kv.admit(seq, hit, min(self.cfg.chunked_prefill_size, int(budget)),
                               headroom=self.reserved_pages(),
                               future=self.future_decode_pages(seq))
        if handle is None:
            return 0
        seq.handle = handle
        seq.num_computed = seq.reused_tokens = handle.num_reused * self.page_size
        if not seq.admitted:
            ps = self.page_size
            tiers = None if self.kv.tiers is None or seq.no_reuse else \
                {"l1": handle.from_l1 * ps, "l2": handle.from_l2 * ps, "l3": handle.from_l3 * ps}
            self._started(seq, seq.num_computed, tiers)
        return self._chunk(seq, budget, seq.num_computed, True)

    def _chunk(self, seq: Sequence, budget: float, cached: int, alone: bool) -> int:
        """Tokens of ``seq`` this step: a decode's one, or a prefill chunk that fits the
        budget at its cost (``step_budget.chunk_cost``) after ``cached`` tokens. With costs,
        0 for a chunk below ``min_chunk`` unless it is the step's first (``alone``): the
        budget's leftovers would otherwise start every waiting prompt in slivers."""
        n = min(seq.remaining, self.cfg.chunked_prefill_size, max(1, int(budget)))
        if seq.remaining > 1 and self.cost_ctx:
            n = min(n, max_chunk(budget, cached, self.cost_ctx))
            if not alone and n < min(seq.remaining, self.min_chunk):
                return 0
        return n

    def _started(self, seq: Sequence, cached: int, by_tier: dict[str, int] | None,
                 gate: bool = True) -> None:
        """First admission of ``seq``: its cache accounting is final."""
        seq.admitted = True
        seq.cached_tokens, seq.cached_by_tier = cached, by_tier
        self.prompt_tokens_admitted += seq.num_prompt
        self.cached_tokens_admitted += cached
        if gate and self.on_start is not None:
            self.on_start(seq.request_id)

    def start_prefilled(self, seq: Sequence) -> None:
        """Run ``seq`` on the pages the connector holds for it (a peer computed its prompt):
        it joins the running batch at once, past admission. InvalidRequestError when the
        connector holds nothing for it (the reservation expired)."""
        tokens = self.connector.matched_tokens(seq) if self.connector is not None else 0
        if not tokens:
            raise InvalidRequestError(f"no live reservation for {seq.request_id} (expired?)")
        seq.handle = self.connector.on_allocated(seq)
        seq.num_computed = seq.reused_tokens = tokens   # not computed here: a fault recomputes it
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._started(seq, seq.handle.from_l1 * self.page_size, None, gate=False)
        self.cache_computed(seq)

    def _entry(self, seq: Sequence, n: int) -> ScheduledSeq:
        start, sp = seq.num_computed, seq.request.sampling
        sample = start + n == len(seq.token_ids)
        history = tuple(seq.token_ids[:len(seq.token_ids) - seq.num_pending]) \
            if sample and sp.needs_history else None
        nxt = seq.token_ids[start + n] \
            if sp.prompt_logprobs is not None and start + n < seq.num_prompt else None
        return ScheduledSeq(seq.request_id, seq.token_ids[start:start + n], start, start,
                            list(seq.pages), sample, sp, seq.num_output, history, nxt)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work and reserve its pages (after applying finished tier work and
        expired leases)."""
        self.kv.poll()
        if self.connector is not None:
            self.connector.expire()
        budget = self.cfg.max_prefill_tokens
        out: list[ScheduledSeq] = []
        scheduled: set[str] = set()
        alone = True                 # no prompt chunk in this step yet
        for seq in sorted(self.running, key=lambda s: s.remaining != 1):
            if seq.status is not SeqStatus.RUNNING or budget <= 0 or seq.fully_scheduled:
                continue
            n = self._chunk(seq, budget, seq.num_computed, alone)
            if not n:
                continue
            cost = chunk_cost(n, seq.num_computed, self.cost_ctx)
            while not self._grow(seq, n):
                # Newest sequence not yet in this step's batch; else seq itself.
                victim = next((s for s in reversed(self.running)
                               if s.request_id not in scheduled), seq)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                out.append(self._entry(seq, n))
                scheduled.add(seq.request_id)
                budget -= cost
                alone = alone and n == 1
        self._order_waiting()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            n = self._try_admit(seq, budget, alone)
            if n is None:           # prefetch in flight: let later requests go first
                continue
            if not n:
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(self._entry(seq, n))
            scheduled.add(seq.request_id)
            budget -= chunk_cost(n, seq.num_computed, self.cost_ctx)
            alone = False
        if not out and self.waiting:
            self.kv.wait(IDLE_WAIT_S)
        return ScheduledBatch(out)

    def remove(self, seq: Sequence, cache: bool = True) -> None:
        """Take a finished or aborted sequence out, cache its pages (unless ``cache`` is
        False) and drop its references."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.connector is not None and self.connector.on_finished(seq):
            seq.handle = None              # the connector keeps the pages (hold_pages)
        self.release(seq, cache)
        self.kv.cancel(seq)
        seq.incarnation += 1
        seq.status = SeqStatus.FINISHED

    # ---- faults ----
    def drop_from_cache(self, seq: Sequence) -> list[PageId]:
        """Forget every cached page ``seq`` holds, and what hangs below it, in L1 and L2.

        Called when a step failed for ``seq``: its pages may be the poison, so no
        later request may match them. Refcounts are untouched (requests holding
        them keep them until they finish or fail on their own). Returns the
        pages dropped from the tree.
        """
        return self.kv.drop(seq.handle) if seq.handle is not None else []

    def requeue(self, seq: Sequence) -> None:
        """Recompute ``seq`` from its first token without reusing any cached page.

        Its pages are freed without being cached; it goes to the head of the
        queue and keeps the tokens it has already streamed.
        """
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq, cache=False)
        self.kv.cancel(seq)
        seq.num_computed = seq.reused_tokens = 0
        seq.incarnation += 1
        seq.no_reuse = True
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def flush_cache(self) -> bool:
        """Forget the prefix cache; refused (False) while any request is running or queued."""
        if self.has_work():
            return False
        self.kv.flush()
        return True
