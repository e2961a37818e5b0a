"""The request-body limit (``--max-request-body-bytes``): 413 before the body is buffered.

``BodyLimitMiddleware`` is plain ASGI, in front of everything else. A declared
``Content-Length`` over the limit is answered at once, before a byte of the body
is read. Otherwise (no length, or a chunked body) it counts the bytes as the app
receives them and, once past the limit, raises ``BodyTooLarge`` from ``receive``:
the app never holds more than the limit plus one chunk. FastAPI re-raises
HTTPExceptions from body parsing, so the error handler below answers it; if the
exception escapes the app before a response started, the middleware answers.

The gRPC twin is the server's ``grpc.max_receive_message_length`` (grpc_api/server.py):
a larger message ends the call with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

TOO_LARGE_CODE = "request_too_large"


class BodyTooLarge(StarletteHTTPException):
    """The request body passed the configured limit (413)."""

    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than this server accepts: at most "
                              f"{limit} bytes (--max-request-body-bytes).")
        self.limit = limit


def too_large_response(limit: int) -> JSONResponse:
    return error_response(413, BodyTooLarge(limit).detail, "invalid_request_error", None,
                          TOO_LARGE_CODE)


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, or None if it has none (or an unreadable one; the
    HTTP server rejects those itself, and the byte count below still applies)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimitMiddleware:
    """Refuses HTTP request bodies over ``max_bytes`` with 413 (OpenAI's error body)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await too_large_response(self.max_bytes)(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await too_large_response(self.max_bytes)(scope, receive, send)


async def _on_too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
    return too_large_response(exc.limit)


def install_body_limit(app: FastAPI, max_bytes: int) -> None:
    """Add the middleware (outermost of the app's own) and its error handler."""
    app.add_exception_handler(BodyTooLarge, _on_too_large)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes)
