"""The Triton backend against the torch backend, on CPU through Triton's interpreter.

Both backends read and write the same page bytes (the Triton store is
bit-identical to the reference), so their attention outputs differ only in
summation order: the comparisons are tight for every KV format.
"""

from __future__ import annotations

import math

import pytest
import torch

from nibble.kernels import PageLayout, store_kv_ref
from nibble.services.attention import (AttentionMetadata, TorchAttentionBackend,
                                       TritonAttentionBackend)
from nibble.services.attention import triton_backend as tb
from nibble.tiering import KVPool

from .conftest import make_engine_with, mixed_arrivals, run_scenario, tiny_arch, tiny_model

FORMATS = ("bf16", "fp8_e4m3", "nvfp4")
# Largest |logit| difference allowed through the whole model (logits are O(1);
# 2e-6 was seen for every format). The quantized formats get room for a rounding
# flip in layer 1's stored K/V; a wrong mask, scale or page moves logits by > 0.01.
LOGIT_TOL = {"bf16": 2e-5, "fp8_e4m3": 1e-4, "nvfp4": 1e-4}


@pytest.fixture(scope="module")
def model64():
    """fp32 Qwen3-style tiny model with head_dim 64 (the decode kernel's smallest)."""
    return tiny_model(tiny_arch("qwen3", head_dim=64), torch.float32)


@pytest.mark.parametrize("kv", FORMATS)
def test_engine_logits_match_torch_backend(model64, kv):
    """Prefill, chunked extend, prefix-cache extend and decode through a real EngineCore."""
    runs = {}
    for name in ("torch", "triton"):
        eng = make_engine_with(model64, name, kv=kv, chunked_prefill_size=16)
        runs[name] = run_scenario(eng, mixed_arrivals())
    (ref, ref_tok, ref_paths), (got, got_tok, paths) = runs["torch"], runs["triton"]
    assert paths == ref_paths == {"prefill", "extend", "decode", "mixed"}
    assert got_tok == ref_tok
    assert len(got) == len(ref) >= 5
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    assert worst <= LOGIT_TOL[kv], f"{kv}: logits differ by {worst:.2e}"


# ---------------------------------------------------------------- one mixed step

CACHED = [0, 20, 33, 3, 17]   # prefill, extend, decode, decode, extend
NEW = [5, 7, 1, 1, 16]


