"""The file backend trusts nothing in its directory: private modes, no links, bounded reads."""

from __future__ import annotations

import os
import stat

import pytest

from nibble.tiering.storage import FileStorage

KEY = bytes(range(32))


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_directories_are_0700_and_records_0600(tmp_path, loose_umask):
    store = FileStorage(tmp_path / "l3")
    assert store.put_batch([(KEY, b"x" * 100)]) == 1
    path = store._path(KEY)
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700 and mode(tmp_path / "l3") == 0o700
    store.close()


def test_a_loose_existing_directory_and_record_are_tightened(tmp_path, loose_umask):
    root = tmp_path / "l3"
    FileStorage(root).put_batch([(KEY, b"x" * 100)])
    path = root / KEY.hex()[:2] / KEY.hex()
    os.chmod(root, 0o755)
    os.chmod(path.parent, 0o777)
    os.chmod(path, 0o644)
    store = FileStorage(root)
    assert (mode(root), mode(path.parent), mode(path)) == (0o700, 0o700, 0o600)
    assert store.get_batch([KEY]) == [b"x" * 100]
    store.close()


def _plant(store: FileStorage, make) -> None:
    """Put a record, then replace its file with whatever ``make(path)`` creates there."""
    store.put_batch([(KEY, b"r" * 100)])
    path = store._path(KEY)
    path.unlink()
    make(path)


@pytest.mark.parametrize("what", ["symlink", "fifo", "huge", "directory"])
def test_something_planted_at_a_record_path_is_a_miss_not_an_outage(tmp_path, what):
    store = FileStorage(tmp_path / "l3", max_value_bytes=4096)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for you")
    makers = {"symlink": lambda p: os.symlink(secret, p), "fifo": os.mkfifo,
              "huge": lambda p: p.write_bytes(b"z" * 10_000), "directory": os.mkdir}
    _plant(store, makers[what])
    assert store.get_batch([KEY]) == [None]                 # at once: a FIFO must not block
    assert store.health().up and store.stats()["errors"] == 1
    assert store.exists_batch([KEY]) == [False]             # forgotten
    assert secret.read_text() == "not for you"              # a link is removed, not followed
    if what != "directory":
        assert not os.path.lexists(store._path(KEY))
    assert store.put_batch([(KEY, b"ok")]) == (0 if what == "directory" else 1)
    assert store.health().up                                # still serving
    store.close()
