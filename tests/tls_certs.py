"""Throwaway TLS material for tests: a CA, a server certificate for loopback, a client one.

    certs = make_certs(tmp_path)
    certs.server_cert, certs.server_key, certs.ca   # PEM file paths
    certs.client_cert, certs.client_key             # signed by the same CA (mutual TLS)

Everything is generated in the test (``cryptography``), valid for a day, never committed.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path                 # a CA that signed none of the above

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(common_name, _name(common_name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(common_name: str, ca: x509.Certificate, ca_key, server: bool
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (_builder(common_name, ca.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_certs(directory: Path) -> Certs:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, as
    PEM files under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _make_ca("nibble-test-ca")
    other, _ = _make_ca("nibble-test-other-ca")
    server, server_key = _leaf("nibble-test-server", ca, ca_key, server=True)
    client, client_key = _leaf("nibble-test-client", ca, ca_key, server=False)
    return Certs(ca=_write_cert(ca, directory / "ca.pem"),
                 server_cert=_write_cert(server, directory / "server.pem"),
                 server_key=_write_key(server_key, directory / "server.key"),
                 client_cert=_write_cert(client, directory / "client.pem"),
                 client_key=_write_key(client_key, directory / "client.key"),
                 other_ca=_write_cert(other, directory / "other-ca.pem"))
