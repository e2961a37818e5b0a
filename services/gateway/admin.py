"""Admin and observability routes (SGLang's names and behaviour).

- ``GET /health``: 200 while the engine is healthy, else 503.
- ``GET /metrics``: Prometheus exposition (services/metrics.py).
- ``GET /get_server_info``: the engine's config and capacity, API keys redacted.
- ``POST /flush_cache``: clears the prefix cache; 400 and no change while
  requests run or wait.
- ``POST /abort_request``: ``{"rid": "<request id>"}`` aborts one request this
  gateway is serving: an admin may abort any, a tenant only its own (a
  foreign id gets the same 404 as an unknown or finished one, so ids of other
  tenants cannot be probed); ``{"abort_all": true}`` aborts all, admins only
  (403 otherwise). Aborted streams end with finish_reason "abort".

Which callers reach these routes at all is decided by auth.py, not here.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, Response

from ..frontend.auth import Caller, redact_keys
from ..metrics import Metrics
from .auth import CALLER_SCOPE_KEY
from .errors import error_response
from ..frontend.protocol import Text

log = logging.getLogger(__name__)


class AbortRequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    rid: Text | None = None
    abort_all: bool = False


def admin_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        try:
            healthy = bool(request.app.state.engine.is_healthy())
        except Exception:
            log.exception("engine health check raised")
            healthy = False
        if healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        metrics: Metrics = request.app.state.metrics
        try:
            stats = await request.app.state.engine.stats()
        except Exception:  # noqa: BLE001 - logged; the request metrics still go out
            stats = None
            metrics.stats_failed()
        body, content_type = await asyncio.to_thread(metrics.render,
                                                     request.headers.get("accept"), stats)
        return Response(body, media_type=content_type)

    @router.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        info = jsonable_encoder(await request.app.state.engine.server_info())
        return JSONResponse(redact_keys(info))

    @router.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        if not await request.app.state.engine.flush_cache():
            return error_response(
                400, "Cache not flushed: requests are running or queued. The prefix cache "
                "can only be flushed while the server is idle; nothing was changed.",
                "invalid_request_error", None, "requests_running")
        log.info("prefix cache flushed")
        return JSONResponse({"success": True, "message": "Cache flushed."})

    @router.get("/kv_events")
    async def kv_events(request: Request, since: int = 0, limit: int = 1000) -> Response:
        """Cache events after ``since`` (stored/removed per tier, with content keys)."""
        events = await request.app.state.engine.kv_events(max(0, since),
                                                          max(1, min(limit, 10_000)))
        return JSONResponse(events)

    @router.post("/abort_request")
    async def abort_request(body: AbortRequestBody, request: Request) -> Response:
        engine = request.app.state.engine
        if body.abort_all == (body.rid is not None):
            return error_response(400, "Send either {\"rid\": \"<request id>\"} or "
                                  "{\"abort_all\": true}", "invalid_request_error",
                                  "rid" if body.rid is not None else None)
        caller = request.scope.get(CALLER_SCOPE_KEY) or Caller(None, admin=False)
        if body.abort_all:
            if not caller.admin:
                return error_response(403, "abort_all needs an admin API key "
                                      "(--admin-api-key), or a loopback client when none is "
                                      "configured", "permission_error", "abort_all",
                                      "insufficient_permissions")
            n = int(await engine.abort_all())
            log.info("/abort_request: aborted all requests (%d)", n)
            return JSONResponse({"success": True, "num_aborted": n})
        inflight = request.app.state.inflight
        if not (body.rid in inflight if caller.admin
                else inflight.owned_by(body.rid, caller.tenant)):
            return error_response(404, f"No request with id '{body.rid}' is in flight "
                                  "(unknown, or already finished)", "invalid_request_error",
                                  "rid", "request_not_found")
        log.info("/abort_request: aborting %s", body.rid)
        await engine.abort(body.rid)
        return JSONResponse({"success": True, "num_aborted": 1})

    return router
