"""Engine and request errors, described once for every API.

``describe(exc)`` says what a failure means to a client: its HTTP status, the
OpenAI error type, the parameter at fault, a code, and whether a retry may
help. The HTTP gateway turns that into OpenAI's error body (gateway/errors.py);
the gRPC API into a status code (grpc_api/errors.py). Mapping:
InvalidRequestError -> 400, ModelNotFoundError -> 404, RetryableError -> 503
with Retry-After, any other error -> 500 (EngineDeadError: gRPC UNAVAILABLE, so a
client retries elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import (EngineDeadError, InvalidRequestError, ModelNotFoundError, NibbleError,
                      QueueFullError, RetryableError)

RETRY_AFTER_S = 1                    # default Retry-After for RetryableError without its own hint

# pydantic loc elements that name a union member or validator, not a field
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after",
              "function-before", "function-wrap", "constrained-int"}


class EngineOutputError(NibbleError):
    """The engine failed a request after admitting it (RequestOutput.error)."""


@dataclass(frozen=True)
class ErrorInfo:
    """What one failure means to a client, whatever the API."""

    kind: str                   # invalid | not_found | busy | unavailable | internal
    status: int                 # HTTP status
    err_type: str               # OpenAI error "type"
    param: str | None           # the request field at fault, if known
    code: str | int | None      # OpenAI error "code"
    retry_after: int | None     # seconds, for kinds a retry may cure


def describe(exc: BaseException) -> ErrorInfo:
    """The ``ErrorInfo`` of ``exc`` (see the module doc for the mapping)."""
    if isinstance(exc, InvalidRequestError):
        return ErrorInfo("invalid", 400, "invalid_request_error", exc.param, exc.code, None)
    if isinstance(exc, ModelNotFoundError):
        return ErrorInfo("not_found", 404, "invalid_request_error", "model", "model_not_found",
                         None)
    if isinstance(exc, RetryableError):
        retry_after = int(getattr(exc, "retry_after", None) or RETRY_AFTER_S)
        kind = "busy" if isinstance(exc, QueueFullError) else "unavailable"
        return ErrorInfo(kind, 503, "service_unavailable", None, type(exc).__name__,
                         retry_after)
    if isinstance(exc, EngineDeadError):
        return ErrorInfo("unavailable", 500, "server_error", None, type(exc).__name__, None)
    return ErrorInfo("internal", 500, "server_error", None, type(exc).__name__, None)


def param_from_loc(loc: tuple | list) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"``."""
    parts = list(loc[1:]) if loc and loc[0] == "body" else list(loc)
    if not parts or not isinstance(parts[0], str):
        return None
    param = parts[0]
    for p in parts[1:]:
        if isinstance(p, int):
            param += f"[{p}]"
        elif isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS:
            param += f".{p}"
        else:
            break
    return param


def main_error(errors: list[dict]) -> dict:
    """The error to report: for a value that matched no member of a union (``prompt``,
    ``content``), the one our own validators raised says most ("not valid Unicode")."""
    for err in errors:
        if err.get("type") == "value_error":
            return err
    return errors[0] if errors else {}
