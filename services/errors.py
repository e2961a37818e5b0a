"""Nibble's one exception hierarchy (service level).

``NibbleError`` is the root (defined in ``nibble.kernels.errors``).
``RetryableError`` marks faults a client may retry (capacity, transient transport trouble); ``FatalError`` marks faults that will
not go away by retrying (bad config, corrupt state). ``InvalidRequestError``
is the client's fault and maps to HTTP 4xx / gRPC INVALID_ARGUMENT.
"""

from __future__ import annotations

from nibble.kernels.errors import FatalError, NibbleError, RetryableError

__all__ = ["NibbleError", "RetryableError", "FatalError"]  # extended below


class ConfigError(FatalError):
    """Inconsistent or invalid configuration flags."""


class ModelLoadError(FatalError):
    """A checkpoint could not be found or parsed."""


class InvalidRequestError(NibbleError):
    """The request itself is malformed (HTTP 400 / INVALID_ARGUMENT)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the context."""


class ModelNotFoundError(NibbleError):
    """The request names a model this server does not serve (HTTP 404)."""


class OutOfPagesError(RetryableError):
    """The KV pool has no free page for an allocation."""


class QueueFullError(RetryableError):
    """The admission queue is full (HTTP 503 with Retry-After)."""


class ServerDrainingError(RetryableError):
    """The server is shutting down (SIGTERM): it admits no new request, and requests still
    running when --graceful-shutdown-timeout passes end with this error (HTTP 503 with
    Retry-After, gRPC UNAVAILABLE); another replica can serve the retry."""


class EngineDeadError(FatalError):
    """The engine loop stopped; no request can be served."""


class RequestFaultError(NibbleError):
    """One request's share of an engine step failed: its input or its cached pages made the
    model raise or produce non-finite logits. That request ends with this error (after one
    recompute without cached pages, when cached pages may have been the cause); the other
    requests of the step are retried without it and run on."""


class DeviceFaultError(EngineDeadError):
    """The device is unusable: a CUDA error (illegal address, device-side assert, ...), or
    steps kept failing with nothing left to isolate. Every request fails, the engine stops,
    ``is_healthy()`` turns False and the server exits non-zero so a supervisor restarts it."""
