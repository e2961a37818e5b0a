"""Signed transfer tickets and the receiver's book of the tickets it issued.

The receiving (decode) worker reserves pages, then *issues* a ticket naming
them (or signs one itself and registers it with ``expect``); the sender writes
into exactly those pages. A ticket is single use. The
book decides its fate, which the worker reads through ``KVTransport.received``
(pages ready to install) and ``KVTransport.rejected`` (free or recompute):

    issued --admit--> active --complete--> received
       |                 |
       +--- close(reason: deadline, signature, checksum, aborted, ...) --> rejected

An issued or active ticket is closed as expired ``grace_s`` after its deadline.
A refused attempt that names no open ticket, or one refused before any byte
could land (gRPC), is reported with ``ticket_closed=False``: the real ticket
stays valid.
"""

from __future__ import annotations

import collections
import enum
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from . import signing
from .errors import TicketError, TransferArgumentError


class RejectReason(str, enum.Enum):
    SIGNATURE = "signature"
    DEADLINE = "deadline"
    UNKNOWN = "unknown_ticket"
    REUSED = "reused_ticket"
    INVALID = "invalid"
    CHECKSUM = "checksum"
    ABORTED = "aborted"


@dataclass(frozen=True)
class TransferTicket:
    """Permission to write ``dst_pages`` of one receiver before ``deadline`` (unix seconds).

    ``signature``: HMAC-SHA256 over the other fields and the receiver's
    endpoint id (``signing.sign``).
    """

    request_id: str
    ticket_id: str
    dst_pages: tuple[int, ...]
    page_nbytes: int
    deadline: float
    signature: bytes = b""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst_pages", tuple(int(p) for p in self.dst_pages))
        object.__setattr__(self, "signature", bytes(self.signature))

    @property
    def nbytes(self) -> int:
        return len(self.dst_pages) * self.page_nbytes


def make_ticket(secret: bytes, receiver_id: str, request_id: str, dst_pages: Sequence[int],
                page_nbytes: int, deadline: float, ticket_id: str | None = None
                ) -> TransferTicket:
    """A ticket signed for ``receiver_id`` (``ticket_id`` random unless given)."""
    t = TransferTicket(str(request_id), ticket_id or secrets.token_hex(16), dst_pages,
                       int(page_nbytes), float(deadline))
    return signing.sign_ticket(t, secret, receiver_id)


@dataclass(frozen=True)
class CompletedTransfer:
    """Every byte of a ticket's pages has landed; the worker may install them."""

    ticket_id: str
    request_id: str
    dst_pages: tuple[int, ...]
    nbytes: int
    checksum: str | None = None  # the sender's page-set SHA-256, verified when present


@dataclass(frozen=True)
class RejectedTransfer:
    """A refused write. ``ticket_closed``: the issued ticket is dead, its pages hold no data."""

    ticket_id: str
    request_id: str
    reason: RejectReason
    detail: str
    ticket_closed: bool
    dst_pages: tuple[int, ...] = ()


@dataclass
class _Entry:
    ticket: TransferTicket
    active: bool = False
    open: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)


