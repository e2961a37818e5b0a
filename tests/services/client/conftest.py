"""A scripted stand-in for a Nibble gRPC server (plain ``grpc.server``, no engine):
each RPC first fails with ``fail_code`` ``fail_times`` times, then answers."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nibble.proto.nibble.v1 import nibble_pb2 as pb
from nibble.proto.nibble.v1 import nibble_pb2_grpc as pb_grpc


class StubNibble(pb_grpc.NibbleServicer, health_pb2_grpc.HealthServicer):
    def __init__(self):
        self.fail_times, self.fail_code, self.fail_param = 0, grpc.StatusCode.UNAVAILABLE, None
        self.fail_after_first_chunk = False
        self.calls: dict[str, int] = {}
        self.metadata: list[dict] = []
        self.requests: list = []

    def _maybe_fail(self, name, context):
        self.calls[name] = self.calls.get(name, 0) + 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.calls[name] <= self.fail_times:
            if self.fail_param:
                context.set_trailing_metadata((("nibble-error-param", self.fail_param),))
            context.abort(self.fail_code, f"scripted failure {self.calls[name]}")

    def Generate(self, request, context):
        self.requests.append(request)
        if self.fail_after_first_chunk:
            self.calls["Generate"] = self.calls.get("Generate", 0) + 1
            yield pb.GenerateResponse(request_id="r", token_ids=[1], text="a")
            context.abort(grpc.StatusCode.UNAVAILABLE, "went away mid-stream")
        self._maybe_fail("Generate", context)
        usage = pb.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1,
                         cached_tokens_by_tier={"l1": 1})
        yield pb.GenerateResponse(request_id="r", token_ids=[1], text="a", usage=usage)
        yield pb.GenerateResponse(request_id="r", token_ids=[2], text="b", finished=True,
                                  finish_reason=pb.FINISH_REASON_LENGTH, usage=usage)

    def Abort(self, request, context):
        self._maybe_fail("Abort", context)
        return pb.AbortResponse(num_aborted=3 if request.abort_all else 1)

    def GetServerInfo(self, request, context):
        self._maybe_fail("GetServerInfo", context)
        return pb.ServerInfo(model="m", context_length=8, json='{"a": 1}')

    def FlushCache(self, request, context):
        self._maybe_fail("FlushCache", context)
        return pb.FlushCacheResponse()

    def Check(self, request, context):
        self._maybe_fail("Check", context)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def stub_server():
    """(servicer, target) of a stub server on a free loopback port."""
    servicer = StubNibble()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_NibbleServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)
