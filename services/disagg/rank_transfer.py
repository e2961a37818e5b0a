"""Tensor-parallel workers in disaggregated serving: every rank's pages, rank to rank.

A prefill and a decode worker of the same TP size ``n`` are each a group of ``n`` ranks
(rank 0: the ``EngineWorker`` actor; ranks 1..: its followers, ``services/parallel``). Page
ids are the same on every rank of a group, so the decode rank 0's reservation names the
pages on every decode rank, and the prefill rank 0's held pages name them on every prefill
rank. Rank ``r``'s pool holds only its KV heads (uint8 ``[num_pages, num_layers,
layer_nbytes_r]``; ``layer_nbytes_r`` differs between ranks when the KV heads do not divide),
so rank ``r`` of the prefill group writes into rank ``r`` of the decode group: one transfer
per rank pair, each over its own transport (the configured one: gRPC or NIXL), each with its
own signed ticket, checksum and checksum tag, checked by the receiving rank's transport.

Rank 0 drives its followers with ``("kv", op, ...)`` messages over the TP group (the same
channel as the step broadcasts, so rank 0 sends them from its engine thread, between steps):

- ``expect(request_id, pages, ttl_s)``: each decode follower issues a ticket for ``pages``
  on its transport; rank 0 gets ``[(ticket, endpoint)]`` for ranks 1.. and hands them to the
  prefill worker beside its own ticket.
- ``send(request_id, peers, src)``: each prefill follower writes its ``src`` pages to its
  peer rank (blocking until the receiver acknowledged) and answers its page-set checksum.
- ``checksum(request_id, pages)``: each decode follower's checksum of ``pages`` as received.
- ``close(request_id, consumed)``: the decode followers consume (verified) or revoke the ticket.

The group checksum (``group_checksum``) is SHA-256 over every rank's page-set checksum in
rank order; the prefill rank 0 signs it for its ticket (``checksum_tag``) and the decode rank 0
recomputes it from every decode rank's pages before it installs the sequence, so a page that
differs on any rank fails the transfer (recomputed under ``recompute``). With one rank it is
the rank's own checksum, so TP=1 transfers are unchanged.

A follower answers every ``kv`` op (an error as a string, never an exception that would leave
rank 0 waiting in the gather); a follower that is gone makes the collective fail with
``DeviceFaultError`` (``group.py``), which kills the worker's engine: the request fails over
to recompute and Ray restarts the worker, whose new rank 0 starts new followers.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Sequence

from nibble.tiering.transfer import TransferTicket, page_set_checksum
from nibble.tiering.transfer.errors import TransferError as TransportError

from ..parallel.group import TPGroup
from .transfer_state import TransferError

log = logging.getLogger(__name__)
RankPeer = tuple[TransferTicket, bytes]          # (ticket on that decode rank, its endpoint)


def group_checksum(per_rank: Sequence[str]) -> str:
    """One checksum for the pages of every rank (``per_rank[r]``: rank r's page-set checksum,
    hex); the rank's own checksum with one rank."""
    if len(per_rank) == 1:
        return per_rank[0]
    h = hashlib.sha256(f"nibble-tp{len(per_rank)}".encode())
    for c in per_rank:
        h.update(b"\0" + c.encode())
    return h.hexdigest()


