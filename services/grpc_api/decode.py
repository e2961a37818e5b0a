"""Registers the Nibble service so that a request which does not parse is INVALID_ARGUMENT.

With the generated ``add_NibbleServicer_to_server`` a message that protobuf
refuses (a string field that is not UTF-8, such as an encoded lone surrogate,
or truncated bytes) makes grpc end the call with UNKNOWN, the gRPC face of a 500.
Here each method's deserializer returns ``Undecodable`` instead of raising, and
the method's wrapper ends such calls with INVALID_ARGUMENT before the servicer
runs. Everything else matches the generated registration.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from nibble.proto.nibble.v1 import nibble_pb2 as pb

SERVICE_NAME = "nibble.v1.Nibble"
# method -> (request type, response type, streams responses)
METHODS = {"Generate": (pb.GenerateRequest, pb.GenerateResponse, True),
           "Abort": (pb.AbortRequest, pb.AbortResponse, False),
           "GetServerInfo": (pb.GetServerInfoRequest, pb.ServerInfo, False),
           "FlushCache": (pb.FlushCacheRequest, pb.FlushCacheResponse, False)}


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request message that protobuf could not parse."""

    type_name: str
    reason: str

    def message(self) -> str:
        return f"the request is not a valid {self.type_name}: {self.reason}"


def lenient_parser(message_type: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(message_type.DESCRIPTOR.full_name, str(exc))
    return parse


def _guard_unary(method: Callable) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        return await method(request, context)
    return call


def _guard_stream(method: Callable) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        async for response in method(request, context):
            yield response
    return call


def add_nibble_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """``pb_grpc.add_NibbleServicer_to_server`` with lenient request parsing."""
    handlers = {}
    for name, (request_type, response_type, streams) in METHODS.items():
        factory = (grpc.unary_stream_rpc_method_handler if streams
                   else grpc.unary_unary_rpc_method_handler)
        guard = _guard_stream if streams else _guard_unary
        handlers[name] = factory(guard(getattr(servicer, name)),
                                 request_deserializer=lenient_parser(request_type),
                                 response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                           handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
