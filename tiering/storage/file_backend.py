"""L3 on a local directory: one file per page record, LRU-bounded. The embedded default.

Layout: ``<root>/<first 2 hex digits>/<key hex>``, 256 shard directories.
A write goes to ``.tmp-<name>.<random>`` in the same shard and is renamed over
the final name (``os.replace``), so a reader sees the old record or the new
one, never a partial file. No fsync: a torn record after power loss fails its
page checksum and is recomputed.

The LRU index (key -> size, least recently used first) lives in memory; it is
rebuilt from the directory at start, ordered by mtime, and a read touches the
file's mtime so the order survives a restart. One process owns a directory.

Nothing in the directory is trusted: it is created 0700 (tightened if looser),
records are written 0600, and a read opens the file without following links,
refusing anything that is not a regular file or is larger than
``max_value_bytes`` (a link to ``/dev/zero``, a FIFO, a huge planted file).
The records themselves are authenticated by the tier worker (``page_record``).
``max_bytes`` bounds the total: the least recently used records are evicted
to make room, and a single record larger than the budget is refused.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from nibble.kernels.errors import NibbleError

from .base import (DEFAULT_MAX_VALUE_BYTES, StorageArgumentError, StorageBackend, Value,
                   register_storage_backend)

log = logging.getLogger(__name__)
TMP_PREFIX = ".tmp-"
DIR_MODE, FILE_MODE = 0o700, 0o600
STALE_TMP_S = 60.0  # temp files older than this at start are leftovers of a crash
_KEY_NAME = re.compile(r"(?:[0-9a-f]{2})+")


class RefusedFileError(NibbleError):
    """A record file is not a regular file within the size limit (counted, treated as a miss)."""


# Per-file failures from something planted at a record's path: a symbolic link (O_NOFOLLOW
# gives ELOOP), a socket (ENXIO), a file we may not read. They refuse that file only.
_PLANTED_ERRNOS = (errno.ELOOP, errno.ENXIO, errno.EACCES, errno.EPERM, errno.EISDIR,
                   errno.ENOTEMPTY, errno.EEXIST)


@register_storage_backend("file")
class FileStorage(StorageBackend):
    """Page records as files under ``path``; ``max_bytes`` bounds the total (LRU evicts).

    Options: ``max_value_bytes`` (also capped at ``max_bytes``), ``fsync``
    (sync each file before the rename), ``backoff_base_s``/``backoff_max_s``.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int | None = None, *,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES, fsync: bool = False,
                 backoff_base_s: float = 0.1, backoff_max_s: float = 10.0):
        if max_bytes is not None and max_bytes <= 0:
            raise StorageArgumentError(f"max_bytes must be > 0 or None, got {max_bytes}")
        cap = max_value_bytes if max_bytes is None else min(max_value_bytes, max_bytes)
        super().__init__(max_value_bytes=cap, backoff_base_s=backoff_base_s,
                         backoff_max_s=backoff_max_s)
        self.root = Path(path)
        if self.root.exists() and not self.root.is_dir():
            raise StorageArgumentError(f"file storage path {self.root} is not a directory")
        self.max_bytes, self.fsync = max_bytes, fsync
        self._ilock = threading.Lock()  # guards the index, renames and unlinks
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._used = 0
        self._evictions = 0
        try:
            self._reconnect()
        except OSError as e:
            self._mark_down(e)

    # ------------------------------------------------------------ paths and index

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / name

    def _scan(self) -> list[tuple[int, bytes, int]]:
        """``(mtime_ns, key, size)`` of every record on disk; drops stale temp files."""
        found, now = [], time.time()
        for shard in range(256):
            with os.scandir(self.root / f"{shard:02x}") as it:
                for e in it:
                    if e.name.startswith(TMP_PREFIX):
                        st = e.stat(follow_symlinks=False)
                        if now - st.st_mtime > STALE_TMP_S:
                            os.unlink(e.path)
                        continue
                    if _KEY_NAME.fullmatch(e.name) and e.name[:2] == f"{shard:02x}" \
                            and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        if st.st_mode & 0o077:
                            os.chmod(e.path, FILE_MODE)
                        found.append((st.st_mtime_ns, bytes.fromhex(e.name), st.st_size))
        return found

    @staticmethod
    def _private_dir(path: Path) -> None:
        """Create ``path`` (mode 0700), or tighten an existing one that is looser."""
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning("L3 directory %s had mode %o; setting 0700", path, mode)
            os.chmod(path, DIR_MODE)

    def _reconnect(self) -> None:
        """Create the shard directories and rebuild the index from what is on disk."""
        self._private_dir(self.root)
        for shard in range(256):
            self._private_dir(self.root / f"{shard:02x}")
        found = sorted(self._scan())
        with self._ilock:
            self._index = OrderedDict((k, size) for _, k, size in found)
            self._used = sum(size for _, _, size in found)
            self._evict_locked()

    def _drop_locked(self, key: bytes) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        return True

    def _evict_locked(self) -> None:
        while self.max_bytes is not None and self._used > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self._evictions += 1
            self._path(key).unlink(missing_ok=True)

    def _write_temp(self, final: Path, value: Value) -> Path:
        """Write ``value`` to a fresh temp file beside ``final``; return its path."""
        tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    # ------------------------------------------------------------ hooks

    def _put(self, items: list[tuple[bytes, Value]]) -> list[bool]:
        flags = []
        for key, value in items:
            final = self._path(key)
            tmp = self._write_temp(final, value)
            with self._ilock:
                try:
                    os.replace(tmp, final)
                except BaseException as e:
                    tmp.unlink(missing_ok=True)
                    if not (isinstance(e, OSError) and e.errno in _PLANTED_ERRNOS):
                        raise
                    self._soft_error(e)            # a directory planted at this record's path
                    flags.append(False)
                    continue
                self._drop_locked(key)
                self._index[key] = len(value)
                self._used += len(value)
                self._evict_locked()
            flags.append(True)
        return flags

    def _get(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            if key not in self._index:
                out.append(None)
                continue
            path = self._path(key)
            try:
                data = self._read_record(path)
            except FileNotFoundError:  # evicted meanwhile, or removed behind our back
                data = None
            except (RefusedFileError, OSError) as e:
                if isinstance(e, OSError) and e.errno not in _PLANTED_ERRNOS:
                    raise                                  # the disk itself: tier down
                self._soft_error(e)                        # a link, FIFO, device or huge file
                self._remove_planted(path)
                data = None
            if data is None:
                with self._ilock:
                    self._drop_locked(key)
                out.append(None)
                continue
            with self._ilock:
                if key in self._index:
                    self._index.move_to_end(key)
            out.append(data)
        return out

    @staticmethod
    def _remove_planted(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:               # a directory, or not ours to remove: leave it
            log.warning("cannot remove %s from the L3 directory: %s", path, e)

    def _read_record(self, path: Path) -> bytes:
        """The file's bytes, if it is a regular file of at most ``max_value_bytes``."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_value_bytes:
                raise RefusedFileError(f"{path.name}: not a regular file of at most "
                                       f"{self.max_value_bytes} bytes")
            data = f.read(self.max_value_bytes + 1)
        if len(data) > self.max_value_bytes:
            raise RefusedFileError(f"{path.name}: grew past {self.max_value_bytes} bytes")
        os.utime(path, follow_symlinks=False)
        return data

    def _exists(self, keys: list[bytes]) -> list[bool]:
        with self._ilock:
            return [k in self._index for k in keys]

    def _delete(self, keys: list[bytes]) -> int:
        n = 0
        with self._ilock:
            for key in keys:
                if self._drop_locked(key):
                    self._path(key).unlink(missing_ok=True)
                    n += 1
        return n

    def _clear(self) -> int:
        """Remove every record file in the shard directories (foreign files stay)."""
        with self._ilock:
            n = 0
            for _, key, _ in self._scan():
                self._path(key).unlink(missing_ok=True)
                n += 1
            self._index.clear()
            self._used = 0
        return n

    def _extra_stats(self) -> dict:
        with self._ilock:
            return {"files": len(self._index), "used_bytes": self._used,
                    "max_bytes": self.max_bytes, "evictions": self._evictions}