class RankTransfers:
    """Rank 0's side: the ``kv`` ops above, each a broadcast and a gather over ``tp``.

    Call every method on the engine thread (``AsyncEngine.call``): the TP group carries
    the steps too, and one thread must order its collectives."""

    def __init__(self, tp: TPGroup, pool_pages) -> None:
        self.tp, self.pool_pages = tp, pool_pages

    def _ask(self, op: str, *args) -> list:
        """Every follower's answer to ``op``, by rank (1..); TransferError if one failed."""
        self.tp.broadcast_object(("kv", op, *args))
        answers = (self.tp.gather_object(None) or [])[1:]
        errors = [f"rank {r}: {a[1]}" for r, a in enumerate(answers, 1) if a[0] == "err"]
        if errors:
            raise TransferError(f"{op} failed on a tensor-parallel rank: {'; '.join(errors)}")
        return [a[1] for a in answers]

    def expect(self, request_id: str, pages: list[int], ttl_s: float) -> list[RankPeer]:
        return self._ask("expect", request_id, list(pages), ttl_s)

    def send(self, request_id: str, peers: list[RankPeer], src: list[int]) -> list[str]:
        """Every follower's pages ``src`` to its peer; their checksums, by rank 1.."""
        if len(peers) != self.tp.size - 1:
            raise TransferError(f"{request_id}: {len(peers)} decode ranks to write to, this "
                                f"prefill group has {self.tp.size - 1} followers")
        return self._ask("send", request_id, list(peers), list(src))

    def checksum(self, request_id: str, pages: list[int]) -> str:
        """The group checksum of ``pages`` on every rank of this (decode) group."""
        mine = page_set_checksum(self.pool_pages, list(pages))
        return group_checksum([mine, *self._ask("checksum", request_id, list(pages))])

    def close(self, request_id: str, consumed: bool) -> None:
        self._ask("close", request_id, consumed)


class FollowerTransfers:
    """A follower's side: its own transport on its own pool, answering rank 0's ``kv`` ops."""

    def __init__(self, transport, rank: int) -> None:
        self.transport, self.rank = transport, rank
        self._tickets: dict[str, TransferTicket] = {}   # request id -> ticket issued here

    def handle(self, op: str, *args) -> tuple[str, object]:
        """("ok", answer) or ("err", message) for one op; never raises a transfer error."""
        ops = {"expect": self._expect, "send": self._send, "checksum": self._checksum,
               "close": self._close}
        if op not in ops:
            return "err", f"unknown kv op {op!r} (rank 0 runs another version)"
        try:
            return "ok", ops[op](*args)
        except (TransportError, TransferError, ValueError) as exc:
            log.warning("rank %d: kv %s failed: %s", self.rank, op, exc)
            return "err", f"{type(exc).__name__}: {exc}"

    def _expect(self, request_id: str, pages: list[int], ttl_s: float) -> RankPeer:
        ticket = self.transport.issue_ticket(request_id, pages, ttl_s)
        self._tickets[request_id] = ticket
        return ticket, self.transport.endpoint()

    def _send(self, request_id: str, peers: list[RankPeer], src: list[int]) -> str:
        ticket, endpoint = peers[self.rank - 1]
        checksum = page_set_checksum(self.transport.pool, src)
        status = self.transport.wait(self.transport.write_pages(endpoint, ticket, src,
                                                                checksum=checksum))
        if status.state != "success":
            raise TransferError(f"{request_id}: rank {self.rank} transfer failed: {status.error}")
        return checksum

    def _checksum(self, request_id: str, pages: list[int]) -> str:
        self.transport.received()             # drain the book (completions, expiries)
        return page_set_checksum(self.transport.pool, pages)

    def _close(self, request_id: str, consumed: bool) -> bool:
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return False
        if consumed:
            return self.transport.consume(ticket.ticket_id, ticket.nbytes)
        return self.transport.revoke(ticket.ticket_id)


def follower_transfers(cfg, pool_pages, rank: int) -> FollowerTransfers | None:
    """A disaggregated worker's follower: its transport, attached to its pool (None when
    not disaggregated). The transfer key comes from the deployment secret, as on rank 0."""
    if not cfg.disagg.disaggregate:
        return None
    from nibble.tiering.transfer import create_transport
    from .worker import transport_options, worker_transfer_key
    transport = create_transport(cfg.disagg.kv_transport, **transport_options(
        cfg.disagg, worker_transfer_key(cfg)))
    transport.attach(pool_pages)
    log.info("rank %d: %s transport for its KV pages", rank, cfg.disagg.kv_transport)
    return FollowerTransfers(transport, rank)
