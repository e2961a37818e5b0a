"""Endpoint descriptions: what a sender needs to write into a receiver's pool.

Wire format (signed with the shared secret, so a stray process cannot point a
sender at a pool of its choosing)::

    magic  4s  b"NBEP"
    hlen   I   length of the JSON header
    blen   I   length of the opaque blob (NIXL agent metadata; empty for gRPC)
    header JSON {transport, endpoint_id, num_pages, page_nbytes, ...transport fields}
    blob
    mac    32s HMAC-SHA256 over everything before it

No pickle: NIXL's own serialized descriptor lists are pickles, which would
run code from a peer; the receiver's pool is described by plain integers.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from . import signing
from .errors import EndpointError

MAGIC = b"NBEP"
_HEAD = struct.Struct("<4sII")
_MAC = 32


@dataclass(frozen=True)
class Endpoint:
    transport: str
    endpoint_id: str
    num_pages: int
    page_nbytes: int
    fields: dict = field(default_factory=dict)
    blob: bytes = b""

    def encode(self, secret: bytes) -> bytes:
        header = json.dumps({"transport": self.transport, "endpoint_id": self.endpoint_id,
                             "num_pages": self.num_pages, "page_nbytes": self.page_nbytes,
                             **self.fields}, separators=(",", ":")).encode()
        body = _HEAD.pack(MAGIC, len(header), len(self.blob)) + header + self.blob
        return body + signing.sign_blob(secret, body)


def decode_endpoint(data: bytes, secret: bytes, transport: str) -> Endpoint:
    """Parse and authenticate an endpoint; raises EndpointError."""
    data = bytes(data)
    if len(data) < _HEAD.size + _MAC:
        raise EndpointError("endpoint is truncated")
    body, mac = data[:-_MAC], data[-_MAC:]
    if not signing.verify_blob(secret, body, mac):
        raise EndpointError("endpoint is not signed with the shared secret")
    magic, hlen, blen = _HEAD.unpack_from(body)
    if magic != MAGIC or _HEAD.size + hlen + blen != len(body):
        raise EndpointError("not a Nibble transfer endpoint")
    try:
        header = json.loads(body[_HEAD.size:_HEAD.size + hlen])
        ep = Endpoint(header.pop("transport"), header.pop("endpoint_id"),
                      int(header.pop("num_pages")), int(header.pop("page_nbytes")), header,
                      body[_HEAD.size + hlen:])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise EndpointError(f"endpoint header is unreadable: {e}") from None
    if ep.transport != transport:
        raise EndpointError(f"endpoint is for transport {ep.transport!r}, not {transport!r}")
    return ep
