"""``AsyncClient``: the asyncio SDK over a ``grpc.aio`` channel (same API as Client)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nibble.proto.nibble.v1 import nibble_pb2 as pb
from nibble.proto.nibble.v1 import nibble_pb2_grpc as pb_grpc

from ._common import (DEFAULT_TARGET, Collector, Deadline, RetryPolicy, build_request,
                      chunk_of, credentials, metadata, retry_delay)
from .errors import from_rpc_error
from .results import GenerateResult, ServerInfo, StreamChunk

_UNSET: Any = object()


class AsyncClient:
    """Asyncio client for a Nibble server's gRPC API; arguments as ``Client``.

    The channel is opened on first use, inside the running event loop. Use as
    ``async with AsyncClient(...) as c`` or ``await c.close()``."""

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None,
                 secure: bool = False, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 timeout: float | None = None, retry: RetryPolicy | None = None,
                 options: Sequence[tuple[str, Any]] = ()):
        self._target, self._options = target, list(options)
        self._creds = credentials(secure, root_certificates, private_key, certificate_chain)
        self._metadata = metadata(api_key)
        self.timeout, self.retry = timeout, retry or RetryPolicy()
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = (
                grpc.aio.secure_channel(self._target, self._creds, options=self._options)
                if self._creds else grpc.aio.insecure_channel(self._target,
                                                               options=self._options))
            self._stub = pb_grpc.NibbleStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._channel

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is _UNSET else timeout)

    async def _unary(self, name: str, request: Any, timeout: float | None) -> Any:
        self._open()
        owner = self._health if name == "Check" else self._stub
        method = getattr(owner, name)
        deadline, attempt = self._deadline(timeout), 0
        while True:
            attempt += 1
            try:
                return await method(request, timeout=deadline.remaining(),
                                    metadata=self._metadata)
            except grpc.RpcError as err:
                delay = retry_delay(self.retry, err, attempt, deadline)
                if delay is None:
                    raise from_rpc_error(err) from None
            await asyncio.sleep(delay)

    async def stream(self, prompt: str | Sequence[int] | None = None, *,
                     messages: Sequence[Mapping[str, Any]] | None = None,
                     timeout: float | None = _UNSET, **params: Any
                     ) -> AsyncIterator[StreamChunk]:
        """As ``Client.stream``; closing the iterator (``aclose``, leaving an ``async for``
        by break inside ``contextlib.aclosing``) cancels the call and aborts the request."""
        request = build_request(prompt, messages, **params)
        self._open()
        deadline, attempt = self._deadline(timeout), 0
        while True:
            attempt += 1
            call = self._stub.Generate(request, timeout=deadline.remaining(),
                                       metadata=self._metadata)
            started = False
            try:
                async for msg in call:
                    started = True
                    yield chunk_of(msg)
                return
            except grpc.RpcError as err:
                delay = None if started else retry_delay(self.retry, err, attempt, deadline)
                if delay is None:
                    raise from_rpc_error(err) from None
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def generate(self, prompt: str | Sequence[int] | None = None, *,
                       messages: Sequence[Mapping[str, Any]] | None = None,
                       timeout: float | None = _UNSET, **params: Any) -> GenerateResult:
        collector = Collector()
        async for chunk in self.stream(prompt, messages=messages, timeout=timeout, **params):
            collector.add(chunk)
        return collector.result()

    async def abort(self, request_id: str, *, timeout: float | None = _UNSET) -> bool:
        reply = await self._unary("Abort", pb.AbortRequest(request_id=request_id), timeout)
        return reply.num_aborted > 0

    async def abort_all(self, *, timeout: float | None = _UNSET) -> int:
        return (await self._unary("Abort", pb.AbortRequest(abort_all=True), timeout)).num_aborted

    async def server_info(self, *, timeout: float | None = _UNSET) -> ServerInfo:
        info = await self._unary("GetServerInfo", pb.GetServerInfoRequest(), timeout)
        return ServerInfo(info.model, info.context_length, json.loads(info.json or "{}"))

    async def flush_cache(self, *, timeout: float | None = _UNSET) -> None:
        await self._unary("FlushCache", pb.FlushCacheRequest(), timeout)

    async def health(self, service: str = "", *, timeout: float | None = _UNSET) -> str:
        reply = await self._unary("Check", health_pb2.HealthCheckRequest(service=service),
                                  timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
