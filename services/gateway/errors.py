"""Every failure leaves the gateway as OpenAI's error body with a fitting status.

Body: ``{"error": {"message", "type", "param", "code"}}``. Our exceptions map
as frontend/errors.py describes (shared with gRPC); request validation -> 400,
unknown route -> 404, an unexpected exception -> 500. A client that went away gets an
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

from ..errors import NibbleError
from ..frontend.errors import describe, main_error, param_from_loc

log = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499           # nginx's "client closed request"


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


def nibble_error_response(exc: NibbleError) -> JSONResponse:
    """Map one of our exceptions to its OpenAI error response (frontend/errors.py)."""
    info = describe(exc)
    if info.status >= 500 and info.retry_after is None:
        log.error("request failed: %s: %s", type(exc).__name__, exc)
    message = str(exc) or ("the server is busy; retry later" if info.retry_after else
                           type(exc).__name__)
    headers = {"Retry-After": str(info.retry_after)} if info.retry_after else None
    return error_response(info.status, message, info.err_type, info.param, info.code,
                          headers=headers)


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