def _pools(kv: str, seed: int = 0) -> tuple[KVPool, KVPool, AttentionMetadata]:
    """Two pools with identical cached prefixes and the metadata of one mixed step."""
    layout = PageLayout(kv, num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    g = torch.Generator().manual_seed(seed)
    ps, b = layout.page_size, len(CACHED)
    need = [math.ceil((c + n) / ps) for c, n in zip(CACHED, NEW)]
    pool_a, pool_b = KVPool(layout, sum(need) + 3), KVPool(layout, sum(need) + 3)
    scales = torch.tensor([[0.05, 0.02], [0.03, 0.04]])   # exercise the global scales
    pool_a.set_global_scales(scales)
    pool_b.set_global_scales(scales)
    perm = torch.randperm(pool_a.num_pages, generator=g)[:sum(need)].to(torch.int32)
    tables = torch.zeros((b, max(need)), dtype=torch.int32)
    for i, chunk in enumerate(perm.split(need)):
        tables[i, :len(chunk)] = chunk

    def slots(i, lo, hi):
        p = torch.arange(lo, hi)
        return tables[i, p // ps].long() * ps + p % ps

    cached_slots = torch.cat([slots(i, 0, c) for i, c in enumerate(CACHED)])
    for layer in range(layout.num_layers):
        kc, vc = (torch.randn((len(cached_slots), 2, 64), generator=g) for _ in range(2))
        store_kv_ref(layout, pool_a.layer(layer), kc, vc, cached_slots, *pool_a.scales(layer))
    pool_b.pages.copy_(pool_a.pages)
    starts = [sum(NEW[:i]) for i in range(b)]
    new_slots = torch.cat([slots(i, c, c + n) for i, (c, n) in enumerate(zip(CACHED, NEW))])
    return pool_a, pool_b, AttentionMetadata(starts, NEW, CACHED, new_slots, tables)


def _qkv(seed: int, t: int = sum(NEW)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((t, 4, 64), generator=g), torch.randn((t, 2, 64), generator=g),
            torch.randn((t, 2, 64), generator=g))


@pytest.mark.parametrize("kv,fresh", [(kv, "auto") for kv in FORMATS] + [("nvfp4", "fp8_e4m3")])
def test_mixed_step_matches_torch_and_writes_same_bytes(kv, fresh):
    pool_a, pool_b, meta = _pools(kv)
    ref = TorchAttentionBackend(pool_a, 0.125, fresh)
    got = TritonAttentionBackend(pool_b, 0.125, fresh)
    assert meta.prefill == [0] and meta.extend == [1, 4] and meta.decode == [2, 3]
    ref.plan(meta)
    got.plan(meta)
    for layer in range(2):
        q, k, v = _qkv(layer)
        want = ref.forward(layer, q, k, v, meta)
        out = got.forward(layer, q, k, v, meta)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(pool_b.pages, pool_a.pages), "the Triton store wrote different bytes"


def test_one_launch_per_layer_and_one_shared_workspace(monkeypatch):
    """store, gather and decode launch once per layer; all layers share the plan's workspace."""
    calls = {"store": [], "gather": [], "decode": []}

    def spy(name, fn):
        def wrapped(*args, **kw):
            calls[name].append(kw.get("out"))
            return fn(*args, **kw)
        return wrapped

    for name, attr in (("store", "store_kv"), ("gather", "gather_kv"),
                       ("decode", "decode_attention")):
        monkeypatch.setattr(tb, attr, spy(name, getattr(tb, attr)))
    _, pool, meta = _pools("nvfp4")
    backend = TritonAttentionBackend(pool, 0.125)
    for step in range(2):                      # step 0 learns the compute dtype
        for c in calls.values():
            c.clear()
        backend.plan(meta)
        if step == 1:
            ws = backend._ws
            assert ws is not None, "the workspace is allocated in plan() once the dtype is known"
            # Prefill and extend rows: each prefix, then its fresh chunk.
            rows = CACHED[0] + NEW[0] + CACHED[1] + NEW[1] + CACHED[4] + NEW[4]
            assert ws[0].shape == (rows, 2, 64) and ws[0].dtype == torch.float32
        for layer in range(2):
            backend.forward(layer, *_qkv(layer), meta)
        assert [len(c) for c in calls.values()] == [2, 2, 2]
        ptrs = {o[0].data_ptr() for o in calls["gather"]} | {backend._ws[0].data_ptr()}
        assert len(ptrs) == 1, "every layer gathers into the same workspace"


def test_all_decode_step_writes_output_in_place(monkeypatch):
    """A pure decode batch hands the kernel the whole q and the output (no row gather)."""
    _, pool, _ = _pools("nvfp4")              # global scales != 1: K and V differ
    tables = torch.tensor([[3, 4], [5, 0]], dtype=torch.int32)
    meta = AttentionMetadata([0, 1], [1, 1], [20, 9],
                             torch.tensor([4 * 16 + 4, 5 * 16 + 9]), tables)
    seen = []
    real = tb.decode_attention
    monkeypatch.setattr(tb, "decode_attention",
                        lambda *a, **kw: seen.append(kw.get("out")) or real(*a, **kw))
    backend = TritonAttentionBackend(pool, 0.125)
    backend.plan(meta)
    q, k, v = _qkv(5, t=2)
    out = backend.forward(0, q, k, v, meta)
    assert seen and seen[0] is out
    ref = TorchAttentionBackend(KVPool(pool.layout, pool.num_pages), 0.125)
    ref.pool.pages.copy_(pool.pages)
    ref.pool.set_global_scales(pool.global_scales)
    ref.plan(meta)
    # The reference stores the same tokens again (identical bytes), then attends.
    torch.testing.assert_close(out, ref.forward(0, q, k, v, meta), atol=2e-5, rtol=1e-4)


def test_extend_workspace_is_kept_across_steps():
    """The extend workspace is a view of buffers kept across steps, grown by powers of two:
    a new size every chunk would put a cudaMalloc inside the step."""
    _, pool, meta = _pools("nvfp4")
    backend = TritonAttentionBackend(pool, 0.125)
    backend._compute_dtype = torch.float32
    backend.plan(meta)
    first = backend._ws
    kept = backend._ws_store
    assert kept[0].shape[0] == tb.MIN_WORKSPACE_ROWS
    assert first[0].shape[0] == backend._ragged.num_k
    assert first[0].data_ptr() == kept[0].data_ptr() and first[1].data_ptr() == kept[1].data_ptr()
    backend.plan(meta)
    assert backend._ws[0].data_ptr() == first[0].data_ptr(), "a second step reallocated"
    backend._ragged.num_k = tb.MIN_WORKSPACE_ROWS + 1          # a longer prefix arrives
    grown = backend._alloc_workspace(torch.float32)
    assert grown[0].shape[0] == tb.MIN_WORKSPACE_ROWS + 1
    assert backend._ws_store[0].shape[0] == 2 * tb.MIN_WORKSPACE_ROWS
    backend._ragged.num_k = 2 * tb.MIN_WORKSPACE_ROWS - 5     # still fits: same buffers
    assert backend._alloc_workspace(torch.float32)[0].data_ptr() == grown[0].data_ptr()
    other = backend._alloc_workspace(torch.bfloat16)           # another dtype: new buffers
    assert other[0].dtype == torch.bfloat16 and other[0].data_ptr() != grown[0].data_ptr()
