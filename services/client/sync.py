"""``Client``: the blocking SDK over a ``grpc`` channel."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nibble.proto.nibble.v1 import nibble_pb2 as pb
from nibble.proto.nibble.v1 import nibble_pb2_grpc as pb_grpc

from ._common import (DEFAULT_TARGET, Collector, Deadline, RetryPolicy, build_request,
                      chunk_of, credentials, metadata, retry_delay)
from .errors import from_rpc_error
from .results import GenerateResult, ServerInfo, StreamChunk

T = TypeVar("T")
_UNSET: Any = object()


class Client:
    """Blocking client for a Nibble server's gRPC API.

    ``target``: ``host:port``. ``api_key``: sent as ``authorization: Bearer``.
    TLS: ``secure=True`` (system roots) or ``root_certificates`` (PEM bytes), plus
    ``private_key``/``certificate_chain`` for mutual TLS. ``timeout``: default seconds
    per call, retries included (None = no deadline). ``retry``: see RetryPolicy.
    ``options``: extra gRPC channel options. Use as a context manager or ``close()``.
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None,
                 secure: bool = False, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 timeout: float | None = None, retry: RetryPolicy | None = None,
                 options: Sequence[tuple[str, Any]] = ()):
        creds = credentials(secure, root_certificates, private_key, certificate_chain)
        self._channel = (grpc.secure_channel(target, creds, options=list(options)) if creds
                         else grpc.insecure_channel(target, options=list(options)))
        self._stub = pb_grpc.NibbleStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = metadata(api_key)
        self.timeout, self.retry = timeout, retry or RetryPolicy()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.timeout if timeout is _UNSET else timeout)

    def _unary(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        deadline, attempt = self._deadline(timeout), 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as err:
                delay = retry_delay(self.retry, err, attempt, deadline)
                if delay is None:
                    raise from_rpc_error(err) from None
            time.sleep(delay)

    def stream(self, prompt: str | Sequence[int] | None = None, *,
               messages: Sequence[Mapping[str, Any]] | None = None,
               timeout: float | None = _UNSET, **params: Any) -> Iterator[StreamChunk]:
        """Yield the request's updates as they come. ``prompt`` is text or token ids, or pass
        chat ``messages``; ``params``: those of ``build_request`` (request.py): sampling
        (max_tokens, temperature, top_p, top_k, seed, penalties, min_p, min_tokens,
        logit_bias, stop, stop_token_ids, ignore_eos), tools, tool_choice,
        parallel_tool_calls, response_format, regex, ebnf, logprobs, n, echo, cache_salt,
        model, request_id. Closing the iterator
        early cancels the call, which aborts the request on the server."""
        request = build_request(prompt, messages, **params)
        deadline, attempt = self._deadline(timeout), 0
        while True:
            attempt += 1
            call = self._stub.Generate(request, timeout=deadline.remaining(),
                                       metadata=self._metadata)
            started = False
            try:
                for msg in call:
                    started = True
                    yield chunk_of(msg)
                return
            except grpc.RpcError as err:
                delay = None if started else retry_delay(self.retry, err, attempt, deadline)
                if delay is None:
                    raise from_rpc_error(err) from None
            finally:
                call.cancel()        # no-op once the call ended
            time.sleep(delay)

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[Mapping[str, Any]] | None = None,
                 timeout: float | None = _UNSET, **params: Any) -> GenerateResult:
        """Run one request to its end (same arguments as ``stream``)."""
        collector = Collector()
        for chunk in self.stream(prompt, messages=messages, timeout=timeout, **params):
            collector.add(chunk)
        return collector.result()

    def abort(self, request_id: str, *, timeout: float | None = _UNSET) -> bool:
        """Abort one of this caller's requests; False when none by that id is in flight."""
        reply = self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)
        return reply.num_aborted > 0

    def abort_all(self, *, timeout: float | None = _UNSET) -> int:
        """Abort every request on the server (admin); returns how many were in flight."""
        return self._unary(self._stub.Abort, pb.AbortRequest(abort_all=True),
                           timeout).num_aborted

    def server_info(self, *, timeout: float | None = _UNSET) -> ServerInfo:
        """The server's model, context length and full /get_server_info report (admin)."""
        info = self._unary(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return ServerInfo(info.model, info.context_length, json.loads(info.json or "{}"))

    def flush_cache(self, *, timeout: float | None = _UNSET) -> None:
        """Clear the prefix cache (admin); FailedPrecondition while requests run."""
        self._unary(self._stub.FlushCache, pb.FlushCacheRequest(), timeout)

    def health(self, service: str = "", *, timeout: float | None = _UNSET) -> str:
        """grpc.health.v1 status name: "SERVING", "NOT_SERVING", ..."""
        reply = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service),
                            timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
