"""Every failure leaves the gateway as OpenAI's error body with a fitting status.

Body: ``{"error": {"message", "type", "param", "code"}}``. Mapping:
InvalidRequestError and request validation -> 400, unknown route -> 404,
ModelNotFoundError -> 404, RetryableError -> 503 with Retry-After, any other
NibbleError or unexpected exception -> 500. A client that went away gets an
empty 499 (nobody reads it). A missing or wrong API key gets 401 from the auth
middleware (auth.py) before any handler runs.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from ..errors import InvalidRequestError, ModelNotFoundError, NibbleError, RetryableError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1                    # default Retry-After for RetryableError without its own hint
CLIENT_CLOSED_STATUS = 499           # nginx's "client closed request"

# pydantic loc elements that name a union member or validator, not a field
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after",
              "function-before", "function-wrap", "constrained-int"}


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before its response was ready."""


def encodable(text: str) -> str:
    """``text`` with any lone surrogate written as ``\\udXXX``: an error message that quotes
    the client's input must still encode as UTF-8 (request validation refuses such
    text; this keeps any path it misses a 4xx, not a failing 500)."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": encodable(message), "type": err_type,
                      "param": None if param is None else encodable(param), "code": code}}


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status,
                        headers=headers)


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


def nibble_error_response(exc: NibbleError) -> JSONResponse:
    """Map one of our exceptions to its OpenAI error response."""
    if isinstance(exc, InvalidRequestError):
        return error_response(400, str(exc), "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, RetryableError):
        retry_after = getattr(exc, "retry_after", None) or RETRY_AFTER_S
        return error_response(503, str(exc) or "the server is busy; retry later",
                              "service_unavailable", None, type(exc).__name__,
                              headers={"Retry-After": str(int(retry_after))})
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return error_response(500, str(exc) or type(exc).__name__, "server_error", None,
                          type(exc).__name__)


def main_error(errors: list[dict]) -> dict:
    """The error to report: for a value that matched no member of a union (``prompt``,
    ``content``), the one our own validators raised says most ("not valid Unicode")."""
    for err in errors:
        if err.get("type") == "value_error":
            return err
    return errors[0] if errors else {}


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = main_error(errors)
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return error_response(400, f"Invalid JSON body: {ctx.get('error', first.get('msg'))}",
                              "invalid_request_error")
    loc = first.get("loc", ())
    ctype = request.headers.get("content-type", "")
    if tuple(loc) == ("body",) and "json" not in ctype:
        return error_response(400, "The request body must be a JSON object sent with "
                              f"'Content-Type: application/json' (got '{ctype or 'none'}')",
                              "invalid_request_error")
    param = param_from_loc(loc)
    where = param or "body"
    msg = f"Invalid request: {first.get('msg', 'validation failed')} (at '{where}')"
    if len(errors) > 1:
        msg += f" and {len(errors) - 1} more error(s)"
    return error_response(400, msg, "invalid_request_error", param)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(exc.status_code, str(exc.detail), err_type,
                          headers=getattr(exc, "headers", None))


async def _on_nibble_error(request: Request, exc: NibbleError) -> JSONResponse:
    return nibble_error_response(exc)


async def _on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=CLIENT_CLOSED_STATUS)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error serving %s", request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(NibbleError, _on_nibble_error)
    app.add_exception_handler(ClientDisconnected, _on_disconnect)
    app.add_exception_handler(Exception, _on_unexpected)
