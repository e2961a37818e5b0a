"""The L3 storage interface, its failure contract, and a registry of backends by name.

A backend stores encoded page records (``page_record.encode_page``) under the
32-byte content keys of ``page_record.chain_keys``. Every operation is a batch.

Failure contract (the request path never fails because of storage):

* A connection, timeout or I/O failure marks the backend **down**. While down,
  ``get_batch`` returns ``None`` for every key, ``exists_batch`` ``False``,
  ``put_batch``/``delete_batch``/``clear`` ``0``, without touching the store.
* A background thread retries ``_reconnect`` with capped exponential backoff
  and jitter, and marks the backend **up** again when it succeeds. ``health()``
  reports the state, the last error and the attempts of the current outage.
* A per-item server error (e.g. Redis out of memory) counts as an error and a
  miss for that item; the backend stays up.
* Bad arguments (keys that are not bytes, values that are not byte buffers)
  are programming errors and raise ``StorageArgumentError``.
* Values larger than ``max_value_bytes`` are refused: not stored, counted; a
  stored value read back larger than that (planted by someone else) is a miss,
  counted in ``oversized_reads``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Sequence, TypeVar

from nibble.kernels.errors import NibbleError

from ..registry import ClassRegistry

log = logging.getLogger(__name__)

DEFAULT_MAX_VALUE_BYTES = 64 << 20
MAX_KEY_BYTES = 100  # a key's hex form must fit in a file name
Value = bytes | memoryview
T = TypeVar("T")

_COUNTERS = ("ops", "ops_put", "ops_get", "ops_exists", "ops_delete", "ops_clear",
             "pages_written", "bytes_written", "hits", "misses", "bytes_read", "deleted",
             "refused", "oversized_reads", "errors", "skipped", "reconnects")


class StorageArgumentError(NibbleError, ValueError):
    """A caller passed a bad argument to a storage backend (a programming error)."""


@dataclass(frozen=True)
class BackendHealth:
    """A backend's state. ``since``: ``time.time()`` of the last change of ``state``."""

    state: str  # "up" | "down"
    last_error: str | None
    reconnect_attempts: int  # attempts during the current (or last) outage
    since: float

    @property
    def up(self) -> bool:
        return self.state == "up"

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def check_keys(keys: Iterable[bytes]) -> list[bytes]:
    """Validate a batch of keys: non-empty ``bytes`` of at most MAX_KEY_BYTES."""
    keys = list(keys)
    for k in keys:
        if not isinstance(k, bytes) or not 0 < len(k) <= MAX_KEY_BYTES:
            raise StorageArgumentError(
                f"storage keys must be non-empty bytes of at most {MAX_KEY_BYTES} bytes, "
                f"got {type(k).__name__} {k!r:.40}")
    return keys


def _check_value(v: object) -> Value:
    if isinstance(v, bytes):
        return v
    if isinstance(v, (bytearray, memoryview)):
        mv = memoryview(v)
        if not mv.c_contiguous:
            raise StorageArgumentError("storage values must be contiguous byte buffers")
        return mv.cast("B")
    raise StorageArgumentError(f"storage values must be bytes, got {type(v).__name__}")


def check_items(items: Iterable[tuple[bytes, object]]) -> list[tuple[bytes, Value]]:
    """Validate a batch of ``(key, value)`` pairs; values become bytes or a byte memoryview."""
    out = []
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise StorageArgumentError(f"put_batch takes (key, value) pairs, got {item!r:.60}")
        out.append((check_keys([item[0]])[0], _check_value(item[1])))
    return out


