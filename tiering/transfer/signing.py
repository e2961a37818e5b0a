"""HMAC-SHA256 signatures for transfer tickets, page-set checksums and endpoints.

The key is the deployment's transfer key (``KVSecret.derive("transfer")``).

A ticket's signature covers ``(request_id, ticket_id, dst_pages, page_nbytes,
deadline, receiver_id)`` in a canonical JSON encoding, so a ticket issued by
one receiver cannot be replayed against another, and no field can change
without the signature breaking.

The receiver issues a ticket before the pages exist, so the page-set checksum
cannot be in it. The sender binds it afterwards: the *checksum tag* is an HMAC
over ``(ticket_id, ticket signature, checksum)``. It travels with the checksum
(in band to the receiving transport, and through the router to the decode
worker), and both check it before trusting the checksum: someone who can inject
into the transfer channel cannot swap pages and checksum together, and a
(checksum, tag) pair of one transfer does not verify for any other ticket.
Comparisons are constant time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from typing import Protocol, Sequence, TypeVar

from .errors import TransferArgumentError

MIN_SECRET_BYTES = 16
_TICKET_DOMAIN = "nibble-kv-ticket-v1"
_BLOB_DOMAIN = b"nibble-kv-blob-v1\0"
_CHECKSUM_DOMAIN = "nibble-kv-checksum-v1"
T = TypeVar("T")


class TicketFields(Protocol):
    request_id: str
    ticket_id: str
    dst_pages: Sequence[int]
    page_nbytes: int
    deadline: float
    signature: bytes


def as_secret(secret: bytes | str) -> bytes:
    """The secret as bytes; raises ValueError when shorter than MIN_SECRET_BYTES."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise TransferArgumentError(
            f"the transfer secret must be at least {MIN_SECRET_BYTES} bytes")
    return raw


def ticket_message(t: TicketFields, receiver_id: str) -> bytes:
    """Canonical bytes that a ticket signature covers (floats round-trip exactly in JSON)."""
    return json.dumps([_TICKET_DOMAIN, t.request_id, t.ticket_id, [int(p) for p in t.dst_pages],
                       int(t.page_nbytes), float(t.deadline), receiver_id],
                      separators=(",", ":")).encode()


def sign(secret: bytes, ticket: TicketFields, receiver_id: str) -> bytes:
    """HMAC-SHA256 of ``ticket`` bound to ``receiver_id`` (32 bytes)."""
    return hmac.new(secret, ticket_message(ticket, receiver_id), hashlib.sha256).digest()


def verify(secret: bytes, ticket: TicketFields, receiver_id: str, signature: bytes) -> bool:
    """True when ``signature`` is ``sign(secret, ticket, receiver_id)`` (constant time)."""
    return hmac.compare_digest(sign(secret, ticket, receiver_id), bytes(signature))


def sign_ticket(ticket: T, secret: bytes, receiver_id: str) -> T:
    """A copy of ``ticket`` (a TransferTicket) with its ``signature`` set for ``receiver_id``."""
    return dataclasses.replace(ticket, signature=sign(secret, ticket, receiver_id))


def verify_ticket(ticket: TicketFields, secret: bytes, receiver_id: str) -> bool:
    """True when ``ticket.signature`` is valid for ``receiver_id`` (constant time)."""
    return verify(secret, ticket, receiver_id, ticket.signature)


def sign_blob(secret: bytes, blob: bytes) -> bytes:
    """HMAC-SHA256 of an opaque blob (endpoint descriptions)."""
    return hmac.new(secret, _BLOB_DOMAIN + blob, hashlib.sha256).digest()


def verify_blob(secret: bytes, blob: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(sign_blob(secret, blob), bytes(signature))


def checksum_message(ticket: TicketFields, checksum: str) -> bytes:
    """Canonical bytes a checksum tag covers: the ticket's id and signature, the checksum."""
    return json.dumps([_CHECKSUM_DOMAIN, ticket.ticket_id, bytes(ticket.signature).hex(),
                       str(checksum)], separators=(",", ":")).encode()


def checksum_tag(secret: bytes, ticket: TicketFields, checksum: str) -> bytes:
    """HMAC-SHA256 binding ``checksum`` (a page-set checksum) to ``ticket`` (32 bytes)."""
    return hmac.new(secret, checksum_message(ticket, checksum), hashlib.sha256).digest()


def verify_checksum_tag(secret: bytes, ticket: TicketFields, checksum: str, tag: bytes) -> bool:
    """True when ``tag`` is ``checksum_tag(secret, ticket, checksum)`` (constant time)."""
    return bool(checksum) and hmac.compare_digest(checksum_tag(secret, ticket, checksum),
                                                  bytes(tag or b""))
