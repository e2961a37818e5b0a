"""File L3: exact LRU eviction, atomic writes, the index rebuilt after a restart."""

import os
import shutil
import time

import pytest

from nibble.tiering.storage import FileStorage
from nibble.tiering.storage.file_backend import TMP_PREFIX

from .conftest import FAST_BACKOFF, wait_for

KEYS = [bytes([i]) * 32 for i in range(8)]


def _val(i: int, n: int = 1000) -> bytes:
    return bytes([65 + i]) * n


def _disk_names(root) -> set[str]:
    return {f for _, _, files in os.walk(root) for f in files}


def _set_mtime(store: FileStorage, key: bytes, t: float) -> None:
    os.utime(store._path(key), (t, t))


def test_lru_evicts_exactly_the_least_recently_used(tmp_path):
    store = FileStorage(tmp_path, max_bytes=3500)
    assert store.put_batch([(KEYS[i], _val(i)) for i in range(3)]) == 3
    assert store.get_batch([KEYS[0]]) == [_val(0)]  # k0 becomes most recent
    store.put_batch([(KEYS[3], _val(3))])  # 4000 > 3500: evict k1
    assert store.exists_batch(KEYS[:4]) == [True, False, True, True]
    assert KEYS[1].hex() not in _disk_names(tmp_path)
    store.put_batch([(KEYS[4], _val(4))])  # order k2, k0, k3, k4: evict k2
    assert store.exists_batch(KEYS[:5]) == [True, False, False, True, True]
    stats = store.stats()
    assert (stats["files"], stats["used_bytes"], stats["evictions"]) == (3, 3000, 2)
    assert _disk_names(tmp_path) == {KEYS[i].hex() for i in (0, 3, 4)}


def test_overwrite_accounts_the_new_size(tmp_path):
    store = FileStorage(tmp_path, max_bytes=3000)
    store.put_batch([(KEYS[0], _val(0, 2000)), (KEYS[1], _val(1, 500))])
    store.put_batch([(KEYS[0], _val(0, 100))])
    assert store.stats()["used_bytes"] == 600
    store.put_batch([(KEYS[2], _val(2, 2400))])  # 3000 exactly: nothing evicted
    assert store.exists_batch(KEYS[:3]) == [True, True, True]


def test_value_larger_than_the_whole_store_is_refused(tmp_path):
    store = FileStorage(tmp_path, max_bytes=1000)
    assert store.max_value_bytes == 1000
    assert store.put_batch([(KEYS[0], _val(0, 1001)), (KEYS[1], _val(1, 1000))]) == 1
    assert store.stats()["refused"] == 1
    assert store.exists_batch(KEYS[:2]) == [False, True]


def test_a_write_that_never_renames_is_invisible(tmp_path):
    """A crash after writing the temp file and before the rename."""
    store = FileStorage(tmp_path)
    store.put_batch([(KEYS[0], _val(0))])
    torn_old = store._write_temp(store._path(KEYS[0]), _val(5)[:300])  # rewrite of k0
    torn_new = store._write_temp(store._path(KEYS[1]), _val(1)[:300])  # first write of k1
    assert torn_old.parent == store._path(KEYS[0]).parent  # same dir: rename is atomic
    assert store.get_batch(KEYS[:2]) == [_val(0), None]
    assert store.exists_batch(KEYS[:2]) == [True, False]
    store.close()

    # Restart: only the record is indexed; fresh temp files may be another writer's.
    again = FileStorage(tmp_path)
    assert again.get_batch(KEYS[:2]) == [_val(0), None]
    assert again.stats()["used_bytes"] == 1000 and torn_new.exists()
    old = time.time() - 3600
    for t in (torn_old, torn_new):
        os.utime(t, (old, old))
    again.close()
    FileStorage(tmp_path).close()  # stale temp files are crash leftovers: removed
    assert not torn_old.exists() and not torn_new.exists()
    assert not any(n.startswith(TMP_PREFIX) for n in _disk_names(tmp_path))


