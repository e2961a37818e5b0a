"""The SIGTERM drain over gRPC: Generate is refused with UNAVAILABLE, health turns
NOT_SERVING, and a stream still running at the timeout ends with UNAVAILABLE."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2

from nibble.proto.nibble.v1 import nibble_pb2 as pb

from .conftest import run, serving, wait_for


class StepClock:
    """Each sleep moves time on by its length at once."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        await asyncio.sleep(0.001)


def test_drain_refuses_then_cuts(FakeEngine):
    engine = FakeEngine("abcdef", hang_after=2)

    async def main():
        async with serving(engine) as c:
            drain = c.server.drain
            drain.clock = StepClock()
            call = c.stub.Generate(pb.GenerateRequest(text="hi"))
            first = await call.read()
            await wait_for(lambda: engine.hanging)
            drain.begin()
            try:
                async for _ in c.stub.Generate(pb.GenerateRequest(text="new")):
                    pass
                refused = None
            except grpc.aio.AioRpcError as err:
                refused = err
            await c.server._set_health(c.server._healthy())
            health = await c.health.Check(health_pb2.HealthCheckRequest(
                service="nibble.v1.Nibble"))
            report = await drain.run(5.0, engine.abort)
            rest, cut = [], None
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    rest.append(msg)
            except grpc.aio.AioRpcError as err:
                cut = err
            return first, refused, health, report, rest, cut

    first, refused, health, report, rest, cut = run(main())
    assert first.text == "a"
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in refused.details()
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert (report.running_at_start, report.cut, report.left) == (1, 1, 0)
    assert cut is not None and cut.code() == grpc.StatusCode.UNAVAILABLE, rest
    assert "graceful shutdown timeout" in cut.details()
    assert len(engine.requests) == 1                  # the refused call never reached it
