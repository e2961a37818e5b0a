"""Fixtures for the L3 storage tests.

Redis fixtures (``redis_url``, ``redis_prefix``, ``private_redis``, ``raw_redis``)
come from ``tests/redis_fixtures.py``, loaded by the top-level conftest.
* ``backend``/``make_backend``: the same tests against Redis and files.
* ``pages``: real page records of a small pool filled with random bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.tiering import KVPool
from nibble.tiering.page_record import (PageHeader, chain_keys, decode_page, encode_page,
                                        namespace_root)
from nibble.tiering.secret import KVSecret
from nibble.tiering.storage import FileStorage, RedisStorage

from tests.redis_fixtures import RedisServer, free_port, wait_for  # noqa: F401 (used by tests)
FAST_BACKOFF = dict(backoff_base_s=0.05, backoff_max_s=0.2)
SECRET = KVSecret("storage-tests-secret-0123456789")


@pytest.fixture
def make_backend(request, tmp_path):
    """``make_backend(kind, name="a", **opts)``: a fresh backend, closed at the end.

    Redis backends share the test's ``redis_prefix`` + name; file backends get
    ``tmp_path / name``. Fast reconnect backoff unless overridden.
    """
    made = []

    def make(kind: str, name: str = "a", **opts):
        opts = {**FAST_BACKOFF, **opts}
        if kind == "redis":
            url = opts.pop("url", None) or request.getfixturevalue("redis_url")
            prefix = request.getfixturevalue("redis_prefix") + name + ":"
            store = RedisStorage(url, prefix=prefix, **opts)
        else:
            store = FileStorage(tmp_path / name, **opts)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis), "file"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def backend(kind, make_backend):
    return make_backend(kind)


@dataclass
class Pages:
    layout: PageLayout
    pool: KVPool
    header: PageHeader
    keys: list[bytes]
    records: list[bytes]
    secret: KVSecret = SECRET

    @property
    def items(self) -> list[tuple[bytes, bytes]]:
        return list(zip(self.keys, self.records))

    def decode(self, i: int, blob: bytes, header: PageHeader | None = None) -> memoryview:
        """``decode_page`` of ``blob`` read under page ``i``'s key."""
        return decode_page(blob, header or self.header, key=self.keys[i], secret=self.secret)


def make_pages(kv_format: str, n: int, seed: int = 0, **geom) -> Pages:
    """``n`` pages of random bytes in a KVPool, their chain keys and encoded records."""
    geom = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "page_size": 16, **geom}
    layout = PageLayout(kv_format, **geom)
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(layout, n)
    pool.set_global_scales(torch.rand((layout.num_layers, 2), generator=g) + 0.5)
    pool.pages.copy_(torch.randint(0, 256, pool.pages.shape, dtype=torch.uint8, generator=g))
    header = PageHeader.for_pool(layout, pool.scale_version, pool.global_scales)
    tokens = torch.randint(0, 50_000, (n * layout.page_size,), generator=g).tolist()
    root = namespace_root("test-model", layout, f"tenant-{seed}", secret=SECRET)
    keys = chain_keys(root, tokens, layout.page_size, secret=SECRET)
    records = [encode_page(header, pool.pages[i], key=keys[i], secret=SECRET) for i in range(n)]
    return Pages(layout, pool, header, keys, records)


@pytest.fixture
def pages():
    return make_pages
