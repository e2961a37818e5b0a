"""Issue 14, finding 1: someone who can write to L3 (Redis, the file directory) cannot make
the engine use a page it did not write for that prompt, nor feed it NaN.

Each attack runs against real Redis and the file backend, through a real EngineCore:
the poisoned record is refused (counted by reason, deleted from L3), the page is
recomputed, the answer equals the unpoisoned one, and no other request fails.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from nibble.services.engine.builder import Injected, build_engine_core
from nibble.services.metrics import Metrics
from nibble.tiering.page_record import MAGIC, decode_page, encode_page
from nibble.tiering.secret import KVSecret
from nibble.tiering.storage import FileStorage, RedisStorage

from .conftest import CharTokenizer, tiered_config
from .test_engine import PROMPT, greedy, run_all

OTHER = [(11 * i + 5) % 90 + 1 for i in range(70)]       # differs from PROMPT at token 0
THIRD = [(13 * i + 2) % 90 + 1 for i in range(50)]


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis), "file"])
def store(request, tmp_path):
    if request.param == "redis":
        s = RedisStorage(request.getfixturevalue("redis_url"),
                         prefix=request.getfixturevalue("redis_prefix"),
                         backoff_base_s=0.05, backoff_max_s=0.2)
    else:
        s = FileStorage(tmp_path / "l3", max_bytes=64 << 20)
    yield s
    s.close()


@pytest.fixture
def make(store):
    made = []

    def build(model, kv="bf16"):
        core = build_engine_core(model, CharTokenizer(), tiered_config(kv), fingerprint="test-model",
                                 inject=Injected(calibrate=False, storage=store,
                                                 secret=KVSecret("poisoning-tests-secret-0123456789"),
                                                 tier_kw={"l3_latency_s": 0.0}))
        made.append(core.tiers)
        return core

    yield build
    for tiers in made:
        tiers.close()


def settle(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def flush_l1_l2(eng):
    eng.cache.flush()
    eng.tiers.host.clear()


def warm(eng, prompts):
    """Run each prompt alone (its reference answer) and wait until its pages are in L3."""
    ref = {rid: run_all(eng, [greedy(rid, p, n=8)])[rid][0] for rid, p in prompts.items()}
    assert eng.tiers.drain() and eng.tiers.stats()["l3_written"] >= 3 * len(prompts)
    return ref


def rejected(eng) -> dict:
    return eng.tiers.stats()["rejected_records"]["l3"]


def test_a_record_copied_onto_another_key_is_refused_and_recomputed(bf16_model, make, store):
    eng = make(bf16_model)
    ref = warm(eng, {"a": PROMPT, "b": OTHER})
    ka, kb = eng.tiers.keys("", PROMPT, 4), eng.tiers.keys("", OTHER, 4)
    store.put_batch(list(zip(ka, store.get_batch(kb))))     # b's pages under a's keys
    flush_l1_l2(eng)
    got = run_all(eng, [greedy("a2", PROMPT, n=8)])["a2"]
    assert got[0] == ref["a"]                               # a's answer, not b's
    assert got[3].cached_by_tier["l3"] == 0
    assert rejected(eng) == {"auth": 1, "malformed": 0, "stale": 0, "nonfinite": 0}
    assert eng.tiers.stats()["l3_deleted_rejected"] == 1
    # The recompute wrote a's genuine pages back: the next load is clean and used.
    settle(lambda: all(b is not None for b in store.get_batch(ka)))
    eng.tiers.drain()
    for key, blob in zip(ka, store.get_batch(ka)):
        decode_page(blob, eng.tiers.header(), key=key, secret=eng.tiers.secret)
    flush_l1_l2(eng)
    again = run_all(eng, [greedy("a3", PROMPT, n=8)])["a3"]
    assert again[0] == ref["a"] and again[3].cached_by_tier["l3"] == 64


def test_a_refused_record_is_deleted_from_l3(bf16_model, make, store):
    eng = make(bf16_model)
    warm(eng, {"a": PROMPT, "b": OTHER})
    ka, kb = eng.tiers.keys("", PROMPT, 4), eng.tiers.keys("", OTHER, 4)
    store.put_batch([(ka[0], store.get_batch([kb[0]])[0])])
    flush_l1_l2(eng)
    assert not eng.tiers.prepare("x", "", PROMPT, 0, 4)     # the prefetch starts
    settle(lambda: eng.tiers._prefetch["x"].done)
    eng.tiers.cancel("x")
    assert store.exists_batch(ka) == [False, True, True, True]
    assert ka[0] not in eng.tiers.host


def _forged(eng, version: int) -> bytes:
    """A record made without the secret: zero codes, the tag slot holding plain SHA-256."""
    header = eng.tiers.header()
    head = json.dumps(header.__dict__, separators=(",", ":")).encode()
    body = bytes(eng.pool.layout.page_nbytes)
    return struct.pack("<4sHI", MAGIC, version, len(head)) + head + \
        hashlib.sha256(head + body).digest() + body


@pytest.mark.parametrize("version,reason", [(1, "malformed"), (2, "auth")])
def test_a_forged_record_with_a_recomputed_checksum_is_refused(bf16_model, make, store,
                                                               version, reason):
    eng = make(bf16_model)
    ref = warm(eng, {"a": PROMPT})
    ka = eng.tiers.keys("", PROMPT, 4)
    store.put_batch([(k, _forged(eng, version)) for k in ka])
    flush_l1_l2(eng)
    got = run_all(eng, [greedy("a2", PROMPT, n=8)])["a2"]
    assert got[0] == ref["a"] and got[3].cached_tokens == 0
    assert rejected(eng)[reason] == 1


def _nan_scales(eng) -> bytes:
    """A page whose E4M3 block scales are all NaN (0x7F), signed with the engine's own secret."""
    page = eng.pool.pages[0].clone()
    layer = eng.pool.layout.layer_view(page.unsqueeze(0), 0)
    layer.k_scale.fill_(0x7F)
    return page


