"""The builder's L3: the file budget it passes, the Redis password it reads, the KV secret."""

from __future__ import annotations

import logging
from collections import namedtuple

import pytest

from nibble.services.config import CacheConfig, HiCacheConfig
from nibble.services.credentials import STORAGE_PASSWORD_ENV
from nibble.services.engine import tier_setup
from nibble.services.engine.tier_setup import (DEFAULT_STORAGE_BYTES, build_storage, load_secret,
                                               storage_budget)
from nibble.tiering.storage import FileStorage

from tests.redis_fixtures import RedisServer

Usage = namedtuple("Usage", "total used free")


def file_cfg(path, size=None) -> HiCacheConfig:
    return HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="file",
                         hicache_storage_url=str(path), hicache_storage_size=size)


def test_the_file_budget_is_passed_and_enforced(tmp_path):
    store = build_storage(file_cfg(tmp_path / "l3", size=1e-6))      # 1000 bytes
    try:
        assert isinstance(store, FileStorage) and store.max_bytes == 1000
        keys = [bytes([i]) * 32 for i in range(5)]
        assert store.put_batch([(k, b"v" * 300) for k in keys]) == 5
        stats = store.stats()
        assert stats["used_bytes"] <= 1000 and stats["evictions"] == 2
        assert store.exists_batch(keys) == [False, False, True, True, True]   # oldest went
        assert store.put_batch([(b"\x09" * 32, b"v" * 1001)]) == 0            # over the budget
    finally:
        store.close()


def test_the_default_budget_is_16gb_or_half_the_usable_disk(tmp_path, monkeypatch):
    root = tmp_path / "l3"
    root.mkdir()
    (root / "held").write_bytes(b"h" * 1000)
    monkeypatch.setattr(tier_setup.shutil, "disk_usage", lambda p: Usage(0, 0, 9000))
    assert storage_budget(file_cfg(root), str(root)) == 5000                 # (9000 + 1000) / 2
    monkeypatch.setattr(tier_setup.shutil, "disk_usage", lambda p: Usage(0, 0, 10**15))
    assert storage_budget(file_cfg(root), str(root)) == DEFAULT_STORAGE_BYTES
    assert storage_budget(file_cfg(tmp_path / "not" / "yet"), str(tmp_path / "not" / "yet")) \
        == DEFAULT_STORAGE_BYTES
    assert storage_budget(file_cfg(root, size=2.5), str(root)) == 2_500_000_000


def test_no_kv_secret_gives_an_ephemeral_one_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("NIBBLE_KV_SECRET", raising=False)
    with caplog.at_level(logging.WARNING):
        a = load_secret(CacheConfig(), for_storage=True)
    assert a.ephemeral and "will not verify after a restart" in caplog.text
    assert load_secret(CacheConfig(), for_storage=False) != a
    path = tmp_path / "kv-secret"
    path.write_text("a-deployment-secret-0123456789\n")
    path.chmod(0o600)
    got = load_secret(CacheConfig(kv_secret_file=str(path)), for_storage=True)
    assert not got.ephemeral and got == load_secret(CacheConfig(kv_secret_file=str(path)), True)


@pytest.mark.redis
@pytest.mark.parametrize("how", ["file", "env"])
def test_the_redis_password_comes_from_a_file_or_the_environment(tmp_path, monkeypatch, how):
    server = RedisServer(tmp_path, password="hunter2-from-a-file").start()
    try:
        monkeypatch.delenv(STORAGE_PASSWORD_ENV, raising=False)
        cfg = HiCacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="redis",
                            hicache_storage_url=server.url, hicache_storage_prefix="nibble:test:pw:")
        denied = build_storage(cfg)
        assert not denied.health().up and "auth" in denied.health().last_error.lower()
        denied.close()
        if how == "file":
            pw = tmp_path / "redis-password"
            pw.write_text("hunter2-from-a-file\n")
            pw.chmod(0o600)
            cfg = HiCacheConfig(**{**cfg.__dict__, "hicache_storage_password_file": str(pw)})
        else:
            monkeypatch.setenv(STORAGE_PASSWORD_ENV, "hunter2-from-a-file")
        store = build_storage(cfg)
        try:
            assert store.health().up
            assert store.put_batch([(b"\x01" * 32, b"v")]) == 1
            assert store.get_batch([b"\x01" * 32]) == [b"v"]
        finally:
            store.clear()
            store.close()
    finally:
        server.stop()
