"""API keys: who may call which route, and the tenant a key stands for.

Policy (by path, checked before the body is read, so an unauthenticated client
learns nothing, not even whether its JSON was valid):

- ``/health`` and ``/metrics`` are always open (load balancers and Prometheus
  scrape them; /metrics holds aggregates only, as in SGLang).
- Admin routes (``/flush_cache``, ``/abort_request``, ``/get_server_info``, ``/kv_events``)
  need an ``--admin-api-key`` when one is configured, else an ``--api-key``
  when one is configured, else they are open.
- Every other path (``/v1/*``, the docs, unknown paths) needs an ``--api-key``
  or an admin key when API keys are configured, else it is open.

Keys arrive as ``Authorization: Bearer <key>`` or ``x-api-key: <key>``. They
are compared as SHA-256 digests with ``hmac.compare_digest`` against every
configured key, so neither the key's content nor its length leaks through
timing. A verified key maps to a tenant id that namespaces the prefix cache.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import ServerConfig
from ..credentials import redact_urls
from ..errors import ConfigError
from .errors import error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request", "/get_server_info", "/kv_events"})
TENANT_SCOPE_KEY = "nibble.tenant"     # ASGI scope entry holding the verified key's tenant id
REDACTED_FIELDS = ("api_keys", "admin_api_keys")


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


class AuthPolicy:
    """Which keys a path needs (None = open)."""

    def __init__(self, cfg: ServerConfig):
        check_keys(cfg)
        self.num_api_keys, self.num_admin_keys = len(cfg.api_keys), len(cfg.admin_api_keys)
        self.api = KeySet([*cfg.api_keys, *cfg.admin_api_keys]) if cfg.api_keys else None
        admin = cfg.admin_api_keys or cfg.api_keys
        self.admin = KeySet(admin) if admin else None

    @property
    def enabled(self) -> bool:
        return self.api is not None or self.admin is not None

    def keys_for(self, path: str) -> KeySet | None:
        if path in OPEN_PATHS:
            return None
        if path in ADMIN_PATHS:
            return self.admin
        return self.api


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


class APIKeyMiddleware:
    """Pure ASGI middleware enforcing ``AuthPolicy``; puts the tenant id of the key
    used into ``scope[TENANT_SCOPE_KEY]`` (absent on open paths)."""

    def __init__(self, app: ASGIApp, policy: AuthPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        keys = self.policy.keys_for(path)
        if keys is None:
            await self.app(scope, receive, send)
            return
        presented = presented_keys(scope.get("headers", []))
        key = next((k for k in presented if keys.match(k)), None)
        if key is None:
            await self._reject(path, bool(presented))(scope, receive, send)
            return
        scope[TENANT_SCOPE_KEY] = tenant_id(key)
        await self.app(scope, receive, send)

    def _reject(self, path: str, had_key: bool):
        admin = path in ADMIN_PATHS and self.policy.num_admin_keys > 0
        kind = "an admin API key (--admin-api-key)" if admin else "an API key"
        if had_key:
            msg = f"Incorrect API key provided: this route needs {kind}."
        else:
            msg = (f"Missing API key: this route needs {kind}, sent as "
                   "'Authorization: Bearer <key>' or 'x-api-key: <key>'.")
        return error_response(401, msg, "invalid_request_error", None, "invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})


def redact_keys(obj):
    """A copy of ``obj`` (nested dicts/lists) with API key values replaced by a count and
    URL credentials by ``<redacted>``."""
    if isinstance(obj, dict):
        return {k: (f"<{len(v)} redacted>" if k in REDACTED_FIELDS and isinstance(v, (list, tuple))
                    else redact_keys(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_keys(v) for v in obj]
    return redact_urls(obj) if isinstance(obj, str) else obj


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False        # a hostname other than localhost, or "" (all interfaces)


def log_security_posture(cfg: ServerConfig, log: logging.Logger) -> None:
    """Say at startup who can reach the server; warn loudly when it is exposed without keys.

    Raises ConfigError for unusable keys (before any model is loaded)."""
    policy = AuthPolicy(cfg)
    if policy.api is None:
        what = "the OpenAI API (/v1)" + ("" if policy.admin else " and the admin routes")
        if is_loopback(cfg.host):
            log.info("No --api-key configured: %s is unauthenticated; the server listens on "
                     "loopback (%s) only. Pass --api-key before exposing it with --host.",
                     what, cfg.host)
        else:
            log.warning("!!! SECURITY WARNING: no --api-key is configured and --host %s is "
                        "not loopback: anyone who can reach port %d can use %s. Pass "
                        "--api-key (and --admin-api-key), or bind to 127.0.0.1. !!!",
                        cfg.host, cfg.port, what)
    else:
        log.info("API keys: %d guard /v1 (admin keys are accepted there too)",
                 policy.num_api_keys)
    if policy.admin is not None:
        source = "--admin-api-key" if policy.num_admin_keys else "--api-key"
        log.info("Admin routes (%s) need a key from %s; /health and /metrics are open",
                 ", ".join(sorted(ADMIN_PATHS)), source)
