"""Errors of the KV-page transports (roots in ``nibble.kernels.errors``)."""

from __future__ import annotations

from nibble.kernels.errors import FatalError, NibbleError, RetryableError


class TransferError(NibbleError):
    """Root of every KV-transfer error."""


class TransportUnavailableError(TransferError, RetryableError):
    """A transport cannot start here (NIXL not importable, UCX failed, port in use)."""


class TransferArgumentError(TransferError, FatalError, ValueError):
    """A caller passed something inconsistent: unknown transport, bad pool, wrong page count."""


class EndpointError(TransferError, FatalError):
    """A peer endpoint is malformed, for another transport, or not signed with our secret."""


class TicketError(TransferError, FatalError):
    """A receiver refused a ticket; ``reason`` is a ``RejectReason`` value."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
