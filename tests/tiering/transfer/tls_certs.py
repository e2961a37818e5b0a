"""A throwaway certificate authority for TLS tests (``cryptography``, EC P-256, 1 day)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


@dataclass
class Issued:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def write(self, cert_path: Path, key_path: Path | None = None):
        """PEM files: the certificate (and the key); returns the path(s)."""
        cert_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        if key_path is None:
            return cert_path
        key_path.write_bytes(self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        key_path.chmod(0o600)
        return cert_path, key_path


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def make_ca(name: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(name, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Issued(key, cert)


def make_cert(ca: Issued, dns_names: list[str]) -> Issued:
    """A worker certificate for server and client use, SANs ``dns_names`` and 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(
        "127.0.0.1"))]
    cert = (_builder(dns_names[0], ca.cert.subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    return Issued(key, cert)
