"""The disaggregation connector: page handoff between a prefill and a decode worker.

Colocated serving runs without one (``EngineCore.connector`` is None). A
worker attaches one (``EngineCore.attach_connector``); it keeps every piece of
handoff state outside the engine core, on the engine thread:

* decode side: ``reserve`` locks the cached prefix and takes the pages the
  prefill worker will write into, under a lease (``extend`` renews it;
  ``expire``, run by the scheduler each step and by the idle engine, frees
  those that ran out); ``cancel`` frees one on every other path (failure,
  abort, peer death). ``EngineCore.add_prefilled`` then runs the request on
  the filled pages through the scheduler hooks below.
* prefill side: a request with ``hold_pages`` keeps its pages after its one
  sampled token (``on_finished``) until ``release_held`` once they are sent.

Scheduler hooks, in the spirit of vLLM's KV connector: ``matched_tokens``
(prompt tokens whose KV a peer wrote here), ``on_allocated`` (the sequence
takes the reservation's pages over) and ``on_finished`` (the connector may
keep a finished sequence's pages). Time comes from the injected ``clock``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from nibble.tiering.kv_cache_manager import Handle, KVCacheManager, PageId

from ..errors import InvalidRequestError, OutOfPagesError
from .sequence import Sequence
from .types import FinishReason, GenerateRequest


@dataclass
class Reservation:
    """Pages a decode worker holds for one request while its prefill runs elsewhere."""

    request_id: str
    handle: Handle                # the cached prefix (locked), then the pages to be written
    num_tokens: int               # prompt tokens the pages cover once filled
    deadline: float               # on the connector's clock; the lease frees the pages after it

    @property
    def prefix_pages(self) -> list[PageId]:
        """Already cached here; not transferred."""
        return list(self.handle.pages[:self.handle.from_l1])

    @property
    def new_pages(self) -> list[PageId]:
        """Written by the prefill worker, in order."""
        return list(self.handle.pages[self.handle.from_l1:])

    @property
    def pages(self) -> list[PageId]:
        return list(self.handle.pages)


class KVConnector:
    """Reservations, leases and held pages of one engine (engine thread only).

    ``clock``: monotonic seconds (a fake one in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.reservations: dict[str, Reservation] = {}
        self.held: dict[str, tuple[Handle, int]] = {}   # prefill side: rid -> (pages, tokens)
        self.expired = 0
        self._kv: KVCacheManager | None = None
        self._scheduler = None
        self._validate: Callable[[GenerateRequest], None] | None = None
        # Called with a request id just before its reserved pages are freed (not when
        # installed): the worker revokes the transfer ticket so no late write lands.
        self.on_release: Callable[[str], None] | None = None

    def bind(self, scheduler, validate: Callable[[GenerateRequest], None]) -> None:
        """Attach to an engine: its scheduler (room accounting, ``kv``) and request check."""
        self._scheduler, self._kv, self._validate = scheduler, scheduler.kv, validate

    # ---- decode side ----
    def reserve(self, req: GenerateRequest, lease_s: float) -> Reservation:
        """Lock the cached prefix and take the rest of the prompt's pages.

        Raises OutOfPagesError (retryable) when the pool cannot hold the whole
        request now, InvalidRequestError when it never could.
        """
        self._validate(req)
        if req.request_id in self.reservations:
            raise InvalidRequestError(f"request {req.request_id} already has a reservation")
        seq = Sequence(req, list(req.prompt_token_ids), len(req.prompt_token_ids))
        sch = self._scheduler
        handle = self._kv.reserve(seq, self._kv.match(seq), headroom=sch.reserved_pages(),
                                  future=sch.future_decode_pages(seq))
        if handle is None:
            raise OutOfPagesError(f"no room for {len(seq.token_ids)} prompt tokens now")
        res = Reservation(req.request_id, handle, len(seq.token_ids), self.clock() + lease_s)
        self.reservations[req.request_id] = res
        return res

    def has_reservation(self, request_id: str) -> bool:
        return request_id in self.reservations

    def extend(self, request_id: str, lease_s: float) -> bool:
        """Heartbeat: push the lease's deadline out; False if the reservation is gone."""
        res = self.reservations.get(request_id)
        if res is None:
            return False
        res.deadline = max(res.deadline, self.clock() + lease_s)
        return True

    def cancel(self, request_id: str) -> bool:
        res = self.reservations.pop(request_id, None)
        if res is None:
            return False
        if self.on_release is not None:
            self.on_release(request_id)
        self._kv.release(res.handle)
        return True

    def expire(self) -> list[str]:
        """Free every reservation whose lease ran out (peer or router gone)."""
        now = self.clock()
        gone = [rid for rid, r in self.reservations.items() if r.deadline < now]
        for rid in gone:
            self.cancel(rid)
        self.expired += len(gone)
        return gone

    # ---- scheduler hooks ----
    def matched_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of ``seq`` whose KV a peer wrote into a live reservation (0: none)."""
        res = self.reservations.get(seq.request_id)
        return res.num_tokens if res is not None else 0

    def on_allocated(self, seq: Sequence) -> Handle:
        """``seq`` runs on its reservation's pages: hand them over; the lease ends."""
        return self.reservations.pop(seq.request_id).handle

    def on_finished(self, seq: Sequence) -> bool:
        """Keep a finished ``hold_pages`` sequence's pages (cached and referenced) until they
        are sent; True when the connector took them."""
        if not seq.request.hold_pages or seq.finish_reason is FinishReason.ABORT or \
                seq.handle is None:
            return False
        self._kv.commit(seq.handle, seq.token_ids[:seq.num_computed])
        self.held[seq.request_id] = (seq.handle, seq.num_computed)
        return True

    # ---- prefill side ----
    def held_pages(self, request_id: str) -> tuple[list[PageId], int] | None:
        """``(pages, tokens)`` a finished ``hold_pages`` request kept, or None."""
        got = self.held.get(request_id)
        return None if got is None else (list(got[0].pages), got[1])

    def release_held(self, request_id: str) -> bool:
        """Drop the pages a finished ``hold_pages`` request kept (they stay cached)."""
        handle, _ = self.held.pop(request_id, (None, 0))
        if handle is None:
            return False
        self._kv.release(handle)
        return True

    def stats(self) -> dict:
        return {"reservations": len(self.reservations), "held": len(self.held),
                "expired_leases": self.expired}
