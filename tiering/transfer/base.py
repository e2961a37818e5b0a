"""The KV transport interface, its handles and statuses, and the registry of transports.

One transport instance belongs to one worker and wraps that worker's pool
tensor (uint8 ``[num_pages, num_layers, layer_nbytes]``, see
``nibble.kernels.layout``; one page is one contiguous run of ``page_nbytes``
bytes). Every instance can both send and receive:

* receiver: ``attach(pool)``, ``endpoint()`` (handed to senders out of band),
  ``issue_ticket(request_id, dst_pages, ttl_s)`` for pages it reserved (or
  ``expect_ticket(t)`` for a ticket signed with ``sign_ticket``), then
  ``received()`` / ``rejected()`` to learn each ticket's fate. The worker
  installs the pages of a ``CompletedTransfer`` and frees or recomputes those
  of a ``RejectedTransfer`` with ``ticket_closed``; the pages of a closed
  ticket are zeroed (the data that may have landed is discarded).
* sender: ``attach(pool)``, ``write_pages(peer_endpoint, ticket, src_pages)``
  (non-blocking), ``poll(handle)`` until ``success`` or ``failed``. The source
  pages must not change until then. Every write carries the page-set checksum
  of its source pages and the checksum tag (``signing.checksum_tag``) that binds
  it to the ticket; the receiver refuses a checksum whose tag does not verify,
  and by default (``require_checksum``) a write without one.

Runtime failures (peer gone, refused ticket, deadline) end as a ``failed``
status, never an exception out of ``poll``; ``write_pages`` raises only for
arguments that could never work (TransferArgumentError, EndpointError).
A sender gives up ``grace_s`` after the ticket's deadline at the latest.
"""

from __future__ import annotations

import abc
import enum
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch

from . import signing
from .endpoint import Endpoint, decode_endpoint
from ..registry import ClassRegistry
from .checksum import page_set_checksum
from .errors import TicketError, TransferArgumentError
from .tickets import (CompletedTransfer, RejectedTransfer, RejectReason, TicketBook,
                      TransferTicket)


class TransferState(str, enum.Enum):
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    nbytes: int = 0          # bytes the ticket moves (len(dst_pages) * page_nbytes)
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.state != TransferState.TRANSFERRING


@dataclass(eq=False)
class TransferHandle:
    """One ``write_pages`` call on the sending side (``impl`` is transport private)."""

    ticket: TransferTicket
    peer_id: str
    nbytes: int
    started: float           # time.monotonic()
    give_up_at: float        # time.monotonic() after which poll() fails it
    impl: Any = None
    final: TransferStatus | None = None
    descriptors: int = 0     # transfer descriptors (NIXL) or contiguous copies (gRPC) used

    def finish(self, state: TransferState, error: str | None = None) -> TransferStatus:
        if self.final is None:
            self.final = TransferStatus(state, self.nbytes, error, time.monotonic() - self.started)
        return self.final

    def status(self) -> TransferStatus:
        return self.final or TransferStatus(TransferState.TRANSFERRING, self.nbytes, None,
                                            time.monotonic() - self.started)