class StorageBackend(ABC):
    """Batch key-value storage for page records, with the failure contract above.

    Subclasses implement the ``_put``/``_get``/``_exists``/``_delete``/``_clear``
    hooks (which may raise ``_down_errors``) and ``_reconnect``; this class does
    argument checks, size limits, counting, health and the reconnect thread.
    """

    name: ClassVar[str] = ""
    #: Exceptions that mean the store is unreachable: mark down and reconnect.
    _down_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)
    #: Exceptions that fail one operation but leave the connection usable.
    _soft_errors: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(self, *, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 backoff_base_s: float = 0.1, backoff_max_s: float = 10.0):
        if max_value_bytes <= 0:
            raise StorageArgumentError(f"max_value_bytes must be > 0, got {max_value_bytes}")
        if not 0 < backoff_base_s <= backoff_max_s:
            raise StorageArgumentError("need 0 < backoff_base_s <= backoff_max_s")
        self.max_value_bytes = int(max_value_bytes)
        self._backoff_base, self._backoff_max = backoff_base_s, backoff_max_s
        self._lock = threading.Lock()  # guards the counters and the health fields
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._state, self._last_error, self._attempts = "up", None, 0
        self._since = time.time()
        self._closed = threading.Event()
        self._reconnector: threading.Thread | None = None

    # ------------------------------------------------------------ backend hooks

    @abstractmethod
    def _put(self, items: list[tuple[bytes, Value]]) -> list[bool]:
        """Store every pair; return per item whether it was stored."""

    @abstractmethod
    def _get(self, keys: list[bytes]) -> list[bytes | None]:
        """Values in key order, ``None`` where absent."""

    @abstractmethod
    def _exists(self, keys: list[bytes]) -> list[bool]:
        """Presence in key order."""

    @abstractmethod
    def _delete(self, keys: list[bytes]) -> int:
        """Remove keys; return how many existed."""

    @abstractmethod
    def _clear(self) -> int:
        """Remove every key of this backend (its prefix or directory only)."""

    @abstractmethod
    def _reconnect(self) -> None:
        """Re-establish the store; raise one of ``_down_errors`` if still unreachable."""

    def _close(self) -> None:
        """Release connections or handles."""

    def _extra_stats(self) -> dict:
        return {}

    # ------------------------------------------------------------ public API

    def put_batch(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store ``(key, record)`` pairs; return how many were stored (0 when down)."""
        items = check_items(items)
        ok = [(k, v) for k, v in items if len(v) <= self.max_value_bytes]
        if len(ok) < len(items):
            self._count(refused=len(items) - len(ok))
        if not ok:
            return 0
        flags = self._call("put", self._put, ok, None)
        if flags is None:
            return 0
        stored = [v for (_, v), f in zip(ok, flags) if f]
        self._count(pages_written=len(stored), bytes_written=sum(len(v) for v in stored))
        return len(stored)

    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Records in key order; ``None`` for a missing key, and for all while down."""
        keys = check_keys(keys)
        if not keys:
            return []
        out = self._call("get", self._get, keys, None) or [None] * len(keys)
        big = [i for i, v in enumerate(out) if v is not None and len(v) > self.max_value_bytes]
        for i in big:
            out[i] = None
        hits = [v for v in out if v is not None]
        if big:
            self._count(oversized_reads=len(big))
        self._count(hits=len(hits), misses=len(out) - len(hits),
                    bytes_read=sum(len(v) for v in hits))
        return out

    def exists_batch(self, keys: Sequence[bytes]) -> list[bool]:
        """Presence in key order; all ``False`` while down."""
        keys = check_keys(keys)
        if not keys:
            return []
        return self._call("exists", self._exists, keys, None) or [False] * len(keys)

    def delete_batch(self, keys: Sequence[bytes]) -> int:
        """Remove keys; return how many existed (0 when down)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        n = self._call("delete", self._delete, keys, 0)
        self._count(deleted=n)
        return n

    def clear(self) -> int:
        """Remove every key under this backend's prefix or directory; return how many."""
        n = self._call("clear", lambda _: self._clear(), None, 0)
        self._count(deleted=n)
        return n

    def health(self) -> BackendHealth:
        with self._lock:
            return BackendHealth(self._state, self._last_error, self._attempts, self._since)

    def stats(self) -> dict:
        """Counters since creation, the state, and backend-specific figures."""
        with self._lock:
            out = {"backend": self.name, "state": self._state, **self._counts}
        out.update(self._extra_stats())
        return out

    def close(self) -> None:
        """Stop reconnecting and release the store; later calls behave as if down."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            self._state, self._last_error, self._since = "down", "closed", time.time()
            thread = self._reconnector
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ machinery

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counts[name] += d

    def _call(self, op: str, fn: Callable[[T], object], arg: T, fallback):
        """Run one hook under the failure contract; ``fallback`` when down or failed."""
        if self._state != "up":
            self._count(skipped=1)
            return fallback
        self._count(ops=1, **{f"ops_{op}": 1})
        try:
            return fn(arg)
        except self._down_errors as e:
            self._mark_down(e)
        except self._soft_errors as e:
            self._soft_error(e)
        return fallback

    def _soft_error(self, exc: BaseException) -> None:
        """Count one failed item or operation that leaves the backend up."""
        with self._lock:
            self._counts["errors"] += 1
            self._last_error = f"{type(exc).__name__}: {exc}"

    def _mark_down(self, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._counts["errors"] += 1
            self._last_error = msg
            if self._state == "down" or self._closed.is_set():
                return
            self._state, self._since, self._attempts = "down", time.time(), 0
            self._reconnector = threading.Thread(
                target=self._reconnect_loop, name=f"nibble-{self.name}-reconnect", daemon=True)
            self._reconnector.start()
        log.warning("%s storage is down (%s); serving without it and reconnecting",
                    self.name, msg)

    def _backoff_s(self, attempt: int) -> float:
        """Capped exponential backoff with jitter in [50%, 100%] of the step."""
        step = min(self._backoff_max, self._backoff_base * 2.0 ** min(attempt, 30))
        return step * random.uniform(0.5, 1.0)

    def _reconnect_loop(self) -> None:
        while True:
            with self._lock:
                attempt = self._attempts
            if self._closed.wait(self._backoff_s(attempt)):
                return
            with self._lock:
                self._attempts += 1
            try:
                self._reconnect()
            except Exception as e:  # keep retrying whatever the cause; recorded in health
                if not isinstance(e, self._down_errors + self._soft_errors):
                    log.exception("%s storage reconnect failed unexpectedly", self.name)
                with self._lock:
                    self._last_error = f"{type(e).__name__}: {e}"
                continue
            with self._lock:
                if self._closed.is_set():
                    return
                self._state, self._since = "up", time.time()
                self._counts["reconnects"] += 1
                attempts = self._attempts
            log.warning("%s storage is up again after %d attempt(s)", self.name, attempts)
            return


# ---------------------------------------------------------------- registry

_BACKENDS: ClassRegistry = ClassRegistry(StorageBackend, "storage backend", StorageArgumentError)


def register_storage_backend(name: str) -> Callable[[type[StorageBackend]], type[StorageBackend]]:
    """Class decorator: make a backend available to ``create_storage_backend(name, ...)``."""
    return _BACKENDS.register(name)


def storage_backend_names() -> list[str]:
    return _BACKENDS.names()


def create_storage_backend(name: str, url_or_path: str, **opts) -> StorageBackend:
    """Build a registered backend: ``redis`` takes a URL, ``file`` a directory."""
    return _BACKENDS.get(name)(url_or_path, **opts)