def test_failed_rename_leaves_no_file_and_no_exception(tmp_path, monkeypatch):
    store = FileStorage(tmp_path, **FAST_BACKOFF)
    store.put_batch([(KEYS[0], _val(0))])

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", boom)
        assert store.put_batch([(KEYS[0], _val(9)), (KEYS[1], _val(1))]) == 0
        assert store.health().state == "down"
    assert _disk_names(tmp_path) == {KEYS[0].hex()}
    assert wait_for(lambda: store.health().state == "up")
    assert store.get_batch(KEYS[:2]) == [_val(0), None]


def test_index_is_rebuilt_from_disk_in_mtime_order(tmp_path):
    store = FileStorage(tmp_path)
    store.put_batch([(KEYS[i], _val(i)) for i in range(4)])
    t0 = time.time() - 1000
    for i, age in enumerate([3, 1, 0, 2]):  # LRU order by mtime: k2, k1, k3, k0
        _set_mtime(store, KEYS[i], t0 + age)
    store.close()

    again = FileStorage(tmp_path, max_bytes=10_000)
    assert (again.stats()["files"], again.stats()["used_bytes"]) == (4, 4000)
    assert again.get_batch(KEYS[:4]) == [_val(i) for i in range(4)]
    for i, age in enumerate([3, 1, 0, 2]):  # undo the touches of that read
        _set_mtime(again, KEYS[i], t0 + age)
    again.get_batch([KEYS[2]])  # a read touches k2's mtime: now k1, k3, k0, k2
    again.close()

    small = FileStorage(tmp_path, max_bytes=2500)  # start over budget: evict the 2 oldest
    assert small.exists_batch(KEYS[:4]) == [True, False, True, False]
    assert small.stats()["evictions"] == 2
    assert _disk_names(tmp_path) == {KEYS[0].hex(), KEYS[2].hex()}


def test_foreign_files_are_never_indexed_or_cleared(tmp_path):
    key = b"\xab" * 32
    store = FileStorage(tmp_path)
    store.put_batch([(key, _val(1))])
    foreign = [tmp_path / "README", tmp_path / "ab" / "notes.txt",
               tmp_path / "ab" / key.hex().upper(), tmp_path / "cd" / key.hex()]
    for f in foreign:
        f.write_bytes(b"keep")
    store.close()
    again = FileStorage(tmp_path)
    assert again.stats()["files"] == 1
    assert again.clear() == 1
    assert all(f.read_bytes() == b"keep" for f in foreign)
    assert again.get_batch([key]) == [None]


def test_record_removed_behind_our_back_is_a_miss(tmp_path):
    store = FileStorage(tmp_path)
    store.put_batch([(KEYS[0], _val(0))])
    store._path(KEYS[0]).unlink()
    assert store.get_batch([KEYS[0]]) == [None]
    assert store.exists_batch([KEYS[0]]) == [False]
    assert store.health().state == "up"


def test_directory_removed_mid_run_goes_down_then_up(tmp_path):
    root = tmp_path / "l3"
    store = FileStorage(root, backoff_base_s=0.2, backoff_max_s=0.4)
    store.put_batch([(KEYS[0], _val(0))])
    shutil.rmtree(root)
    assert store.put_batch([(KEYS[1], _val(1))]) == 0
    assert store.health().state == "down"
    assert store.get_batch(KEYS[:2]) == [None, None]
    assert wait_for(lambda: store.health().state == "up")
    assert store.stats()["files"] == 0  # the index follows the disk
    assert store.put_batch([(KEYS[1], _val(1))]) == 1
    assert store.get_batch(KEYS[:2]) == [None, _val(1)]


def test_bad_max_bytes_raise(tmp_path):
    with pytest.raises(ValueError):
        FileStorage(tmp_path, max_bytes=0)
