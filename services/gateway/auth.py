"""API keys and client addresses: who may call which route, and the tenant a key stands for.

Route kinds (``route_kind``), checked before the body is read, so a refused
client learns nothing, not even whether its JSON was valid:

- **open**: ``/health`` and ``/metrics`` (load balancers and Prometheus scrape
  them; /metrics holds aggregates only, as in SGLang).
- **admin**: ``/flush_cache``, ``/get_server_info``, ``/kv_events``. With an
  ``--admin-api-key`` configured they need one (401 without a valid key, 403
  for a tenant's ``--api-key``). Without one they are served to loopback
  clients only (403 otherwise), whatever tenant keys are set.
- **abort**: ``/abort_request`` is open to admins (as above) and to tenants
  (an ``--api-key``, when keys are configured). The handler then lets a
  tenant abort only its own requests; ``abort_all`` is admin-only.
- **tenant**: every other path (``/v1/*``, the docs, unknown paths) needs an
  ``--api-key`` or an admin key when API keys are configured, else it is open.

A client is on loopback when its address is a loopback address and the
request carries no proxy header (``Forwarded``, ``X-Forwarded-For``,
``X-Real-IP``): a proxy in the same pod or host connects over loopback on
behalf of remote clients, and must not lend them admin rights.

Keys, tenants, loopback detection and the policy itself live in frontend/auth.py,
shared with the gRPC API (grpc_api/auth.py), which maps methods onto the same kinds.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import ServerConfig
from ..errors import ConfigError
from ..frontend.auth import (ABORT, ADMIN, OPEN, TENANT, AuthPolicy, Refusal,
                             is_local_client, is_loopback, presented_keys)
from .errors import error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PATHS = frozenset({"/flush_cache", "/get_server_info", "/kv_events"})
ABORT_PATH = "/abort_request"
TENANT_SCOPE_KEY = "nibble.tenant"     # ASGI scope entry holding the verified key's tenant id
CALLER_SCOPE_KEY = "nibble.caller"     # ASGI scope entry holding the request's Caller


def route_kind(path: str) -> str:
    if path in OPEN_PATHS:
        return OPEN
    if path in ADMIN_PATHS:
        return ADMIN
    if path == ABORT_PATH:
        return ABORT
    return TENANT


class APIKeyMiddleware:
    """Pure ASGI middleware enforcing ``AuthPolicy``; puts the ``Caller`` into
    ``scope[CALLER_SCOPE_KEY]`` and its tenant into ``scope[TENANT_SCOPE_KEY]``."""

    def __init__(self, app: ASGIApp, policy: AuthPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kind = route_kind(scope.get("path", ""))
        if kind == OPEN:
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        client = scope.get("client")
        caller = self.policy.identify(presented_keys(headers),
                                      is_local_client(client[0] if client else None, headers))
        refusal = self.policy.refusal(kind, caller)
        if refusal is not None:
            await _reject(refusal)(scope, receive, send)
            return
        scope[CALLER_SCOPE_KEY] = caller
        if caller.tenant is not None:
            scope[TENANT_SCOPE_KEY] = caller.tenant
        await self.app(scope, receive, send)


def _reject(refusal: Refusal):
    if refusal.status == 403:
        return error_response(403, refusal.message, "permission_error", None,
                              "insufficient_permissions")
    return error_response(401, refusal.message, "invalid_request_error", None,
                          "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def check_exposure(cfg: ServerConfig) -> None:
    """Refuse a non-loopback ``--host`` (HTTP and the gRPC port bind it alike) without any
    ``--api-key``, unless ``--allow-unauthenticated`` says so. Raises ConfigError."""
    if cfg.api_keys or is_loopback(cfg.host) or cfg.allow_unauthenticated:
        return
    ports = f"port {cfg.port}" + (f" (and gRPC port {cfg.grpc_port})" if cfg.grpc_port else "")
    raise ConfigError(
        f"refusing to serve on --host {cfg.host or '(all interfaces)'} without an API key: "
        f"anyone who can reach {ports} could use the OpenAI API. Give keys with "
        "--api-key-file or $NIBBLE_API_KEY (admin keys: --admin-api-key-file), bind "
        "--host 127.0.0.1, or pass --allow-unauthenticated to serve without keys anyway")


def log_security_posture(cfg: ServerConfig, log: logging.Logger) -> None:
    """Say at startup who can reach the server; refuse an exposed server without keys.

    Raises ConfigError for unusable keys or an unguarded non-loopback host (before any
    model is loaded)."""
    policy = AuthPolicy(cfg)
    check_exposure(cfg)
    if policy.api is None:
        if is_loopback(cfg.host):
            log.info("No --api-key configured: the OpenAI API (/v1) is unauthenticated; the "
                     "server listens on loopback (%s) only. Pass --api-key-file before "
                     "exposing it with --host.", cfg.host)
        else:
            log.warning("!!! SECURITY WARNING: --allow-unauthenticated: no --api-key is "
                        "configured and --host %s is not loopback: anyone who can reach port "
                        "%d can use the OpenAI API (/v1). !!!", cfg.host, cfg.port)
    else:
        log.info("API keys: %d guard /v1 (admin keys are accepted there too)",
                 policy.num_api_keys)
    if policy.admin is not None:
        log.info("Admin routes (%s, /abort_request abort_all) need a key from "
                 "--admin-api-key; /health and /metrics are open",
                 ", ".join(sorted(ADMIN_PATHS)))
    else:
        log.info("No --admin-api-key configured: admin routes (%s) answer loopback clients "
                 "only", ", ".join(sorted(ADMIN_PATHS)))
