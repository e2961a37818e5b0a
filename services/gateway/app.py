"""The OpenAI-compatible HTTP gateway: ``create_app(engine, server_cfg)``.

Two routers: the OpenAI routes here (``/v1/*``) and the admin routes
(admin.py). API keys are enforced by a middleware in front of both, by path
and client address (auth.py); in front of that, the request-body limit
(limits.py); behind it, the drain middleware refuses new requests once SIGTERM
arrived (drain.py). Requests are prepared (template, tokenization) on the
Preparer's threads (preparer.py). Per app, on ``app.state``: the engine, the
config, the metrics (services/metrics.py), the Preparer, the in-flight registry
(tracking.py) and the drain; nothing is global, so tests build as many apps as
they like.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from ..config import ServerConfig
from ..engine.client import EngineClient
from ..errors import NibbleError
from ..metrics import Metrics
from .admin import admin_router
from ..frontend.auth import AuthPolicy, cache_namespace
from ..frontend.drain import Drain
from ..frontend.prepare import Prepared, check_model, prepare_chat, prepare_completion
from ..frontend.preparer import Preparer
from ..frontend.protocol import ChatCompletionRequest, CompletionRequest
from ..frontend.tracking import InFlight, tracked
from .auth import TENANT_SCOPE_KEY, APIKeyMiddleware
from .drain import DrainMiddleware
from .errors import ClientDisconnected, error_response, install_error_handlers
from .limits import install_body_limit
from .openapi import install_openapi
from .serving import respond

log = logging.getLogger(__name__)


def _engine(request: Request) -> EngineClient:
    return request.app.state.engine


async def _run(request: Request, prepare, body) -> Response:
    """Prepare and serve one generation request; unexpected faults become a logged 500.

    The request's cache namespace combines the tenant of its API key with its
    ``cache_salt`` (auth.cache_namespace)."""
    engine, state = _engine(request), request.app.state
    timer = state.metrics.start_request()
    try:
        p: Prepared = await state.preparer.run(prepare, engine, body)
        p.gen_req.cache_salt = cache_namespace(request.scope.get(TENANT_SCOPE_KEY),
                                               p.gen_req.cache_salt)
        track = functools.partial(tracked, request_id=p.gen_req.request_id, timer=timer,
                                  inflight=state.inflight,
                                  owner=request.scope.get(TENANT_SCOPE_KEY))
        return await respond(engine, request, p, track)
    except (NibbleError, ClientDisconnected):
        raise                                       # mapped by the installed handlers
    except Exception as exc:
        log.exception("unexpected error in %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              "server_error")


def _model_card(engine: EngineClient, created: int) -> dict[str, Any]:
    return {"id": engine.model_name, "object": "model", "created": created,
            "owned_by": "nibble", "max_model_len": engine.context_length}


def openai_router() -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _run(request, prepare_completion, body)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        parser = request.app.state.server_cfg.tool_call_parser
        return await _run(request, functools.partial(prepare_chat, tool_parser=parser), body)

    @router.get("/models")
    async def list_models(request: Request) -> dict[str, Any]:
        card = _model_card(_engine(request), request.app.state.created)
        return {"object": "list", "data": [card]}

    @router.get("/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        check_model(_engine(request), model_id)
        return _model_card(_engine(request), request.app.state.created)

    return router


def create_app(engine: EngineClient, server_cfg: ServerConfig | None = None) -> FastAPI:
    """Build the gateway around a running engine (see services/engine/async_engine.py)."""
    server_cfg = server_cfg or ServerConfig()
    policy = AuthPolicy(server_cfg)             # raises ConfigError for unusable keys
    app = FastAPI(title="Nibble", description="OpenAI-compatible LLM inference server")
    app.state.engine = engine
    app.state.server_cfg = server_cfg
    app.state.created = int(time.time())
    app.state.metrics = Metrics()             # engine gauges: /metrics awaits engine.stats()
    app.state.inflight = InFlight()             # request ids being served, with their tenants
    app.state.drain = Drain(app.state.inflight)  # SIGTERM drain (drain.py, lifecycle.py)
    app.state.preparer = Preparer()             # shared with the gRPC API (cli.py)
    install_error_handlers(app)
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(APIKeyMiddleware, policy=policy)   # added last: runs first
    app.include_router(openai_router())
    app.include_router(admin_router())
    install_body_limit(app, server_cfg.max_request_body_bytes)
    install_openapi(app)
    return app
