"""Continuous-batching scheduler with prefix reuse, capacity-driven admission and preemption.

Each step every running sequence gets ``min(remaining, chunked_prefill_size,
budget)`` tokens: one for a decode, a chunk for a prefill; decodes go first.
Waiting requests are admitted (FCFS, or longest prefix match first with
``lpm``) while the batch has room and the pool can hold them: a request is
admitted only if the free pages, minus a reserve for the tokens the running
requests will still decode (scaled by ``schedule_conservativeness``), cover it
to its last token. On admission the longest cached prefix is locked and only
the rest is computed (extend path). If a running sequence still cannot grow,
the newest unscheduled sequence is preempted: its computed pages go into the
prefix cache, its references are dropped, and it is recomputed (mostly from
that cache) later. Nothing is dropped.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from nibble.tiering import KVPool, PageId
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.tier_manager import TierManager

from ..config import SchedulerConfig
from .sequence import Sequence, SeqStatus
from .types import ScheduledBatch, ScheduledSeq

log = logging.getLogger(__name__)
LPM_MAX_QUEUE = 128   # beyond this, lpm's per-step matching costs more than it saves


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: KVPool, cache: RadixCache | None = None,
                 tiers: TierManager | None = None):
        self.cfg = cfg
        self.pool = pool
        self.cache = cache
        self.tiers = tiers
        self.page_size = pool.layout.page_size
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
        need = _ceil_div(seq.num_computed + num_tokens, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if need > self.pool.allocator.num_free:
            return False
        seq.pages.extend(self.pool.allocate(need))
        return True

    def cache_computed(self, seq: Sequence) -> None:
        """Offer the sequence's fully computed pages to the prefix cache."""
        if self.cache is None:
            return
        full = min(seq.num_computed // self.page_size, len(seq.pages))
        if full:
            tokens = seq.token_ids[:full * self.page_size]
            self.cache.insert(tokens, seq.pages[:full], seq.namespace)
            if self.tiers is not None:
                self.tiers.on_cached(seq.namespace, tokens, seq.pages[:full])

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Cache what is reusable (unless ``cache`` is False), then drop the sequence's page
        references, tail first."""
        if cache:
            self.cache_computed(seq)
        if seq.pages:
            self.pool.free(list(reversed(seq.pages)))
            seq.pages = []

    def _future_pages(self, seq: Sequence) -> float:
        """Pages ``seq`` still needs: all for its current tokens, plus the decode part scaled by
        ``schedule_conservativeness`` (1 = hold back every future token: no preemption;
        0 = count none: admit eagerly and preempt when pages run out)."""
        now = _ceil_div(len(seq.token_ids), self.page_size)
        later = seq.pages_needed_total(self.page_size) - now
        return max(0, now - len(seq.pages)) + self.cfg.schedule_conservativeness * max(0, later)

    def _reserve(self) -> float:
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

    def _match(self, seq: Sequence) -> list[PageId]:
        """Longest cached prefix of ``seq`` (at least one token is left to compute)."""
        if self.cache is None or seq.no_reuse:
            return []
        limit = (len(seq.token_ids) - 1) // self.page_size
        return self.cache.match(seq.token_ids, seq.namespace, max_pages=limit).pages

    def _order_waiting(self) -> None:
        if self.cfg.schedule_policy == "lpm" and self.cache is not None and \
                1 < len(self.waiting) <= LPM_MAX_QUEUE:
            ranked = sorted(self.waiting, key=lambda s: -len(self._match(s)))
            self.waiting = deque(ranked)

    def _try_admit(self, seq: Sequence, budget: int) -> int | None:
        """Admit ``seq`` with its cached prefix; return its first chunk size.

        0: not enough room (stop admitting); None: its prefetch is still running.
        """
        hit = self._match(seq)
        limit = (len(seq.token_ids) - 1) // self.page_size
        tiers = self.tiers if self.cache is not None and not seq.no_reuse else None
        if tiers is not None and not tiers.prepare(seq.request_id, seq.namespace, seq.token_ids,
                                                   len(hit), limit):
            return None
        if hit:
            self.cache.lock(hit)
            if tiers is not None:
                tiers.note_hits(hit)
        seq.pages = list(hit)
        lower = None
        if tiers is not None:
            room = int(self.pool.allocator.num_free - self._reserve())
            lower = tiers.load(seq.request_id, seq.namespace, seq.token_ids, hit, limit, room)
            seq.pages += lower.pages
        seq.num_computed = seq.reused_tokens = len(seq.pages) * self.page_size
        n = min(seq.remaining, self.cfg.chunked_prefill_size, budget)
        if self._future_pages(seq) > self.pool.allocator.num_free - self._reserve() or \
                not self._grow(seq, n):
            self.release_hit(seq)
            return 0
        if not seq.admitted:
            seq.admitted = True
            seq.cached_tokens = seq.num_computed
            if lower is not None:
                ps = self.page_size
                seq.cached_by_tier = {"l1": len(hit) * ps, "l2": lower.from_l2 * ps,
                                      "l3": lower.from_l3 * ps}
            self.prompt_tokens_admitted += seq.num_prompt
            self.cached_tokens_admitted += seq.cached_tokens
            if self.on_start is not None:
                self.on_start(seq.request_id)
        return n

    def release_hit(self, seq: Sequence) -> None:
        """Undo a failed admission: unlock the matched pages without caching anything new."""
        if seq.pages:
            self.pool.free(list(reversed(seq.pages)))
        seq.pages, seq.num_computed, seq.reused_tokens = [], 0, 0

    def _entry(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed
        return ScheduledSeq(seq.request_id, seq.token_ids[start:start + n], start, start,
                            list(seq.pages), start + n == len(seq.token_ids),
                            seq.request.sampling)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work and reserve its pages."""
        budget = self.cfg.max_prefill_tokens
        out: list[ScheduledSeq] = []
        scheduled: set[str] = set()
        for seq in sorted(self.running, key=lambda s: s.remaining != 1):
            if seq.status is not SeqStatus.RUNNING or budget <= 0:
                continue
            n = min(seq.remaining, self.cfg.chunked_prefill_size, budget)
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
                budget -= n
        self._order_waiting()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            n = self._try_admit(seq, budget)
            if n is None:           # prefetch in flight: let later requests go first
                continue
            if not n:
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(self._entry(seq, n))
            scheduled.add(seq.request_id)
            budget -= n
        return ScheduledBatch(out)

    def remove(self, seq: Sequence, cache: bool = True) -> None:
        """Take a finished or aborted sequence out, cache its pages (unless ``cache`` is
        False) and drop its references."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq, cache)
        if self.tiers is not None:
            self.tiers.cancel(seq.request_id)
        seq.status = SeqStatus.FINISHED

    # ---- faults ----
    def drop_from_cache(self, seq: Sequence) -> list[PageId]:
        """Forget every cached page ``seq`` holds, and what hangs below it, in L1 and L2.

        Called when a step failed for ``seq``: its pages may be the poison, so no
        later request may match them. Refcounts are untouched (requests holding
        them keep them until they finish or fail on their own). Returns the
        pages dropped from the tree.
        """
        dropped: list[PageId] = []
        if self.cache is not None:
            for page in seq.pages:
                dropped += self.cache.evict_page(page)
        if self.tiers is not None and dropped:
            self.tiers.discard(dropped)
        return dropped

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
        if self.tiers is not None:
            self.tiers.cancel(seq.request_id)
        seq.num_computed = seq.reused_tokens = 0
        seq.no_reuse = True
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def flush_cache(self) -> bool:
        """Forget the prefix cache; refused (False) while any request is running or queued."""
        if self.has_work():
            return False
        if self.cache is not None:
            self.cache.flush()
        if self.tiers is not None:
            self.tiers.flush()
        return True