class KVTransport(abc.ABC):
    """Moves whole pages from this worker's pool into a peer's reserved pages.

    Options common to every transport: ``secret`` (the shared HMAC key, >= 16
    bytes, required: the deployment's ``KVSecret.derive("transfer")``; nothing
    is read from the environment), ``grace_s`` (slack after a ticket deadline
    before a sender gives up and a receiver expires the ticket; default 2 s),
    ``require_checksum`` (refuse a write that carries no signed page-set
    checksum; default True).
    """

    name: ClassVar[str] = ""

    def __init__(self, *, secret: bytes | str | None = None, grace_s: float = 2.0,
                 require_checksum: bool = True):
        if not secret:
            raise TransferArgumentError("no transfer secret: pass secret= (the deployment's "
                                        "KVSecret.derive('transfer'))")
        self.require_checksum = bool(require_checksum)
        try:
            self.secret = signing.as_secret(secret)
        except ValueError as e:
            raise TransferArgumentError(str(e)) from None
        self.grace_s = float(grace_s)
        self._endpoint_id = f"nibble-{self.name}-{secrets.token_hex(8)}"
        self.pool: torch.Tensor | None = None
        self.book: TicketBook | None = None
        self.num_pages = self.page_nbytes = 0

    # -- lifecycle -------------------------------------------------------------------------
    def attach(self, pool_pages: torch.Tensor) -> None:
        """Wrap this worker's pool (uint8, contiguous, ``[num_pages, ...]``); call once."""
        if self.pool is not None:
            raise TransferArgumentError("this transport is already attached to a pool")
        if pool_pages.dtype != torch.uint8 or pool_pages.dim() < 2 or not (
                pool_pages.is_contiguous() and pool_pages.shape[0] > 0):
            raise TransferArgumentError(
                f"pool must be a contiguous uint8 [num_pages, ...] tensor, got "
                f"{pool_pages.dtype} {tuple(pool_pages.shape)}")
        self.pool = pool_pages
        self.num_pages = int(pool_pages.shape[0])
        self.page_nbytes = pool_pages.numel() // self.num_pages
        self.book = TicketBook(self.secret, self._endpoint_id, self.num_pages, self.page_nbytes,
                               self.grace_s, on_close=self._scrub)
        self._attach(pool_pages)

    @abc.abstractmethod
    def _attach(self, pool_pages: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def endpoint(self) -> bytes:
        """Signed bytes a sender passes to ``write_pages`` to reach this pool."""

    def endpoint_id(self) -> str:
        """This receiver's id, bound into every ticket signature (random per instance)."""
        return self._endpoint_id

    @abc.abstractmethod
    def close(self) -> None:
        """Release memory registrations, servers and connections (idempotent)."""

    def __enter__(self) -> "KVTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- receiving -------------------------------------------------------------------------
    def issue_ticket(self, request_id: str, dst_pages: Sequence[int], ttl_s: float
                     ) -> TransferTicket:
        """Sign a ticket allowing one write into ``dst_pages`` within ``ttl_s`` seconds."""
        return self._attached_book().issue(request_id, dst_pages, ttl_s)

    def expect_ticket(self, ticket: TransferTicket) -> None:
        """Accept writes for a ticket signed elsewhere (``signing.sign_ticket`` with our
        ``endpoint_id()``), as if ``issue_ticket`` had made it. Raises TicketError
        for a bad signature, TransferArgumentError for pages out of range."""
        self._attached_book().expect(ticket)

    def revoke(self, ticket_id: str, detail: str = "reservation released") -> bool:
        """Close an issued ticket before its pages are reused: later writes are refused.

        gRPC refuses every chunk after this; NIXL cannot stop an RDMA write already
        in flight (see nixl_transport), so callers keep ``grace_s`` before reuse there.
        """
        from .tickets import RejectReason
        return self._attached_book().close(ticket_id, RejectReason.ABORTED, detail) is not None

    def consume(self, ticket_id: str, nbytes: int) -> bool:
        """The receiver verified the pages itself and now owns them: close the ticket for
        good without scrubbing, so a late completion notice (NIXL delivers it only when
        polled) can neither re-verify pages the receiver has since written nor zero them."""
        return self._attached_book().complete(ticket_id, nbytes, None) is not None

    def received(self) -> list[CompletedTransfer]:
        """Tickets whose pages have fully landed (and passed every check) since the last call."""
        self._pump()
        return self._attached_book().take_received()

    def rejected(self) -> list[RejectedTransfer]:
        """Refused writes and expired tickets since the last call."""
        self._pump()
        return self._attached_book().take_rejected()

    def _pump(self) -> None:
        """Process incoming completions (transport specific), then expire late tickets."""
        self._attached_book().sweep()

    def _scrub(self, pages: Sequence[int]) -> None:
        """Zero a closed ticket's pages so no refused byte can be read back."""
        if pages:
            idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.pool.device)
            self.pool.index_fill_(0, idx, 0)

    def _check_seal(self, ticket: TransferTicket, checksum: str | None, tag: bytes | None
                    ) -> TicketError | None:
        """Receiver: the refusal for a write whose checksum is unsigned, wrongly signed or
        (under ``require_checksum``) missing; None when it may proceed."""
        if checksum:
            if not signing.verify_checksum_tag(self.secret, ticket, checksum, tag or b""):
                return TicketError(RejectReason.SIGNATURE, "the page-set checksum is not signed "
                                   f"for ticket {ticket.ticket_id} with the shared secret")
        elif self.require_checksum:
            return TicketError(RejectReason.INVALID, "the write carries no page-set checksum")
        return None

    def _seal(self, ticket: TransferTicket, src: list[int], checksum: str | None
              ) -> tuple[str, bytes]:
        """Sender: the checksum of ``src`` (computed unless given) and its tag for ``ticket``."""
        if not checksum:
            checksum = page_set_checksum(self.pool, src)
        return checksum, signing.checksum_tag(self.secret, ticket, checksum)

    def _attached_book(self) -> TicketBook:
        if self.book is None:
            raise TransferArgumentError("attach(pool) first")
        return self.book

    # -- sending ---------------------------------------------------------------------------
    @abc.abstractmethod
    def write_pages(self, peer_endpoint: bytes, ticket: TransferTicket, src_pages: Sequence[int],
                    checksum: str | None = None) -> TransferHandle:
        """Start copying our ``src_pages[i]`` into the peer's ``ticket.dst_pages[i]``.

        ``checksum`` (``page_set_checksum`` of the source pages; computed here
        when not given) is sent with its tag and verified by the receiver
        before it reports the transfer as received.
        """

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """The transfer's state now; ``failed`` once ``handle.give_up_at`` has passed."""

    def cancel(self, handle: TransferHandle) -> TransferStatus:
        """Stop waiting for a transfer (the receiver expires its ticket)."""
        return handle.finish(TransferState.FAILED, "cancelled by the sender")

    def wait(self, handle: TransferHandle, poll_interval_s: float = 0.0005) -> TransferStatus:
        """Poll until the transfer ends (bounded by ``handle.give_up_at``)."""
        while not (st := self.poll(handle)).done:
            time.sleep(poll_interval_s)
        return st

    def _start(self, peer_endpoint: bytes, ticket: TransferTicket, src_pages: Sequence[int]
               ) -> tuple[Endpoint, list[int], TransferHandle]:
        """Validate a write; returns the peer, the source pages and a fresh handle."""
        if self.pool is None:
            raise TransferArgumentError("attach(pool) first")
        peer = decode_endpoint(peer_endpoint, self.secret, self.name)
        src = [int(p) for p in src_pages]
        if len(src) != len(ticket.dst_pages) or not src:
            raise TransferArgumentError(
                f"{len(src)} source pages for a ticket of {len(ticket.dst_pages)} pages")
        if not all(0 <= p < self.num_pages for p in src):
            raise TransferArgumentError(f"source pages out of range [0, {self.num_pages})")
        if not self.page_nbytes == peer.page_nbytes == ticket.page_nbytes:
            raise TransferArgumentError(
                f"page sizes differ: ours {self.page_nbytes}, peer {peer.page_nbytes}, ticket "
                f"{ticket.page_nbytes}")
        if not all(0 <= p < peer.num_pages for p in ticket.dst_pages):
            raise TransferArgumentError(
                f"ticket pages out of the peer's range [0, {peer.num_pages})")
        now = time.monotonic()
        give_up = now + max(0.0, ticket.deadline - time.time()) + self.grace_s
        return peer, src, TransferHandle(ticket, peer.endpoint_id, ticket.nbytes, now, give_up)


_TRANSPORTS: ClassRegistry = ClassRegistry(KVTransport, "KV transport", TransferArgumentError)


def register_transport(name: str) -> Callable[[type[KVTransport]], type[KVTransport]]:
    """Class decorator: make a transport available to ``create_transport(name, ...)``."""
    return _TRANSPORTS.register(name)


def register_unavailable(name: str, why: str) -> None:
    """Keep ``name`` known where its transport cannot load: creating it raises
    TransportUnavailableError with ``why`` (not "unknown transport")."""
    from .errors import TransportUnavailableError

    class Unavailable(KVTransport):
        def __new__(cls, *args, **opts):
            raise TransportUnavailableError(f"the {name} transport is unavailable: {why}")

    Unavailable.__qualname__ = f"Unavailable[{name}]"
    _TRANSPORTS.register(name)(Unavailable)


def transport_names() -> list[str]:
    return _TRANSPORTS.names()


def create_transport(name: str, **opts) -> KVTransport:
    """A new, unattached transport: ``create_transport("grpc", secret=...)``.

    Raises TransferArgumentError for an unknown name and
    TransportUnavailableError when the transport cannot start here.
    """
    return _TRANSPORTS.get(name)(**opts)
