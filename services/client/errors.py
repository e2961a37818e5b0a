"""The SDK's exceptions: one per gRPC status code a Nibble server returns.

``NibbleClientError`` is the root; ``code`` is the ``grpc.StatusCode`` (None for
errors raised on the client side), ``details`` the server's message, and
``param`` the offending request field when the server named one.
"""

from __future__ import annotations

import grpc

PARAM_KEY = "nibble-error-param"       # trailing metadata set by nibble.services.grpc_api


class NibbleClientError(Exception):
    code: grpc.StatusCode | None = None

    def __init__(self, details: str, code: grpc.StatusCode | None = None,
                 param: str | None = None):
        super().__init__(details)
        self.details = details
        self.param = param
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        name = self.code.name if self.code is not None else "CLIENT"
        return f"{name}: {self.details}"


class InvalidArgument(NibbleClientError):
    """Bad input (never retried)."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(NibbleClientError):
    """A model this server does not serve."""
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(NibbleClientError):
    """A request_id already in flight for this caller."""
    code = grpc.StatusCode.ALREADY_EXISTS


class Unauthenticated(NibbleClientError):
    """API key missing or wrong."""
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(NibbleClientError):
    """An API key where an admin key is needed."""
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(NibbleClientError):
    """The server's request queue is full."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(NibbleClientError):
    """The server is not in a state that allows the call (flush_cache while busy)."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(NibbleClientError):
    """A transient fault (retried with backoff before it is raised)."""
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(NibbleClientError):
    """The call's timeout passed (the server aborted the request)."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(NibbleClientError):
    code = grpc.StatusCode.CANCELLED


class Internal(NibbleClientError):
    """A server-side failure (a bug, or an engine error mid-request)."""
    code = grpc.StatusCode.INTERNAL


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, NotFound, AlreadyExists, Unauthenticated, PermissionDenied,
    ResourceExhausted, FailedPrecondition, Unavailable, DeadlineExceeded, Cancelled, Internal)}


def from_rpc_error(err: grpc.RpcError) -> NibbleClientError:
    """The typed exception for a failed call (codes without a class get the root class)."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    param = None
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == PARAM_KEY and isinstance(value, str):
            param = value
    cls = _BY_CODE.get(code, NibbleClientError)
    return cls(details, code=code, param=param)
