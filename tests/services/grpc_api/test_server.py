"""GrpcServer: health follows the engine and the shutdown; binding; the --grpc-port flag."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from nibble.services.config import (DEFAULT_GRPC_PORT, ServerConfig, add_engine_args,
                                    add_server_args, config_from_args)
from nibble.services.errors import ConfigError
from nibble.services.grpc_api import GrpcServer, server as server_mod
from nibble.services.grpc_api.server import GrpcBindError, bind_address

from .conftest import run, serving

SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING)


async def check(c, service=""):
    return (await c.health.Check(health_pb2.HealthCheckRequest(service=service))).status


def test_health_follows_the_engine(FakeEngine, monkeypatch):
    monkeypatch.setattr(server_mod, "HEALTH_POLL_S", 0.02)
    engine = FakeEngine()

    async def main():
        async with serving(engine) as c:
            seen = [await check(c), await check(c, "nibble.v1.Nibble")]
            engine.healthy = False
            await asyncio.sleep(0.1)
            seen.append(await check(c))
            engine.healthy = True
            await asyncio.sleep(0.1)
            seen.append(await check(c, "nibble.v1.Nibble"))
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await check(c, "no.such.Service")
            return seen, unknown.value.code()

    seen, unknown = run(main())
    assert seen == [SERVING, SERVING, NOT_SERVING, SERVING]
    assert unknown == grpc.StatusCode.NOT_FOUND


def test_stop_reports_not_serving_and_is_idempotent(FakeEngine):
    async def main():
        srv = GrpcServer(FakeEngine(), ServerConfig(), port=0)
        await srv.start()
        await asyncio.gather(srv.stop(0), srv.stop(0))
        await srv.stop(0)
        status = await srv.health.Check(health_pb2.HealthCheckRequest(), None)
        return status.status, srv.servicer.closing

    assert run(main()) == (NOT_SERVING, True)


def test_port_in_use_is_a_clear_error(FakeEngine):
    async def main():
        first = GrpcServer(FakeEngine(), ServerConfig(), port=0)
        port = await first.start()
        try:
            with pytest.raises(GrpcBindError, match=str(port)):
                await GrpcServer(FakeEngine(), ServerConfig(), port=port).start()
        finally:
            await first.stop(0)

    run(main())


def test_bind_address():
    assert bind_address("127.0.0.1", 1) == "127.0.0.1:1"
    assert bind_address("::1", 2) == "[::1]:2"
    assert bind_address("", 3) == "[::]:3"


def _cfg(*argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_server_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_grpc_port_flag():
    assert _cfg().server.grpc_port is None
    assert _cfg("--grpc-port").server.grpc_port == DEFAULT_GRPC_PORT == 30001
    assert _cfg("--grpc-port", "31000").server.grpc_port == 31000
    with pytest.raises(ConfigError, match="--grpc-port"):
        _cfg("--port", "31000", "--grpc-port", "31000")
    with pytest.raises(ConfigError, match="--grpc-port"):
        _cfg("--grpc-port", "70000")
