"""Continuous-batching scheduler: decodes first, then prefill chunks, within a token budget.

Each step every running sequence gets ``min(remaining, chunked_prefill_size,
budget)`` tokens: one for a decode, a chunk for a prefill. Waiting requests
are admitted FCFS while the batch has room and the pool has pages for their
first chunk. When a running sequence needs a page and none is free, the newest
running sequence is preempted: its pages are freed and it is recomputed later
(nothing is dropped).
"""

from __future__ import annotations

import logging
from collections import deque

from nibble.tiering import KVPool

from ..config import SchedulerConfig
from .sequence import Sequence, SeqStatus
from .types import ScheduledBatch, ScheduledSeq

log = logging.getLogger(__name__)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: KVPool):
        self.cfg = cfg
        self.pool = pool
        self.page_size = pool.layout.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0                      # total, for metrics and tests

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` pages for ``num_tokens`` more tokens; False if the pool is short."""
        need = _ceil_div(seq.num_computed + num_tokens, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if need > self.pool.allocator.num_free:
            return False
        seq.pages.extend(self.pool.allocate(need))
        return True

    def release(self, seq: Sequence) -> None:
        """Free a sequence's pages, tail first."""
        if seq.pages:
            self.pool.free(list(reversed(seq.pages)))
            seq.pages = []

    def _preempt(self, victim: Sequence) -> None:
        log.info("preempting %s (%d tokens) to free pages", victim.request_id, victim.num_computed)
        self.running.remove(victim)
        self.release(victim)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)

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
        # Decodes first (latency), then running prefills; sorted is stable.
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
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            seq = self.waiting[0]
            n = min(seq.remaining, self.cfg.chunked_prefill_size, budget)
            if not self._grow(seq, n):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(self._entry(seq, n))
            budget -= n
        return ScheduledBatch(out)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        seq.status = SeqStatus.FINISHED
