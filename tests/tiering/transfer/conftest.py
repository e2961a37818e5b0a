"""Fixtures for the transport tests: the same tests run against every transport.

* ``transport_name``: "nixl" and "grpc"; NIXL tests skip with the reason when
  NIXL cannot be imported or its UCX backend cannot start here.
* ``peer``: a receiving worker in a second process (spawn), one pool per KV
  format, for the whole module.
* ``senders``: this process's sending transports, one per format, over pools of
  real quantized K/V (``store_kv_ref`` on random activations).
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import PageLayout, store_kv_ref
from nibble.tiering import KVPool
from nibble.tiering.transfer import TransportUnavailableError, create_transport, load_nixl
from nibble.tiering.transfer.loopback import LoopbackPeer, PoolSpec

SECRET = b"nibble-test-secret-0123456789abcdef"
GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=32, page_size=16)
LAYOUTS = {f: PageLayout(f, **GEOM) for f in ("nvfp4", "fp8_e4m3")}
NUM_PAGES = 12
TRANSPORTS = ["nixl", "grpc"]
# Small, odd chunks so the gRPC stream cuts pages mid-way and spans page boundaries.
SENDER_OPTS = {"grpc": {"chunk_bytes": 3000}, "nixl": {}}


def nixl_skip_reason() -> str | None:
    try:
        load_nixl()
        create_transport("nixl", secret=SECRET).close()
    except TransportUnavailableError as e:
        return f"NIXL unavailable here: {e}"
    return None


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport_name(request) -> str:
    if request.param == "nixl" and (reason := nixl_skip_reason()):
        pytest.skip(reason)
    return request.param


def fill_with_kv(pool: KVPool, seed: int) -> None:
    """Quantize random K/V (std 2) into every slot of every page, layer by layer."""
    lay = pool.layout
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(pool.num_pages * lay.page_size)
    for layer in range(lay.num_layers):
        k, v = (torch.randn(len(slots), lay.num_kv_heads, lay.head_dim, generator=g) * 2
                for _ in range(2))
        store_kv_ref(lay, pool.layer(layer), k, v, slots, 1.0, 1.0)


@pytest.fixture(scope="module")
def peer(transport_name):
    specs = {f: PoolSpec(transport_name, lay, NUM_PAGES) for f, lay in LAYOUTS.items()}
    try:
        p = LoopbackPeer(specs, SECRET)
    except TransportUnavailableError as e:
        pytest.skip(f"{transport_name} cannot start in a child process: {e}")
    yield p
    p.close()


@pytest.fixture(scope="module")
def senders(transport_name):
    out = {}
    for i, (fmt, lay) in enumerate(LAYOUTS.items()):
        pool = KVPool(lay, NUM_PAGES)
        fill_with_kv(pool, seed=i)
        tr = create_transport(transport_name, secret=SECRET, **SENDER_OPTS[transport_name])
        tr.attach(pool.pages)
        out[fmt] = (pool, tr)
    yield out
    for _, tr in out.values():
        tr.close()
