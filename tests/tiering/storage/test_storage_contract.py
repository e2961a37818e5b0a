"""One suite, both L3 backends (Redis and files): real page records, batch semantics, limits."""

from dataclasses import replace

import pytest
import torch

from nibble.tiering import KVPool
from nibble.tiering.page_record import PageRecordError
from nibble.tiering.storage import (FileStorage, RedisStorage, StorageArgumentError,
                                    StorageBackend, create_storage_backend,
                                    register_storage_backend, storage_backend_names)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
def test_real_pages_come_back_bit_identical(backend, pages, fmt):
    p = pages(fmt, 6)
    assert backend.put_batch(p.items) == 6
    blobs = backend.get_batch(p.keys)
    assert blobs == p.records

    # Load every page into another pool, in reverse slots, through decode_page.
    dest = KVPool(p.layout, 6)
    dest.set_global_scales(p.pool.global_scales)
    assert dest.scale_version == p.header.scale_version
    for i, blob in enumerate(blobs):
        payload = p.decode(i, blob)
        dest.pages[5 - i].view(-1).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert torch.equal(dest.pages.flip(0), p.pool.pages)
    for layer in range(p.layout.num_layers):
        src, got = p.pool.layer(layer), dest.layer(layer)
        assert (src.k_scale is None) == (fmt == "fp8_e4m3")
        if src.k_scale is not None:  # NVFP4 block scales travel inside the page
            assert torch.equal(got.k_scale.flip(0), src.k_scale)
            assert torch.equal(got.v_scale.flip(0), src.v_scale)

    # A pool whose global scales moved on (another version) refuses the record.
    with pytest.raises(PageRecordError):
        p.decode(0, blobs[0], replace(p.header, scale_version=p.header.scale_version + 1))


def test_batches_keep_order_with_missing_keys(backend, pages):
    p = pages("nvfp4", 5)
    present = [0, 2, 4]
    assert backend.put_batch([p.items[i] for i in present]) == 3
    got = backend.get_batch(p.keys)
    assert got == [p.records[i] if i in present else None for i in range(5)]
    assert backend.exists_batch(p.keys) == [i in present for i in range(5)]
    assert backend.get_batch([]) == [] and backend.exists_batch([]) == []
    assert backend.put_batch([]) == 0 and backend.delete_batch([]) == 0
    stats = backend.stats()
    assert (stats["hits"], stats["misses"], stats["pages_written"]) == (3, 2, 3)
    assert stats["bytes_read"] == sum(len(p.records[i]) for i in present)
    assert stats["bytes_written"] == stats["bytes_read"]
    assert backend.health().state == "up"


def test_overwrite_keeps_the_latest_value(backend):
    key = bytes(range(32))
    assert backend.put_batch([(key, b"old" * 10)]) == 1
    assert backend.put_batch([(key, b"new")]) == 1
    assert backend.get_batch([key]) == [b"new"]


def test_delete_counts_only_existing_keys(backend, pages):
    p = pages("fp8_e4m3", 4)
    backend.put_batch(p.items)
    missing = b"\x00" * 32
    assert backend.delete_batch([p.keys[0], missing, p.keys[2]]) == 2
    assert backend.exists_batch(p.keys) == [False, True, False, True]
    assert backend.get_batch(p.keys[:1]) == [None]
    assert backend.delete_batch([p.keys[0]]) == 0
    assert backend.stats()["deleted"] == 2


def test_clear_removes_only_this_backend(kind, make_backend, pages):
    a, b = make_backend(kind, "a"), make_backend(kind, "b")
    pa, pb = pages("nvfp4", 3, seed=1), pages("nvfp4", 2, seed=2)
    a.put_batch(pa.items)
    b.put_batch(pb.items)
    assert a.clear() == 3
    assert a.exists_batch(pa.keys) == [False] * 3
    assert b.get_batch(pb.keys) == pb.records
    assert a.clear() == 0


def test_oversized_values_are_refused(kind, make_backend):
    store = make_backend(kind, max_value_bytes=4096)
    k1, k2 = b"\x01" * 32, b"\x02" * 32
    assert store.put_batch([(k1, b"a" * 4096), (k2, b"b" * 4097)]) == 1
    assert store.get_batch([k1, k2]) == [b"a" * 4096, None]
    assert store.stats()["refused"] == 1
    assert store.put_batch([(k2, b"b" * 5000)]) == 0
    assert store.stats()["refused"] == 2


def test_byte_buffers_are_accepted(backend):
    key = b"\x07" * 32
    assert backend.put_batch([(key, bytearray(b"xyz")), (key[:16], memoryview(b"abc"))]) == 2
    assert backend.get_batch([key, key[:16]]) == [b"xyz", b"abc"]


@pytest.mark.parametrize("bad", [
    [("k" * 32, b"v")],            # str key
    [(b"", b"v")],                 # empty key
    [(b"k" * 101, b"v")],          # key too long for a file name
    [(b"k" * 32, "v")],            # str value
    [(b"k" * 32, 3)],              # not a buffer
    [b"k" * 32],                   # not a pair
])
def test_bad_arguments_raise(backend, bad):
    with pytest.raises(StorageArgumentError):
        backend.put_batch(bad)
    assert backend.stats()["ops"] == 0


def test_bad_keys_raise_on_every_op(backend):
    for op in (backend.get_batch, backend.exists_batch, backend.delete_batch):
        with pytest.raises(StorageArgumentError):
            op(["abc"])
        with pytest.raises(ValueError):  # StorageArgumentError is a ValueError
            op([None])


def test_closed_backend_serves_misses(backend):
    key = b"\x03" * 32
    backend.put_batch([(key, b"v")])
    backend.close()
    assert backend.get_batch([key]) == [None]
    assert backend.put_batch([(key, b"w")]) == 0
    health = backend.health()
    assert (health.state, health.last_error) == ("down", "closed")
    backend.close()  # idempotent


def test_registry(tmp_path):
    assert {"file", "redis"} <= set(storage_backend_names())
    store = create_storage_backend("file", str(tmp_path / "l3"), max_bytes=1 << 20)
    assert isinstance(store, FileStorage) and store.max_bytes == 1 << 20
    store.close()
    with pytest.raises(StorageArgumentError, match="unknown storage backend"):
        create_storage_backend("s3", "s3://bucket")
    with pytest.raises(StorageArgumentError, match="already"):
        register_storage_backend("redis")(type("Other", (FileStorage,), {}))
    with pytest.raises(StorageArgumentError):
        register_storage_backend("dict")(dict)
    assert RedisStorage.name == "redis" and issubclass(RedisStorage, StorageBackend)


def test_file_backend_rejects_a_file_as_its_directory(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(StorageArgumentError):
        FileStorage(tmp_path / "f")
