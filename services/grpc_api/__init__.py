"""The gRPC API (``nibble.v1.Nibble``) served beside the OpenAI HTTP gateway.

``GrpcServer(engine, server_cfg)`` serves, on ``--grpc-port``: the Nibble
service (``servicer.py``), ``grpc.health.v1.Health`` and server reflection,
behind the same API keys as HTTP (``auth.py``). Requests are prepared by the
shared frontend (services/frontend, through ``convert.py``), so both APIs accept
and reject the same inputs; exceptions map to status codes in ``errors.py``.
Nothing here imports the HTTP gateway.
"""

from .server import GrpcServer

__all__ = ["GrpcServer"]
