"""API keys for the gRPC API: the shared policy (frontend/auth.py), by method.

- ``grpc.health.v1.Health`` is always open (probes).
- ``GetServerInfo`` and ``FlushCache`` are admin methods (as ``/get_server_info``
  and ``/flush_cache``): with an ``--admin-api-key`` configured they need one;
  without one they are served to loopback peers only.
- ``Abort`` is open to admins and to tenants (as ``/abort_request``); the
  servicer lets a tenant abort only its own requests, and ``abort_all`` only
  an admin.
- Everything else (``Generate``, reflection, unknown methods) needs an
  ``--api-key`` or an admin key when API keys are configured.

Keys arrive as metadata ``authorization: Bearer <key>`` or ``x-api-key: <key>``
and are matched in constant time by ``KeySet``. A peer is on loopback when its
address (``context.peer()``) is a loopback address and no proxy metadata
(``x-forwarded-for``, ...) came with the call. ``AuthInterceptor`` wraps each
guarded handler so the check runs, with the peer known, before the handler:
UNAUTHENTICATED where HTTP answers 401, PERMISSION_DENIED where it answers 403.
Handlers learn who called with ``GrpcAuth.caller(context)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import unquote

import grpc

from ..config import ServerConfig
from ..frontend.auth import (ABORT, ADMIN, OPEN, TENANT, AuthPolicy, Caller, Refusal,
                            is_local_client, presented_keys)

SERVICE = "nibble.v1.Nibble"
ADMIN_METHODS = frozenset({f"/{SERVICE}/GetServerInfo", f"/{SERVICE}/FlushCache"})
ABORT_METHOD = f"/{SERVICE}/Abort"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
Metadata = Iterable[tuple[str, str | bytes]]
__all__ = ["AuthInterceptor", "Caller", "GrpcAuth", "method_kind", "peer_host"]


def method_kind(method: str) -> str:
    if method.startswith(OPEN_PREFIXES):
        return OPEN
    if method in ADMIN_METHODS:
        return ADMIN
    if method == ABORT_METHOD:
        return ABORT
    return TENANT


def peer_host(peer: str | None) -> str | None:
    """The address in a gRPC peer string (``ipv4:127.0.0.1:5`` -> ``127.0.0.1``,
    ``ipv6:[::1]:5`` -> ``::1``); None for other kinds (unix sockets, unknown)."""
    if not peer:
        return None
    scheme, _, rest = unquote(peer).partition(":")
    if scheme not in ("ipv4", "ipv6") or not rest:
        return None
    host = rest.rsplit(":", 1)[0] if rest.count(":") and not rest.endswith("]") else rest
    return host.strip("[]")


def _headers(metadata: Metadata | None) -> list[tuple[bytes, bytes]]:
    out = []
    for key, value in metadata or ():
        if isinstance(value, str):   # "-bin" keys carry bytes and are never keys
            out.append((key.encode("latin-1"), value.encode("latin-1", "replace")))
    return out


class GrpcAuth:
    """Which callers a method admits, and who a call says it is."""

    def __init__(self, cfg: ServerConfig):
        self.policy = AuthPolicy(cfg)          # raises ConfigError for unusable keys

    @property
    def enabled(self) -> bool:
        return self.policy.enabled

    def identify(self, metadata: Metadata | None, peer: str | None) -> Caller:
        headers = _headers(metadata)
        return self.policy.identify(presented_keys(headers),
                                    is_local_client(peer_host(peer), headers))

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        return self.identify(context.invocation_metadata(), context.peer())

    def refusal(self, method: str, metadata: Metadata | None, peer: str | None
                ) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed, else its status code and message."""
        kind = method_kind(method)
        if kind == OPEN:
            return None
        found: Refusal | None = self.policy.refusal(kind, self.identify(metadata, peer))
        if found is None:
            return None
        code = grpc.StatusCode.PERMISSION_DENIED if found.status == 403 \
            else grpc.StatusCode.UNAUTHENTICATED
        return code, found.message.replace("this route", method)


async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                  message: str) -> None:
    trailers = (("www-authenticate", "Bearer"),) \
        if code is grpc.StatusCode.UNAUTHENTICATED else ()
    await context.abort(code, message, trailing_metadata=trailers)


def _guarded_handler(handler: grpc.RpcMethodHandler | None, method: str,
                     auth: GrpcAuth) -> grpc.RpcMethodHandler:
    """``handler`` behind the auth check (an unknown method is refused like a known one
    without a key: a caller learns nothing; with a key it gets UNIMPLEMENTED)."""
    async def check(context: grpc.aio.ServicerContext) -> None:
        refusal = auth.refusal(method, context.invocation_metadata(), context.peer())
        if refusal is not None:
            await _refuse(context, *refusal)

    if handler is None:
        async def unknown(_request: Any, context: grpc.aio.ServicerContext) -> None:
            await check(context)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {method}")
        return grpc.unary_unary_rpc_method_handler(unknown)
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await handler.unary_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream:
        async def unary_stream(request: Any, context: grpc.aio.ServicerContext):
            await check(context)
            async for item in handler.unary_stream(request, context):
                yield item
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    if handler.stream_unary:
        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await handler.stream_unary(requests, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)

    async def stream_stream(requests: Any, context: grpc.aio.ServicerContext):
        await check(context)
        async for item in handler.stream_stream(requests, context):
            yield item
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Puts the auth check (see module doc) in front of every method but health."""

    def __init__(self, auth: GrpcAuth):
        self.auth = auth

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if method_kind(details.method) == OPEN:
            return handler
        return _guarded_handler(handler, details.method, self.auth)
