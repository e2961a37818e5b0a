"""What every API in front of the engine shares (the HTTP gateway and the gRPC API).

- ``client.py`` (in services/engine): the ``EngineClient`` both APIs talk to;
- ``prepare.py``: validation, template and tokenization of a request (the only
  place requests are validated), run on ``preparer.Preparer``'s threads;
- ``tracking.py``: the in-flight registry, per-request metrics and ``AbortGuard``;
- ``drain.py``: the graceful drain after SIGTERM;
- ``errors.py``: what an engine or request error means to a client;
- ``auth.py``: API keys, tenants and which caller may do what;
- ``protocol.py``: the OpenAI request models and response formatters.

Nothing here imports ``gateway`` or ``grpc_api``.
"""
