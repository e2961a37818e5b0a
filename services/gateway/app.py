"""The OpenAI-compatible HTTP gateway: ``create_app(engine, server_cfg)``.

Routes are grouped into routers so later concerns attach per group without
touching the handlers: API keys become a dependency on ``openai_router()``,
admin keys one on ``admin_router()`` (where /metrics, /flush_cache and
/abort_request will live). The engine and config live on ``app.state``;
nothing is global, so tests build as many apps as they like.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from starlette.responses import JSONResponse, Response

from ..config import ServerConfig
from ..errors import NibbleError
from .errors import ClientDisconnected, error_response, install_error_handlers
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import Prepared, check_model, prepare_chat, prepare_completion, respond

log = logging.getLogger(__name__)


def _engine(request: Request) -> Any:
    return request.app.state.engine


async def _run(request: Request, prepare, body) -> Response:
    """Prepare and serve one generation request; unexpected faults become a logged 500."""
    engine = _engine(request)
    try:
        p: Prepared = prepare(engine, body)
        return await respond(engine, request, p)
    except (NibbleError, ClientDisconnected):
        raise                                       # mapped by the installed handlers
    except Exception as exc:
        log.exception("unexpected error in %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              "server_error")


def _model_card(engine: Any, created: int) -> dict[str, Any]:
    return {"id": engine.model_name, "object": "model", "created": created,
            "owned_by": "nibble", "max_model_len": engine.context_length}


def openai_router() -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _run(request, prepare_completion, body)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _run(request, prepare_chat, body)

    @router.get("/models")
    async def list_models(request: Request) -> dict[str, Any]:
        card = _model_card(_engine(request), request.app.state.created)
        return {"object": "list", "data": [card]}

    @router.get("/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        check_model(_engine(request), model_id)
        return _model_card(_engine(request), request.app.state.created)

    return router


def admin_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        try:
            healthy = bool(_engine(request).is_healthy())
        except Exception:
            log.exception("engine health check raised")
            healthy = False
        if healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    @router.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        return JSONResponse(jsonable_encoder(_engine(request).server_info()))

    return router


def create_app(engine: Any, server_cfg: ServerConfig | None = None) -> FastAPI:
    """Build the gateway around a running engine (see services/engine/async_engine.py)."""
    app = FastAPI(title="Nibble", description="OpenAI-compatible LLM inference server")
    app.state.engine = engine
    app.state.server_cfg = server_cfg or ServerConfig()
    app.state.created = int(time.time())
    install_error_handlers(app)
    app.include_router(openai_router())
    app.include_router(admin_router())
    return app