@pytest.mark.parametrize("attack", ["random", "nan_scales"])
def test_random_codes_or_nan_scales_never_reach_the_engine(bf16_model, make, store, attack):
    eng = make(bf16_model, kv="nvfp4")
    ref = warm(eng, {"a": PROMPT, "c": THIRD})
    ka = eng.tiers.keys("", PROMPT, 4)
    size = len(store.get_batch(ka[:1])[0])
    if attack == "random":
        g = torch.Generator().manual_seed(7)
        bad = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
               for _ in ka]
    else:
        bad = [encode_page(eng.tiers.header(), _nan_scales(eng), key=k, secret=eng.tiers.secret)
               for k in ka]
    store.put_batch(list(zip(ka, bad)))
    flush_l1_l2(eng)
    reads = eng.tiers.stats()["l3_read"]
    got = run_all(eng, [greedy("a2", PROMPT, n=8),
                        greedy("c2", THIRD, n=8), greedy("t", OTHER, n=8)])
    assert got["a2"][0] == ref["a"] and got["a2"][3].cached_by_tier["l3"] == 0
    assert got["c2"][0] == ref["c"] and got["c2"][3].cached_by_tier["l3"] == 48
    assert all(out[2].value == "length" for out in got.values())
    assert eng.num_request_faults == 0                      # no step ever failed
    assert eng.tiers.stats()["l3_read"] == reads + 3        # c's pages only
    assert rejected(eng)["nonfinite" if attack == "nan_scales" else "malformed"] + \
        rejected(eng)["auth"] == 1


def test_refusals_are_exported_as_a_metric(bf16_model, make, store):
    eng = make(bf16_model)
    warm(eng, {"a": PROMPT, "b": OTHER})
    ka, kb = eng.tiers.keys("", PROMPT, 4), eng.tiers.keys("", OTHER, 4)
    store.put_batch(list(zip(ka, store.get_batch(kb))))
    flush_l1_l2(eng)
    run_all(eng, [greedy("a2", PROMPT, n=4)])
    body, _ = Metrics(stats=eng.stats).render()
    family = next(f for f in text_string_to_metric_families(body.decode())
                  if f.name == "nibble:tier_rejected_records")
    values = {(s.labels["tier"], s.labels["reason"]): s.value for s in family.samples
              if s.name.endswith("_total")}
    assert values[("l3", "auth")] == 1.0 and values[("l3", "nonfinite")] == 0.0
