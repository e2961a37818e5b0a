"""The HTTP side of the graceful drain (frontend/drain.py): refuse new ``/v1`` requests."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ServerDrainingError
from ..frontend.drain import REFUSED_MESSAGE, Drain
from .errors import nibble_error_response


class DrainMiddleware:
    """While draining: ``/health`` -> 503 ``{"status": "draining"}``, ``/v1/*`` -> 503
    OpenAI error with Retry-After. Always: counts the ``/v1`` requests inside the app."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if self.drain.draining and path == "/health":
            await JSONResponse({"status": "draining"}, status_code=503)(scope, receive, send)
            return
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = nibble_error_response(ServerDrainingError(REFUSED_MESSAGE))
            await response(scope, receive, send)
            return
        self.drain.active_http += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.active_http -= 1
