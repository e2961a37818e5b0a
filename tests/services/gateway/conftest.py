"""Fixtures for the gateway tests: a scripted fake engine and a client around it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from nibble.services.config import ServerConfig
from nibble.services.gateway import create_app


def _load_fake_engine_module():
    # Loaded by path under a unique name: test dirs are not packages, and another
    # directory may hold a module named fake_engine too.
    name = "nibble_tests_gateway_fake_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fake_engine.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture
def FakeEngine():  # noqa: N802 - a class handed out as a fixture
    return _load_fake_engine_module().FakeEngine


@pytest.fixture
def engine(FakeEngine):  # noqa: N803
    return FakeEngine()


LOCAL = ("127.0.0.1", 50000)        # a client on loopback, as the default --host serves
REMOTE = ("203.0.113.7", 50000)     # a client elsewhere on the network (TEST-NET-3)


@pytest.fixture
def make_client():
    """make_client(engine, server_cfg=None, client=LOCAL) -> TestClient; server exceptions
    become responses, as in uvicorn. ``client`` is the address the app sees."""
    clients = []

    def make(engine, server_cfg: ServerConfig | None = None,
             client: tuple[str, int] = LOCAL) -> TestClient:
        c = TestClient(create_app(engine, server_cfg or ServerConfig()),
                       raise_server_exceptions=False, client=client)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def client(engine, make_client):
    return make_client(engine)
