"""``nibble.v1.Nibble``: Generate, Abort, GetServerInfo, FlushCache over the engine.

Generate streams one message per engine update. However a call ends early
(the client cancels, its deadline passes, the server stops, an error), the
engine gets ``abort(request_id)`` so the request's KV pages are freed; an
error before the first message becomes the call's status (errors.py), as does
an engine error after it. Requests are tracked like HTTP ones
(frontend/tracking.py): same metrics, same in-flight set, so the HTTP
``/abort_request`` can abort them too.

Request ids: the engine gets a server-unique id; the caller names its request
with ``request_id`` (or receives the engine's id), unique among its own
requests in flight. ``Abort`` finds a caller's own requests by that name or by
engine id (its HTTP requests too); an admin may name any engine id in flight.
Anything else answers ``num_aborted=0``, as for an unknown id.

While the server drains (frontend/drain.py), ``Generate`` answers UNAVAILABLE.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator

import grpc
from fastapi.encoders import jsonable_encoder

from nibble.proto.nibble.v1 import nibble_pb2 as pb
from nibble.proto.nibble.v1 import nibble_pb2_grpc as pb_grpc

from ..engine.client import EngineClient
from ..errors import InvalidRequestError, ServerDrainingError
from ..frontend.auth import cache_namespace, redact_keys
from ..frontend.drain import REFUSED_MESSAGE, Drain
from ..frontend.errors import EngineOutputError
from ..frontend.preparer import Preparer
from ..frontend.choices import ChoiceStreams, choice_requests
from ..frontend.prepare import Prepared
from ..frontend.tracking import InFlight, tracked
from ..metrics import Metrics
from .auth import GrpcAuth
from .convert import prepare, response
from .errors import abort_with

log = logging.getLogger(__name__)


class NibbleServicer(pb_grpc.NibbleServicer):
    def __init__(self, engine: EngineClient, auth: GrpcAuth, metrics: Metrics, inflight: InFlight,
                 drain: Drain, preparer: Preparer, tool_parser: str = "auto"):
        self.engine, self.auth, self.metrics, self.inflight = engine, auth, metrics, inflight
        self.tool_parser = tool_parser                        # --tool-call-parser
        self.drain = drain
        self.preparer = preparer                              # tokenizes off the event loop
        self.owned: dict[tuple[str | None, str], str] = {}   # (tenant, caller's id) -> engine id
        self.closing = False                                  # set when the server stops

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        caller = self.auth.caller(context)
        if self.drain.draining:
            await abort_with(context, ServerDrainingError(REFUSED_MESSAGE))
        try:
            p = await self.preparer.run(prepare, self.engine, request, self.tool_parser)
        except Exception as exc:  # noqa: BLE001 - INVALID_ARGUMENT, NOT_FOUND or INTERNAL
            await abort_with(context, exc)
        gen_req = p.gen_req
        gen_req.cache_salt = cache_namespace(caller.tenant, gen_req.cache_salt)
        name = request.request_id or gen_req.request_id
        key = (caller.tenant, name)
        if key in self.owned:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"a request named '{name}' is already in flight")
        self.owned[key] = gen_req.request_id
        try:
            async for msg in self._stream(p, name, caller.tenant, context):
                yield msg
        finally:
            self.owned.pop(key, None)

    async def _stream(self, p: Prepared, name: str, tenant: str | None,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """The choices' updates as messages; a choice's last one carries its tool calls."""
        rid = p.gen_req.request_id
        track = functools.partial(tracked, request_id=rid, timer=self.metrics.start_request(),
                                  inflight=self.inflight, owner=tenant)
        streams = ChoiceStreams(self.engine, choice_requests(p.gen_req, p.fmt.n), track)
        tools = getattr(p.fmt, "tools", None)
        texts = [[] for _ in range(p.fmt.n)]
        failure: Exception | None = None
        try:
            first = await streams.first()

            async def outputs():
                yield 0, first
                async for pair in streams.rest(first):
                    yield pair
            async for i, out in outputs():
                if out.error:
                    if out.finished:
                        streams.finish(i)
                    raise EngineOutputError(out.error)
                text = None
                if p.echo and not texts[i]:
                    text = p.echo + out.text_delta
                texts[i].append(text if text is not None else out.text_delta)
                parsed = None
                if out.finished:
                    streams.finish(i)
                    if tools is not None:
                        parsed = tools.parse("".join(texts[i]))
                yield response(out, name, i, p.fmt.token_text, parsed, text)
        except Exception as exc:  # noqa: BLE001 - becomes the call's status below
            failure = exc
        finally:
            await streams.close()   # cancelled, deadline passed or failed: free the pages
        if failure is not None:
            await abort_with(context, failure, closing=self.closing)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AbortResponse:
        caller = self.auth.caller(context)
        if request.abort_all == bool(request.request_id):
            await abort_with(context, InvalidRequestError(
                "set either request_id or abort_all", param="request_id"))
        if request.abort_all:
            if not caller.admin:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    "abort_all needs an admin API key (--admin-api-key)")
            n = int(await self.engine.abort_all())
            log.info("gRPC Abort: aborted all requests (%d)", n)
            return pb.AbortResponse(num_aborted=n)
        rid = self.owned.get((caller.tenant, request.request_id))
        if rid is None and (request.request_id in self.inflight if caller.admin else
                            self.inflight.owned_by(request.request_id, caller.tenant)):
            rid = request.request_id
        if rid is None:
            return pb.AbortResponse(num_aborted=0)
        log.info("gRPC Abort: aborting %s", rid)
        await self.engine.abort(rid)
        return pb.AbortResponse(num_aborted=1)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        try:
            info = redact_keys(jsonable_encoder(await self.engine.server_info()))
        except Exception as exc:  # noqa: BLE001 - becomes the call's status
            await abort_with(context, exc, closing=self.closing)
        return pb.ServerInfo(model=self.engine.model_name,
                             context_length=int(self.engine.context_length),
                             json=json.dumps(info, separators=(",", ":")))

    async def FlushCache(self, request: pb.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> pb.FlushCacheResponse:
        try:
            flushed = await self.engine.flush_cache()
        except Exception as exc:  # noqa: BLE001 - becomes the call's status
            await abort_with(context, exc, closing=self.closing)
        if not flushed:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "Cache not flushed: requests are running or queued; the prefix "
                                "cache can only be flushed while the server is idle.")
        log.info("prefix cache flushed (gRPC)")
        return pb.FlushCacheResponse()
