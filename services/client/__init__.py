"""Nibble's Python SDK over the gRPC API (``nibble.v1.Nibble``).

    from nibble.client import Client

    with Client("127.0.0.1:30001") as c:
        print(c.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=16).text)

``Client`` blocks, ``AsyncClient`` is its asyncio twin. Failed calls raise a
subclass of ``NibbleClientError`` named after the status code; UNAVAILABLE is
retried with exponential backoff (``RetryPolicy``), INVALID_ARGUMENT never.
The SDK needs only grpcio, grpcio-health-checking, protobuf and the stubs in
``nibble.proto``: it imports nothing of the server.
"""

from ._common import DEFAULT_TARGET, RetryPolicy
from .aio import AsyncClient
from .errors import (AlreadyExists, Cancelled, DeadlineExceeded, FailedPrecondition, Internal,
                     InvalidArgument, NibbleClientError, NotFound, PermissionDenied,
                     ResourceExhausted, Unauthenticated, Unavailable)
from .results import (Choice, GenerateResult, ServerInfo, StreamChunk, TokenLogprob, ToolCall,
                      TopLogprob, Usage)
from .sync import Client

__all__ = [
    "DEFAULT_TARGET", "AsyncClient", "Client", "RetryPolicy", "GenerateResult", "ServerInfo",
    "StreamChunk", "Usage", "Choice", "TokenLogprob", "TopLogprob", "ToolCall", "NibbleClientError", "InvalidArgument", "NotFound",
    "AlreadyExists", "Unauthenticated", "PermissionDenied", "ResourceExhausted",
    "FailedPrecondition", "Unavailable", "DeadlineExceeded", "Cancelled", "Internal",
]
