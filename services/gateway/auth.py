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

Keys arrive as ``Authorization: Bearer <key>`` or ``x-api-key: <key>``. They
are compared as SHA-256 digests with ``hmac.compare_digest`` against every
configured key, so neither the key's content nor its length leaks through
timing. A verified key maps to a tenant id that namespaces the prefix cache.
The same policy serves gRPC (grpc_api/auth.py), by method.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import ServerConfig
from ..credentials import redact_urls
from ..errors import ConfigError
from .errors import error_response

OPEN, ADMIN, ABORT, TENANT = "open", "admin", "abort", "tenant"     # route kinds
OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PATHS = frozenset({"/flush_cache", "/get_server_info", "/kv_events"})
ABORT_PATH = "/abort_request"
TENANT_SCOPE_KEY = "nibble.tenant"     # ASGI scope entry holding the verified key's tenant id
CALLER_SCOPE_KEY = "nibble.caller"     # ASGI scope entry holding the request's Caller
REDACTED_FIELDS = ("api_keys", "admin_api_keys")
PROXY_HEADERS = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip"})
LOOPBACK_ONLY = ("Admin routes are served to loopback clients only: no admin API key "
                 "(--admin-api-key) is configured.")


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def tenant_id(key: bytes) -> str:
    """Stable, non-reversible id of one API key (16 hex chars)."""
    return hashlib.sha256(b"nibble-tenant\0" + key).hexdigest()[:16]


def cache_namespace(tenant: str | None, cache_salt: str | None) -> str | None:
    """The engine's prefix-cache namespace: ``"<tenant>:<salt>"`` for an authenticated
    request (the tenant has a fixed length, so two keys never share a namespace
    whatever salts they send), the client's own salt otherwise."""
    if tenant is None:
        return cache_salt
    return f"{tenant}:{cache_salt or ''}"


def route_kind(path: str) -> str:
    if path in OPEN_PATHS:
        return OPEN
    if path in ADMIN_PATHS:
        return ADMIN
    if path == ABORT_PATH:
        return ABORT
    return TENANT


class KeySet:
    """Configured keys, kept only as digests; ``match`` runs in time independent of
    which key (if any) matches."""

    def __init__(self, keys: Iterable[str]):
        self._digests = [_digest(k.encode("ascii")) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def match(self, presented: bytes) -> bool:
        d = _digest(presented)
        ok = False
        for known in self._digests:
            ok |= hmac.compare_digest(d, known)
        return ok


def check_keys(cfg: ServerConfig) -> None:
    """Keys must be non-empty printable ASCII without spaces (anything else cannot be
    sent in a header, or is a quoting mistake on the command line)."""
    for flag, keys in (("--api-key", cfg.api_keys), ("--admin-api-key", cfg.admin_api_keys)):
        for k in keys:
            if not k or not all(0x21 <= ord(c) <= 0x7E for c in k):
                raise ConfigError(f"{flag} values must be non-empty printable ASCII without "
                                  "spaces")


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant of its verified API key (None without one), and
    whether it may use the admin routes and abort any request."""

    tenant: str | None
    admin: bool
    presented: bool = False     # some key was sent (valid or not)


@dataclass(frozen=True)
class Refusal:
    status: int                 # 401 (no valid key) or 403 (valid, but not allowed here)
    message: str


class AuthPolicy:
    """The keys configured, and which callers each route kind admits."""

    def __init__(self, cfg: ServerConfig):
        check_keys(cfg)
        self.num_api_keys, self.num_admin_keys = len(cfg.api_keys), len(cfg.admin_api_keys)
        self.api = KeySet([*cfg.api_keys, *cfg.admin_api_keys]) if cfg.api_keys else None
        self.admin = KeySet(cfg.admin_api_keys) if cfg.admin_api_keys else None

    @property
    def enabled(self) -> bool:
        return self.api is not None or self.admin is not None

    def identify(self, presented: list[bytes], loopback: bool) -> Caller:
        """The caller behind ``presented`` keys from a (non-)``loopback`` client."""
        key = next((k for k in presented if self.api.match(k)), None) \
            if self.api is not None else None
        if self.admin is not None:
            admin = any(self.admin.match(k) for k in presented)
        else:
            admin = loopback
        return Caller(tenant_id(key) if key is not None else None, admin, bool(presented))

    def refusal(self, kind: str, caller: Caller) -> Refusal | None:
        """None when ``caller`` may use a route of ``kind``, else why not."""
        if kind == OPEN or (caller.admin and kind in (ADMIN, ABORT)):
            return None
        if kind == ADMIN:
            if self.admin is None:
                return Refusal(403, LOOPBACK_ONLY)
            if caller.tenant is not None:
                return Refusal(403, "This route needs an admin API key (--admin-api-key); "
                               "an API key is not enough.")
            return self._unauthenticated("an admin API key (--admin-api-key)", caller)
        if self.api is None or caller.tenant is not None:
            return None
        return self._unauthenticated("an API key", caller)

    @staticmethod
    def _unauthenticated(kind: str, caller: Caller) -> Refusal:
        if caller.presented:
            return Refusal(401, f"Incorrect API key provided: this route needs {kind}.")
        return Refusal(401, f"Missing API key: this route needs {kind}, sent as "
                       "'Authorization: Bearer <key>' or 'x-api-key: <key>'.")


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """Candidate keys from raw ASGI headers: the Bearer token, then x-api-key."""
    found = []
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                found.append(token.strip())
        elif name == b"x-api-key" and value.strip():
            found.append(value.strip())
    return found


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (IPv4-mapped ones included)."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False        # a hostname other than localhost, or "" (all interfaces)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_local_client(host: str | None, headers: list[tuple[bytes, bytes]]) -> bool:
    """A loopback client address on a request that no proxy forwarded."""
    if not host or not is_loopback(host):
        return False
    return not any(name.lower() in PROXY_HEADERS for name, _ in headers)


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


def redact_keys(obj):
    """A copy of ``obj`` (nested dicts/lists) with API key values replaced by a count and
    URL credentials by ``<redacted>``."""
    if isinstance(obj, dict):
        return {k: (f"<{len(v)} redacted>" if k in REDACTED_FIELDS and isinstance(v, (list, tuple))
                    else redact_keys(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_keys(v) for v in obj]
    return redact_urls(obj) if isinstance(obj, str) else obj


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
