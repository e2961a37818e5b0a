"""Who a caller is and what it may do, for every API (HTTP gateway and gRPC).

Keys arrive as ``Authorization: Bearer <key>`` or ``x-api-key: <key>``. They
are compared as SHA-256 digests with ``hmac.compare_digest`` against every
configured key, so neither the key's content nor its length leaks through
timing. A verified key maps to a tenant id that namespaces the prefix cache.
A client is on loopback when its address is a loopback address and the
request carries no proxy header (``Forwarded``, ``X-Forwarded-For``,
``X-Real-IP``): a proxy in the same pod or host connects over loopback on
behalf of remote clients, and must not lend them admin rights.

Route (or method) kinds: open, admin, abort, tenant; each API maps its routes
onto them (gateway/auth.py by path, grpc_api/auth.py by method) and asks
``AuthPolicy.refusal``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from ..config import ServerConfig
from ..credentials import redact_urls
from ..errors import ConfigError

OPEN, ADMIN, ABORT, TENANT = "open", "admin", "abort", "tenant"     # route kinds
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


def redact_keys(obj):
    """A copy of ``obj`` (nested dicts/lists) with API key values replaced by a count and
    URL credentials by ``<redacted>``."""
    if isinstance(obj, dict):
        return {k: (f"<{len(v)} redacted>" if k in REDACTED_FIELDS and isinstance(v, (list, tuple))
                    else redact_keys(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_keys(v) for v in obj]
    return redact_urls(obj) if isinstance(obj, str) else obj
