"""TLS for the HTTP and gRPC APIs (``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``).

Both servers use the same PEM files. With ``--ssl-ca-certs`` every client must
present a certificate signed by one of those CAs (mutual TLS); without it the
server only proves its own identity. ``check_server_tls`` loads the files once
at startup, before the model, so a missing file or a key that does not match
its certificate is a ConfigError, not a failure on the first connection.
"""

from __future__ import annotations

import ssl
from typing import Any

from .config import ServerConfig
from .errors import ConfigError


def tls_enabled(cfg: ServerConfig) -> bool:
    return cfg.ssl_certfile is not None and cfg.ssl_keyfile is not None


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None


def check_server_tls(cfg: ServerConfig) -> None:
    """Raise ConfigError unless the TLS files load (nothing to check when TLS is off)."""
    if not tls_enabled(cfg):
        return
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _read(cfg.ssl_certfile, "--ssl-certfile")
    _read(cfg.ssl_keyfile, "--ssl-keyfile")
    try:
        ctx.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
    except ssl.SSLError as exc:
        raise ConfigError(f"--ssl-certfile/--ssl-keyfile: not a certificate and its "
                          f"private key in PEM ({exc.reason or exc})") from None
    if cfg.ssl_ca_certs is not None:
        _read(cfg.ssl_ca_certs, "--ssl-ca-certs")
        try:
            ctx.load_verify_locations(cafile=cfg.ssl_ca_certs)
        except ssl.SSLError as exc:
            raise ConfigError(f"--ssl-ca-certs: not PEM CA certificates "
                              f"({exc.reason or exc})") from None


def uvicorn_ssl_options(cfg: ServerConfig) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``: none without TLS; client certificates
    required when a CA bundle is given."""
    if not tls_enabled(cfg):
        return {}
    out: dict[str, Any] = {"ssl_keyfile": cfg.ssl_keyfile, "ssl_certfile": cfg.ssl_certfile}
    if cfg.ssl_ca_certs is not None:
        out.update(ssl_ca_certs=cfg.ssl_ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return out


def grpc_server_credentials(cfg: ServerConfig) -> Any:
    """``grpc.ServerCredentials`` for the same files, or None without TLS."""
    if not tls_enabled(cfg):
        return None
    import grpc

    ca = _read(cfg.ssl_ca_certs, "--ssl-ca-certs") if cfg.ssl_ca_certs else None
    pair = (_read(cfg.ssl_keyfile, "--ssl-keyfile"), _read(cfg.ssl_certfile, "--ssl-certfile"))
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=ca is not None)
