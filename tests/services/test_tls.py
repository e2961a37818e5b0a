"""services/tls.py: startup checks of the TLS files, uvicorn's options, and the gRPC port
over TLS and mutual TLS (a real GrpcServer on loopback, the SDK's AsyncClient)."""

from __future__ import annotations

import asyncio
import importlib.util
import ssl
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from nibble.client import AsyncClient, NibbleClientError, RetryPolicy
from nibble.services.config import ServerConfig
from nibble.services.errors import ConfigError
from nibble.services.grpc_api import GrpcServer
from nibble.services.tls import check_server_tls, uvicorn_ssl_options
from tests.tls_certs import make_certs

NO_RETRY = RetryPolicy(max_attempts=1)
GATEWAY_TESTS = Path(__file__).resolve().parent / "gateway"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_cfg(certs, mutual: bool) -> ServerConfig:
    return ServerConfig(ssl_certfile=str(certs.server_cert), ssl_keyfile=str(certs.server_key),
                        ssl_ca_certs=str(certs.ca) if mutual else None)


def test_no_tls_means_no_options():
    assert uvicorn_ssl_options(ServerConfig()) == {}
    check_server_tls(ServerConfig())


def test_uvicorn_requires_client_certificates_with_a_ca(certs):
    opts = uvicorn_ssl_options(tls_cfg(certs, mutual=True))
    assert opts["ssl_cert_reqs"] == ssl.CERT_REQUIRED and opts["ssl_ca_certs"] == str(certs.ca)
    assert "ssl_cert_reqs" not in uvicorn_ssl_options(tls_cfg(certs, mutual=False))
    check_server_tls(tls_cfg(certs, mutual=True))


@pytest.mark.parametrize("change, flag", [
    (lambda c, cfg: replace(cfg, ssl_keyfile=str(c.ca.parent / "missing.key")), "--ssl-keyfile"),
    (lambda c, cfg: replace(cfg, ssl_keyfile=str(c.client_key)), "--ssl-certfile/--ssl-keyfile"),
    (lambda c, cfg: replace(cfg, ssl_certfile=str(c.server_key)), "--ssl-certfile"),
    (lambda c, cfg: replace(cfg, ssl_ca_certs=str(c.server_key)), "--ssl-ca-certs"),
])
def test_unusable_files_fail_at_startup(certs, change, flag):
    with pytest.raises(ConfigError, match=flag):
        check_server_tls(change(certs, tls_cfg(certs, mutual=True)))


def _fake_engine():
    name = "nibble_tests_gateway_fake_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GATEWAY_TESTS / "fake_engine.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name].FakeEngine()


async def _try(target: str, **client_kw) -> str:
    """"SERVING", or the name of the SDK error a health check and a generation got."""
    async with AsyncClient(target, timeout=10, retry=NO_RETRY, **client_kw) as c:
        try:
            status = await c.health()
            await c.generate("hi", max_tokens=2)
            return status
        except NibbleClientError as exc:
            return type(exc).__name__


def _outcomes(certs, mutual: bool, clients: dict[str, dict]) -> dict[str, str]:
    async def main():
        server = GrpcServer(_fake_engine(), tls_cfg(certs, mutual), port=0)
        port = await server.start()
        try:
            return {name: await _try(f"127.0.0.1:{port}", **kw) for name, kw in clients.items()}
        finally:
            await server.stop(0)
    return asyncio.run(main())


def test_grpc_tls(certs):
    got = _outcomes(certs, mutual=False, clients={
        "tls": {"root_certificates": certs.read("ca")},
        "plaintext": {},
        "untrusted": {"root_certificates": certs.read("other_ca")},
    })
    assert got == {"tls": "SERVING", "plaintext": "Unavailable", "untrusted": "Unavailable"}


def test_grpc_mutual_tls_needs_a_client_certificate(certs):
    got = _outcomes(certs, mutual=True, clients={
        "with_cert": {"root_certificates": certs.read("ca"),
                      "private_key": certs.read("client_key"),
                      "certificate_chain": certs.read("client_cert")},
        "without_cert": {"root_certificates": certs.read("ca")},
        "server_cert_as_client": {"root_certificates": certs.read("ca"),
                                  "private_key": certs.read("server_key"),
                                  "certificate_chain": certs.read("server_cert")},
    })
    assert got["with_cert"] == "SERVING"
    assert got["without_cert"] == "Unavailable"
    assert got["server_cert_as_client"] == "Unavailable"   # not for client authentication
