"""KV-page transports between workers, registered by name (``nixl``, ``grpc``).

A receiving worker attaches its pool, hands ``endpoint()`` to senders, and
issues a signed ``TransferTicket`` for the pages it reserved; a sending worker
calls ``write_pages(peer_endpoint, ticket, src_pages)`` and polls the handle.
See ``base`` for the contract, ``tickets`` for a ticket's life, and each
transport module for its wire details and security model.

    tr = create_transport("grpc", secret=shared_secret)   # or "nixl"
    tr.attach(kv_pool.pages)
"""

from . import nixl_transport  # noqa: F401  (registers "nixl")
from .base import (KVTransport, TransferHandle, TransferState, TransferStatus,
                   create_transport, register_transport, register_unavailable, transport_names)
from .checksum import page_set_checksum
from .errors import (EndpointError, TicketError, TransferArgumentError, TransferError,
                     TransportUnavailableError)
from .nixl_transport import load_nixl
from .signing import checksum_tag, sign_ticket, verify_checksum_tag, verify_ticket
from .tickets import (CompletedTransfer, RejectedTransfer, RejectReason, TicketBook,
                      TransferTicket, make_ticket)

try:
    from . import grpc_transport  # noqa: F401  (registers "grpc")
except (ImportError, RuntimeError) as exc:   # no grpcio, or one older than the generated
    # code needs (its check raises RuntimeError): a trimmed install, e.g. a lent GPU image
    register_unavailable("grpc", f"grpcio does not load here ({exc})")

__all__ = [
    "KVTransport", "TransferHandle", "TransferState", "TransferStatus",
    "create_transport", "register_transport", "transport_names", "page_set_checksum",
    "EndpointError", "TicketError", "TransferArgumentError", "TransferError",
    "TransportUnavailableError", "load_nixl", "sign_ticket", "verify_ticket", "checksum_tag",
    "verify_checksum_tag",
    "CompletedTransfer", "RejectedTransfer", "RejectReason", "TicketBook", "TransferTicket",
    "make_ticket",
]
