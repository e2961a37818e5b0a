"""The SDK's TLS options against a TLS server with a self-signed certificate."""

from __future__ import annotations

import datetime
from concurrent import futures

import grpc
import pytest

from nibble.client import Client, RetryPolicy, Unavailable
from nibble.proto.nibble.v1 import nibble_pb2_grpc as pb_grpc

from .conftest import StubNibble

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

NO_RETRY = RetryPolicy(max_attempts=1)


def self_signed() -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) for CN/SAN localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture
def tls_server():
    cert, key = self_signed()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_NibbleServicer_to_server(StubNibble(), server)
    port = server.add_secure_port("localhost:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    yield f"localhost:{port}", cert
    server.stop(None)


def test_root_certificates_verify_the_server(tls_server):
    target, cert = tls_server
    with Client(target, root_certificates=cert, api_key="k", retry=NO_RETRY, timeout=10) as c:
        assert c.generate("hi").text == "ab"


def test_untrusted_or_plaintext_fails(tls_server):
    target, _ = tls_server
    with Client(target, secure=True, retry=NO_RETRY, timeout=5) as c:     # system roots
        with pytest.raises(Unavailable):
            c.generate("hi")
    with Client(target, retry=NO_RETRY, timeout=5) as c:                  # plaintext
        with pytest.raises(Unavailable):
            c.generate("hi")
