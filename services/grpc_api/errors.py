"""Exceptions -> gRPC status codes, from the kinds frontend/errors.py assigns.

InvalidRequestError -> INVALID_ARGUMENT, ModelNotFoundError -> NOT_FOUND,
QueueFullError -> RESOURCE_EXHAUSTED, other RetryableError and EngineDeadError
-> UNAVAILABLE (the client may retry, elsewhere if need be), anything else ->
INTERNAL. The invalid parameter, when known, and the exception's type travel as
trailing metadata (``nibble-error-param``, ``nibble-error-type``).
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from ..errors import NibbleError
from ..frontend.errors import describe

log = logging.getLogger(__name__)

PARAM_KEY = "nibble-error-param"
TYPE_KEY = "nibble-error-type"


CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "not_found": grpc.StatusCode.NOT_FOUND,
         "busy": grpc.StatusCode.RESOURCE_EXHAUSTED, "unavailable": grpc.StatusCode.UNAVAILABLE,
         "internal": grpc.StatusCode.INTERNAL}


def status_of(exc: BaseException, closing: bool = False) -> grpc.StatusCode:
    """The status code for ``exc`` (its kind per frontend/errors.py); ``closing`` (server
    shutting down) turns faults into UNAVAILABLE, since another replica can serve the retry."""
    code = CODES[describe(exc).kind]
    return grpc.StatusCode.UNAVAILABLE if closing and code is grpc.StatusCode.INTERNAL else code


def trailers_of(exc: BaseException) -> tuple[tuple[str, str], ...]:
    out = [(TYPE_KEY, type(exc).__name__)]
    param = getattr(exc, "param", None)
    if isinstance(param, str) and param:
        out.append((PARAM_KEY, param))
    return tuple(out)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException,
                     closing: bool = False) -> NoReturn:
    """End the RPC with the status ``exc`` maps to (raises, as ``context.abort`` does)."""
    code = status_of(exc, closing)
    if code is grpc.StatusCode.INTERNAL:
        if isinstance(exc, NibbleError):
            log.error("gRPC request failed: %s: %s", type(exc).__name__, exc)
        else:
            log.error("unexpected error serving a gRPC request", exc_info=exc)
    message = str(exc) or type(exc).__name__
    if not isinstance(exc, NibbleError):
        message = f"internal error: {type(exc).__name__}: {message}"
    await context.abort(code, message, trailing_metadata=trailers_of(exc))
    raise AssertionError("context.abort returned")   # pragma: no cover - abort always raises
