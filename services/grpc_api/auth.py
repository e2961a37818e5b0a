"""API keys for the gRPC API: the HTTP gateway's policy (gateway/auth.py), by method.

- ``grpc.health.v1.Health`` is always open (probes).
- ``GetServerInfo`` and ``FlushCache`` are admin methods: they need an
  ``--admin-api-key`` when one is configured, else an ``--api-key`` when one
  is, else they are open (as ``/get_server_info`` and ``/flush_cache``).
- Everything else (``Generate``, ``Abort``, reflection) needs an ``--api-key``
  or an admin key when API keys are configured.

Keys arrive as metadata ``authorization: Bearer <key>`` or ``x-api-key: <key>``
and are matched in constant time by ``KeySet``. ``AuthInterceptor`` refuses a
call before its handler runs: UNAUTHENTICATED for a missing or unknown key,
PERMISSION_DENIED for a valid API key on an admin method. Handlers learn who
called with ``GrpcAuth.caller`` (the key's tenant namespaces the prefix cache).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from ..config import ServerConfig
from ..gateway.auth import AuthPolicy, KeySet, presented_keys, tenant_id

SERVICE = "nibble.v1.Nibble"
ADMIN_METHODS = frozenset({f"/{SERVICE}/GetServerInfo", f"/{SERVICE}/FlushCache"})
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
Metadata = Iterable[tuple[str, str | bytes]]


@dataclass(frozen=True)
class Caller:
    tenant: str | None      # tenant id of the verified API key; None when keys are off
    admin: bool             # may call admin methods and abort any request


def _headers(metadata: Metadata | None) -> list[tuple[bytes, bytes]]:
    out = []
    for key, value in metadata or ():
        if isinstance(value, str):   # "-bin" keys carry bytes and are never keys
            out.append((key.encode("latin-1"), value.encode("latin-1", "replace")))
    return out


class GrpcAuth:
    """Which keys a method needs, and who a call's metadata says it is."""

    def __init__(self, cfg: ServerConfig):
        self.policy = AuthPolicy(cfg)          # raises ConfigError for unusable keys

    @property
    def enabled(self) -> bool:
        return self.policy.enabled

    def keys_for(self, method: str) -> KeySet | None:
        if method.startswith(OPEN_PREFIXES):
            return None
        if method in ADMIN_METHODS:
            return self.policy.admin
        return self.policy.api

    def refusal(self, method: str, metadata: Metadata | None
                ) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed, else its status code and message."""
        keys = self.keys_for(method)
        if keys is None:
            return None
        presented = presented_keys(_headers(metadata))
        if any(keys.match(k) for k in presented):
            return None
        if not presented:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    f"Missing API key: {method} needs a key, sent as metadata "
                    "'authorization: Bearer <key>' or 'x-api-key: <key>'.")
        if method in ADMIN_METHODS and self.policy.api is not None \
                and any(self.policy.api.match(k) for k in presented):
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} needs an admin API key (--admin-api-key).")
        return grpc.StatusCode.UNAUTHENTICATED, "Incorrect API key provided."

    def caller(self, metadata: Metadata | None) -> Caller:
        presented = presented_keys(_headers(metadata))
        api, admin = self.policy.api, self.policy.admin
        key = next((k for k in presented if api.match(k)), None) if api is not None else None
        is_admin = admin is None or any(admin.match(k) for k in presented)
        return Caller(tenant_id(key) if key is not None else None, is_admin)


def _rejecting_handler(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
                       message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only ends the call with ``code``
    (an unknown method is refused too: without a key, a caller learns nothing)."""
    async def reject(_request: Any, context: grpc.aio.ServicerContext) -> None:
        trailers = (("www-authenticate", "Bearer"),) \
            if code is grpc.StatusCode.UNAUTHENTICATED else ()
        await context.abort(code, message, trailing_metadata=trailers)

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(reject)
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(reject, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(reject, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(reject, **kw)
    return grpc.stream_stream_rpc_method_handler(reject, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata lacks the key their method needs (see module doc)."""

    def __init__(self, auth: GrpcAuth):
        self.auth = auth

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        refusal = self.auth.refusal(details.method, details.invocation_metadata)
        if refusal is None:
            return handler
        return _rejecting_handler(handler, *refusal)
