"""L3 on Redis: pipelined batch GET/SET/EXISTS with redis-py and hiredis.

Key of a page: ``prefix + key.hex()`` (ASCII). Values are page records as
bytes, optionally with a TTL. redis-py's own retries are turned off: a
connection or timeout error marks the tier down at once and the base class
reconnects with backoff, so a request never waits on Redis retries. An idle
connection killed by the server is replaced transparently by redis-py's pool
when it is next checked out.

Prefixes of different backends sharing one Redis must not be prefixes of one
another; ``clear`` deletes only keys of the form ``prefix + <lowercase hex>``.

The password can be given apart from the URL (``password=``; the server reads it
from ``--hicache-storage-password-file`` or ``$NIBBLE_HICACHE_STORAGE_PASSWORD``),
so it need not appear in argv or in the URL shown by info routes.
"""

from __future__ import annotations

import os
import re
from itertools import islice
from urllib.parse import urlsplit
from typing import Iterable, Iterator

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .base import (DEFAULT_MAX_VALUE_BYTES, StorageArgumentError, StorageBackend, Value,
                   register_storage_backend)

_HEX_SUFFIX = re.compile(rb"(?:[0-9a-f]{2})+")
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def _chunks(seq: Iterable, n: int) -> Iterator[list]:
    it = iter(seq)
    while chunk := list(islice(it, n)):
        yield chunk


@register_storage_backend("redis")
class RedisStorage(StorageBackend):
    """Page records in Redis under ``prefix``.

    Options: ``ttl_s`` (expire keys after that many seconds, None: never),
    ``socket_timeout``/``connect_timeout`` (seconds; a stall longer than that
    marks the tier down), ``pipeline_chunk`` (commands per round trip),
    ``client_name`` (CLIENT SETNAME on every connection), ``password`` (AUTH; not
    together with one in the URL), ``max_value_bytes``, ``backoff_base_s``/``backoff_max_s``
    (reconnect backoff).
    """

    _down_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
    _soft_errors = (redis.exceptions.RedisError,)

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "nibble:kv:",
                 ttl_s: float | None = None, *, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 socket_timeout: float = 2.0, connect_timeout: float = 1.0,
                 pipeline_chunk: int = 256, client_name: str | None = None,
                 password: str | None = None,
                 backoff_base_s: float = 0.1, backoff_max_s: float = 10.0):
        super().__init__(max_value_bytes=max_value_bytes, backoff_base_s=backoff_base_s,
                         backoff_max_s=backoff_max_s)
        if not isinstance(prefix, str) or not prefix:
            raise StorageArgumentError("the Redis key prefix must be a non-empty string")
        if ttl_s is not None and ttl_s <= 0:
            raise StorageArgumentError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if pipeline_chunk <= 0:
            raise StorageArgumentError("pipeline_chunk must be > 0")
        self.prefix, self.ttl_s, self.pipeline_chunk = prefix, ttl_s, int(pipeline_chunk)
        self._prefix_b = prefix.encode()
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.client_name = client_name or f"nibble-l3-{os.getpid()}-{id(self):x}"
        auth = {}
        if password:
            try:
                in_url = urlsplit(url).password
            except ValueError:
                in_url = None
            if in_url:
                raise StorageArgumentError("the Redis password is given twice: in the URL and "
                                           "apart from it; keep it out of the URL")
            auth["password"] = password
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                client_name=self.client_name, retry=Retry(NoBackoff(), 0), **auth)
        except ValueError as e:      # redis-py's message names the problem, not the URL
            raise StorageArgumentError(f"bad Redis URL: {e}") from None
        try:
            self._client.ping()
        except self._down_errors as e:
            self._mark_down(e)

    def _rkey(self, key: bytes) -> bytes:
        return self._prefix_b + key.hex().encode()

    def _pipelined(self, build, items: list, convert, fallback) -> list:
        """Run ``build(pipe, item)`` per item in chunked pipelines; convert each reply.

        A reply that is a server error counts as a soft error and yields ``fallback``.
        """
        out = []
        for chunk in _chunks(items, self.pipeline_chunk):
            pipe = self._client.pipeline(transaction=False)
            for item in chunk:
                build(pipe, item)
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, Exception):
                    self._soft_error(reply)
                    out.append(fallback)
                else:
                    out.append(convert(reply))
        return out

    def _put(self, items: list[tuple[bytes, Value]]) -> list[bool]:
        return self._pipelined(lambda p, kv: p.set(self._rkey(kv[0]), kv[1], px=self._ttl_ms),
                               items, bool, False)

    def _get(self, keys: list[bytes]) -> list[bytes | None]:
        return self._pipelined(lambda p, k: p.get(self._rkey(k)), keys, lambda r: r, None)

    def _exists(self, keys: list[bytes]) -> list[bool]:
        return self._pipelined(lambda p, k: p.exists(self._rkey(k)), keys, bool, False)

    def _delete(self, keys: list[bytes]) -> int:
        return sum(self._client.unlink(*[self._rkey(k) for k in chunk])
                   for chunk in _chunks(keys, 512))

    def _clear(self) -> int:
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self.prefix) + "*"
        n, plen = 0, len(self._prefix_b)
        mine = (k for k in self._client.scan_iter(match=pattern, count=1000)
                if k.startswith(self._prefix_b) and _HEX_SUFFIX.fullmatch(k[plen:]))
        for chunk in _chunks(mine, 512):
            n += self._client.unlink(*chunk)
        return n

    def _reconnect(self) -> None:
        self._client.connection_pool.disconnect(inuse_connections=False)
        self._client.ping()

    def _close(self) -> None:
        self._client.close()

    def _extra_stats(self) -> dict:
        return {"prefix": self.prefix, "ttl_s": self.ttl_s, "client_name": self.client_name}
