"""End to end: ``nibble serve --ssl-certfile/--ssl-keyfile [--ssl-ca-certs]`` on HTTP and gRPC.

Certificates are made in the test (tests/tls_certs.py); the server runs the tiny
dummy model on CPU. With TLS: HTTPS works, plain HTTP does not, a client that
does not trust the CA gives up. With mutual TLS (--ssl-ca-certs): only clients
presenting a certificate from that CA get an answer, over HTTP and gRPC alike.
"""

from __future__ import annotations

import ssl
import time

import httpx
import pytest

from nibble.bench._server import free_port
from nibble.client import Client, RetryPolicy, Unavailable
from tests.tls_certs import Certs, make_certs

from .conftest import STARTUP_TIMEOUT_S, Server
from .tiny_model import tiny_server_args

pytestmark = pytest.mark.slow
NO_RETRY = RetryPolicy(max_attempts=1)
BODY = {"prompt": "hello", "max_tokens": 4}


def client_context(certs: Certs, ca: str = "ca", with_cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(getattr(certs, ca)))
    if with_cert:
        ctx.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    return ctx


def start_tls(tmp_path_factory, certs: Certs, mutual: bool) -> tuple[Server, str]:
    """A TLS server (its ``url`` https) and its gRPC target, once /health answers."""
    grpc_port = free_port()
    tls = ["--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key)]
    if mutual:
        tls += ["--ssl-ca-certs", str(certs.ca)]
    tmp = tmp_path_factory.mktemp("tls-mutual" if mutual else "tls")
    srv = Server(tmp, [*tiny_server_args(tmp / "model"), *tls, "--grpc-port", str(grpc_port)])
    srv.url = f"https://127.0.0.1:{srv.port}"
    ctx = client_context(certs)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and srv.proc.poll() is None:
        try:
            if httpx.get(f"{srv.url}/health", verify=ctx, timeout=2).status_code == 200:
                return srv, f"127.0.0.1:{grpc_port}"
        except httpx.TransportError:
            time.sleep(0.25)
    srv.stop()
    pytest.fail(f"the TLS server did not come up\n{srv.log_tail(4000)}")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    srv, target = start_tls(tmp_path_factory, certs, mutual=False)
    yield srv, target
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, certs):
    srv, target = start_tls(tmp_path_factory, certs, mutual=True)
    yield srv, target
    assert srv.stop() == 0


def test_https_serves_and_plain_http_does_not(tls_server, certs):
    srv, _ = tls_server
    r = httpx.post(f"{srv.url}/v1/completions", json=BODY, verify=client_context(
        certs, with_cert=False), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(httpx.ConnectError):        # a client that does not trust the CA
        httpx.get(f"{srv.url}/health", verify=client_context(certs, "other_ca", False),
                  timeout=10)


def test_grpc_tls(tls_server, certs):
    _, target = tls_server
    with Client(target, root_certificates=certs.read("ca"), timeout=60, retry=NO_RETRY) as c:
        assert c.health() == "SERVING"
        assert c.generate("hello", max_tokens=3).usage.completion_tokens >= 1
    with Client(target, timeout=10, retry=NO_RETRY) as plain, pytest.raises(Unavailable):
        plain.health()


def test_mutual_tls_needs_a_client_certificate_over_https(mtls_server, certs):
    srv, _ = mtls_server
    r = httpx.post(f"{srv.url}/v1/completions", json=BODY, verify=client_context(certs),
                   timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{srv.url}/health", verify=client_context(certs, with_cert=False),
                  timeout=10)
    with pytest.raises(httpx.TransportError):
        httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=10)


def test_mutual_tls_needs_a_client_certificate_over_grpc(mtls_server, certs):
    _, target = mtls_server
    trusted = {"root_certificates": certs.read("ca"), "timeout": 60, "retry": NO_RETRY}
    with Client(target, private_key=certs.read("client_key"),
                certificate_chain=certs.read("client_cert"), **trusted) as c:
        assert c.generate("hello", max_tokens=3).usage.completion_tokens >= 1
    with Client(target, **trusted) as anonymous, pytest.raises(Unavailable):
        anonymous.health()
