"""Page handoff between a prefill worker and a decode worker (engine-thread side).

Decode side: ``reserve`` locks the cached prefix and allocates the pages the
prefill worker will write into, under a lease; ``install`` turns a filled
reservation into a running sequence that continues with decode; ``cancel`` and
``expire`` free reservations on every other path (failure, abort, timeout,
death of the peer).

Prefill side: a request with ``hold_pages`` keeps its pages after its one
sampled token, until ``release_held`` once they have been sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from nibble.tiering import PageId

from ..errors import InvalidRequestError, OutOfPagesError
from .sequence import Sequence, SeqStatus
from .types import GenerateRequest, RequestOutput


@dataclass
class Reservation:
    """Pages a decode worker holds for one request while its prefill runs elsewhere."""

    request_id: str
    prefix_pages: list[PageId]    # already cached here (locked); not transferred
    new_pages: list[PageId]       # written by the prefill worker, in order
    num_tokens: int               # prompt tokens the pages cover once filled
    deadline: float               # monotonic; the lease expires and frees the pages after it

    @property
    def pages(self) -> list[PageId]:
        return self.prefix_pages + self.new_pages


class Handoff:
    """Reservations and held pages of one EngineCore (engine thread only)."""

    def __init__(self, core):
        self.core = core
        self.reservations: dict[str, Reservation] = {}
        self.expired = 0
        # Called with a request id just before its reserved pages are freed (not when
        # installed): the worker revokes the transfer ticket so no late write lands.
        self.on_release: Callable[[str], None] | None = None

    # ---- decode side ----
    def reserve(self, req: GenerateRequest, lease_s: float) -> Reservation:
        """Lock the cached prefix and allocate the rest of the prompt's pages.

        Raises OutOfPagesError (retryable) when the pool cannot hold the whole
        request now, InvalidRequestError when it never could.
        """
        core, sch = self.core, self.core.scheduler
        core.validate(req)
        if req.request_id in self.reservations:
            raise InvalidRequestError(f"request {req.request_id} already has a reservation")
        ps = core.pool.layout.page_size
        seq = Sequence(req, list(req.prompt_token_ids), len(req.prompt_token_ids))
        hit = sch._match(seq)
        if hit:
            core.cache.lock(hit)
        seq.pages = list(hit)
        need = -(-len(seq.token_ids) // ps) - len(hit)
        if sch._future_pages(seq) > core.pool.allocator.num_free - sch._reserve() or \
                need > core.pool.allocator.num_free:
            sch.release_hit(seq)
            raise OutOfPagesError(f"no room for {len(seq.token_ids)} prompt tokens now")
        new = core.pool.allocate(need)
        res = Reservation(req.request_id, list(hit), new, len(seq.token_ids),
                          time.monotonic() + lease_s)
        self.reservations[req.request_id] = res
        return res

    def extend(self, request_id: str, lease_s: float) -> bool:
        """Heartbeat: push the lease's deadline out; False if the reservation is gone."""
        res = self.reservations.get(request_id)
        if res is None:
            return False
        res.deadline = max(res.deadline, time.monotonic() + lease_s)
        return True

    def cancel(self, request_id: str) -> bool:
        res = self.reservations.pop(request_id, None)
        if res is None:
            return False
        if self.on_release is not None:
            self.on_release(request_id)
        self.core.pool.free(list(reversed(res.pages)))
        return True

    def expire(self) -> list[str]:
        """Free every reservation whose lease ran out (peer or router gone)."""
        now = time.monotonic()
        gone = [rid for rid, r in self.reservations.items() if r.deadline < now]
        for rid in gone:
            self.cancel(rid)
        self.expired += len(gone)
        return gone

    def install(self, req: GenerateRequest, first_token: int) -> RequestOutput:
        """The reserved pages are filled: run the request from its first sampled token."""
        res = self.reservations.pop(req.request_id, None)
        if res is None:
            raise InvalidRequestError(f"no live reservation for {req.request_id} (expired?)")
        core = self.core
        core.register(req)
        seq = core._seqs[req.request_id]
        core.scheduler.waiting.remove(seq)
        seq.pages, seq.num_computed = res.pages, res.num_tokens
        seq.reused_tokens = res.num_tokens       # none of it computed here: a fault recomputes it
        seq.status, seq.admitted = SeqStatus.RUNNING, True
        seq.cached_tokens = len(res.prefix_pages) * core.pool.layout.page_size
        core.scheduler.running.append(seq)
        core.scheduler.prompt_tokens_admitted += seq.num_prompt
        core.scheduler.cached_tokens_admitted += seq.cached_tokens
        core.scheduler.cache_computed(seq)
        return core._on_token(seq, first_token)
