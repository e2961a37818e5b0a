"""One gRPC server: the Nibble service, health, reflection and the API-key interceptor.

Health (``grpc.health.v1``) reports SERVING for ``""`` and ``nibble.v1.Nibble``
while ``engine.is_healthy()`` holds and the server is not draining (polled
every ``HEALTH_POLL_S``), then NOT_SERVING; once ``stop`` begins it stays NOT_SERVING, so load balancers drain
the server while open streams finish within the grace period (then they are
cancelled, which aborts them in the engine).

Limits and TLS follow the HTTP side: a received message over
``--max-request-body-bytes`` ends the call with RESOURCE_EXHAUSTED, and with
``--ssl-certfile``/``--ssl-keyfile`` the port speaks only TLS (client certificates
required with ``--ssl-ca-certs``; services/tls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from nibble.proto.nibble.v1 import nibble_pb2 as pb

from ..config import ServerConfig
from ..engine.client import EngineClient
from ..errors import FatalError
from ..frontend.drain import Drain
from ..frontend.preparer import Preparer
from ..frontend.tracking import InFlight
from ..metrics import Metrics
from ..tls import grpc_server_credentials
from .auth import SERVICE, AuthInterceptor, GrpcAuth
from .decode import add_nibble_servicer
from .servicer import NibbleServicer

log = logging.getLogger(__name__)
HEALTH_POLL_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcBindError(FatalError):
    """The gRPC port could not be bound (in use, or a bad --host)."""


def bind_address(host: str, port: int) -> str:
    """``host:port`` as gRPC wants it (IPv6 literals in brackets, "" = every interface)."""
    host = host or "::"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class GrpcServer:
    """The gRPC API for ``engine`` on ``cfg.host`` and ``port`` (default ``cfg.grpc_port``).

    ``metrics``, ``inflight``, ``drain`` and ``preparer`` are the HTTP app's (``app.state``)
    when both APIs run together, so requests of either kind are counted, abortable, drained
    and prepared alike."""

    def __init__(self, engine: EngineClient, cfg: ServerConfig, port: int | None = None, *,
                 metrics: Metrics | None = None, inflight: InFlight | None = None,
                 drain: Drain | None = None, preparer: Preparer | None = None):
        self.engine, self.cfg = engine, cfg
        self.port = cfg.grpc_port if port is None else port
        self.auth = GrpcAuth(cfg)
        inflight = inflight if inflight is not None else InFlight()
        self.drain = drain if drain is not None else Drain(inflight)
        self._own_preparer = preparer is None
        self.servicer = NibbleServicer(engine, self.auth, metrics or Metrics(None), inflight,
                                       self.drain, preparer or Preparer(),
                                       cfg.tool_call_parser)
        self.health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._watcher: asyncio.Task | None = None
        self._stopping: asyncio.Future | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        # No SO_REUSEPORT: a second server on a taken port must fail, not share it.
        server = grpc.aio.server(interceptors=[AuthInterceptor(self.auth)], options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", self.cfg.max_request_body_bytes)])
        add_nibble_servicer(self.servicer, server)     # unparsable requests: INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (pb.DESCRIPTOR.services_by_name["Nibble"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address = bind_address(self.cfg.host, self.port)
        creds = grpc_server_credentials(self.cfg)
        try:
            bound = (server.add_secure_port(address, creds) if creds is not None
                     else server.add_insecure_port(address))
        except RuntimeError as exc:
            bound, reason = 0, f": {exc}"
        else:
            reason = ""
        if not bound:
            await server.stop(None)
            raise GrpcBindError(f"cannot listen for gRPC on {address}{reason} "
                                "(is the port free?)")
        self.port = bound
        await self._set_health(self._healthy())
        await server.start()
        self._server = server
        self._watcher = asyncio.create_task(self._watch_health(), name="nibble-grpc-health")
        log.info("gRPC API (%s, grpc.health.v1.Health, reflection) on %s (%s); %s", SERVICE,
                 bind_address(self.cfg.host, bound), _tls_mode(self.cfg),
                 "API keys required" if self.auth.enabled else "no API key needed")
        return bound

    def _healthy(self) -> bool:
        if self.drain.draining:
            return False
        try:
            return bool(self.engine.is_healthy())
        except Exception:  # noqa: BLE001 - a failing check means unhealthy, never a crash
            log.exception("engine health check raised")
            return False

    async def _set_health(self, ok: bool) -> None:
        for service in ("", SERVICE):
            await self.health.set(service, SERVING if ok else NOT_SERVING)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self._set_health(self._healthy())

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, refuse new calls, give open ones ``grace`` seconds.

        Idempotent; a second call (or one cancelled) waits for the first stop to end."""
        if self._stopping is None:
            if self._server is None:
                return
            self._stopping = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float | None) -> None:
        self.servicer.closing = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._own_preparer:
            self.servicer.preparer.close()
        log.info("gRPC server stopped")


def _tls_mode(cfg: ServerConfig) -> str:
    if cfg.ssl_certfile is None:
        return "plaintext"
    return "TLS, client certificates required" if cfg.ssl_ca_certs else "TLS"