class TicketBook:
    """The tickets one receiver issued (thread safe)."""

    def __init__(self, secret: bytes, receiver_id: str, num_pages: int, page_nbytes: int,
                 grace_s: float = 2.0, clock: Callable[[], float] = time.time,
                 on_close: Callable[[tuple[int, ...]], None] | None = None,
                 remember_closed: int = 4096, max_events: int = 65536):
        self.secret, self.receiver_id, self.on_close = secret, receiver_id, on_close
        self.num_pages, self.page_nbytes, self.grace_s, self.clock = (
            num_pages, page_nbytes, grace_s, clock)
        self._lock = threading.Lock()
        self._open: dict[str, _Entry] = {}
        self._closed: collections.OrderedDict[str, RejectReason | None] = collections.OrderedDict()
        self._remember = remember_closed
        # Bounded: a worker that never drains them must not grow without limit.
        self._received: collections.deque[CompletedTransfer] = collections.deque(maxlen=max_events)
        self._rejected: collections.deque[RejectedTransfer] = collections.deque(maxlen=max_events)

    def issue(self, request_id: str, dst_pages: Sequence[int], ttl_s: float) -> TransferTicket:
        self._check_pages(dst_pages)
        t = make_ticket(self.secret, self.receiver_id, request_id, dst_pages, self.page_nbytes,
                        self.clock() + ttl_s)
        with self._lock:
            self._open[t.ticket_id] = _Entry(t)
        return t

    def expect(self, ticket: TransferTicket) -> None:
        """Open a ticket signed elsewhere for this receiver (verified here)."""
        self._check_pages(ticket.dst_pages)
        if ticket.page_nbytes != self.page_nbytes:
            raise TransferArgumentError(
                f"ticket pages are {ticket.page_nbytes} bytes, this pool's {self.page_nbytes}")
        if not signing.verify(self.secret, ticket, self.receiver_id, ticket.signature):
            raise TicketError(RejectReason.SIGNATURE, "ticket is not signed for this receiver")
        with self._lock:
            if ticket.ticket_id in self._open or ticket.ticket_id in self._closed:
                raise TicketError(RejectReason.REUSED, f"ticket {ticket.ticket_id} is known")
            self._open[ticket.ticket_id] = _Entry(ticket)

    def _check_pages(self, dst_pages: Sequence[int]) -> None:
        pages = [int(p) for p in dst_pages]
        if not pages or len(set(pages)) != len(pages) or not all(
                0 <= p < self.num_pages for p in pages):
            raise TransferArgumentError(
                f"dst_pages must be distinct page ids in [0, {self.num_pages}), got {pages[:8]}")

    def admit(self, ticket: TransferTicket, close_on_refusal: bool = False) -> _Entry:
        """Accept ``ticket`` for writing, or record the refusal and raise TicketError.

        A passed deadline closes the ticket. ``close_on_refusal`` closes the
        issued ticket of that id for any refusal: use it when bytes may already
        have landed (RDMA), so they are discarded.
        """
        try:
            return self._admit(ticket)
        except TicketError as e:
            closed = None
            if close_on_refusal or e.reason == RejectReason.DEADLINE:
                closed = self.close(ticket.ticket_id, RejectReason(e.reason), e.detail)
            if closed is None:
                self.refuse(ticket.ticket_id, ticket.request_id, RejectReason(e.reason), e.detail)
            raise

    def _admit(self, ticket: TransferTicket) -> _Entry:
        if not signing.verify(self.secret, ticket, self.receiver_id, ticket.signature):
            raise TicketError(RejectReason.SIGNATURE, f"ticket {ticket.ticket_id} is not signed "
                              "for this receiver with the shared secret")
        with self._lock:
            entry = self._open.get(ticket.ticket_id)
            if entry is None:
                if ticket.ticket_id not in self._closed:
                    reason = RejectReason.UNKNOWN
                elif self._closed[ticket.ticket_id] == RejectReason.DEADLINE:
                    reason = RejectReason.DEADLINE
                else:
                    reason = RejectReason.REUSED
                raise TicketError(reason, f"ticket {ticket.ticket_id} is not open here")
            if entry.ticket != ticket:
                raise TicketError(RejectReason.SIGNATURE, "ticket differs from the one issued")
            if entry.active:
                raise TicketError(RejectReason.REUSED, f"ticket {ticket.ticket_id} is in use")
            if self.clock() > ticket.deadline:
                raise TicketError(RejectReason.DEADLINE, f"ticket {ticket.ticket_id} expired at "
                                  f"{ticket.deadline:.3f}")
            entry.active = True
        return entry

    def is_live(self, entry: _Entry) -> bool:
        """Call with ``entry.lock`` held: may bytes still be written for this ticket?"""
        return entry.open and self.clock() <= entry.ticket.deadline

    def complete(self, ticket_id: str, nbytes: int, checksum: str | None
                 ) -> CompletedTransfer | None:
        """Report an admitted ticket as received; None if it was closed meanwhile (expired)."""
        with self._lock:
            entry = self._open.pop(ticket_id, None)
            if entry is None:
                return None
            self._remember_closed(ticket_id, None)
        with entry.lock:
            entry.open = False
        t = entry.ticket
        done = CompletedTransfer(t.ticket_id, t.request_id, t.dst_pages, nbytes, checksum)
        with self._lock:
            self._received.append(done)
        return done

    def close(self, ticket_id: str, reason: RejectReason, detail: str) -> RejectedTransfer | None:
        """Close an open ticket (no more writes, pages passed to ``on_close``); None if not open."""
        with self._lock:
            entry = self._open.pop(ticket_id, None)
            if entry is None:
                return None
            self._remember_closed(ticket_id, reason)
        with entry.lock:  # waits for a chunk being written to finish
            entry.open = False
        t = entry.ticket
        if self.on_close is not None:
            self.on_close(t.dst_pages)
        rej = RejectedTransfer(t.ticket_id, t.request_id, reason, detail, True, t.dst_pages)
        with self._lock:
            self._rejected.append(rej)
        return rej

    def refuse(self, ticket_id: str, request_id: str, reason: RejectReason, detail: str) -> None:
        """Record a refused attempt that leaves every issued ticket as it was."""
        with self._lock:
            self._rejected.append(RejectedTransfer(ticket_id, request_id, reason, detail, False))

    def is_open(self, ticket_id: str) -> bool:
        with self._lock:
            return ticket_id in self._open

    def sweep(self) -> list[RejectedTransfer]:
        """Close tickets more than ``grace_s`` past their deadline."""
        now = self.clock()
        with self._lock:
            late = [k for k, e in self._open.items() if now > e.ticket.deadline + self.grace_s]
        closed = [self.close(k, RejectReason.DEADLINE, "no completion before the deadline")
                  for k in late]
        return [r for r in closed if r is not None]

    def take_received(self) -> list[CompletedTransfer]:
        with self._lock:
            out = list(self._received)
            self._received.clear()
        return out

    def take_rejected(self) -> list[RejectedTransfer]:
        with self._lock:
            out = list(self._rejected)
            self._rejected.clear()
        return out

    def _remember_closed(self, ticket_id: str, reason: RejectReason | None) -> None:
        self._closed[ticket_id] = reason
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)
