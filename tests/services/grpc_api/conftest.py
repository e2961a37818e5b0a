"""Fixtures for the gRPC server tests: the gateway's scripted fake engine behind a real
``GrpcServer`` on a free loopback port, driven with the raw generated stubs.

No asyncio plugin: each test calls ``run(coro)``; ``serving(engine, cfg)`` is an async
context manager yielding an open ``Conn`` (server, stubs, channel).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from nibble.proto.nibble.v1 import nibble_pb2_grpc as pb_grpc
from nibble.services.config import ServerConfig
from nibble.services.grpc_api import GrpcServer

GATEWAY_TESTS = Path(__file__).resolve().parents[1] / "gateway"


def _fake_engine_module():
    # The same module name as the gateway's conftest uses: loaded once, whichever goes first.
    name = "nibble_tests_gateway_fake_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GATEWAY_TESTS / "fake_engine.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture
def FakeEngine():  # noqa: N802 - a class handed out as a fixture
    return _fake_engine_module().FakeEngine


@dataclass
class Conn:
    server: GrpcServer
    target: str
    channel: grpc.aio.Channel
    stub: pb_grpc.NibbleStub
    health: health_pb2_grpc.HealthStub


@contextlib.asynccontextmanager
async def serving(engine, cfg: ServerConfig | None = None, **kw):
    server = GrpcServer(engine, cfg or ServerConfig(), port=0, **kw)
    port = await server.start()
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(target)
    try:
        yield Conn(server, target, channel, pb_grpc.NibbleStub(channel),
                   health_pb2_grpc.HealthStub(channel))
    finally:
        await channel.close()
        await server.stop(grace=0)


async def wait_for(predicate, timeout: float = 5.0) -> None:
    """Poll ``predicate`` until true (the server's side runs concurrently)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def run(coro):
    return asyncio.run(coro)
