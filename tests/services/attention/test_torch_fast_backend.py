"""The ``torch_fast`` backend (batched CPU decode) against the reference ``torch`` backend.

Both store the same bytes (the fast store is bit-identical) and read the same
dequantized values, so outputs differ only by fp32 summation order: one mixed step
(prefill, extend, ragged decodes) for every registered KV format, sliding windows,
a workspace split into one-layer chunks, and whole engine runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from nibble.kernels import PageLayout, kv_format_names, store_kv_ref
from nibble.services.attention import (AttentionMetadata, FastTorchAttentionBackend,
                                       TorchAttentionBackend)
from nibble.services.attention import torch_fast_backend as tfb
from nibble.services.engine.builder import select_attention_backend
from nibble.tiering import KVPool

from .conftest import make_engine_with, mixed_arrivals, run_scenario, tiny_arch, tiny_model

CACHED = [0, 20, 33, 3, 17, 47]   # prefill, extend, decode, decode, extend, decode
NEW = [5, 7, 1, 1, 16, 1]
HQ, H, D, LAYERS = 6, 2, 32, 3


def pools(kv: str, seed: int = 0) -> tuple[KVPool, KVPool, AttentionMetadata]:
    """Two pools with the same cached prefixes (scattered pages, global scales != 1) and the
    metadata of one mixed step."""
    layout = PageLayout(kv, num_layers=LAYERS, num_kv_heads=H, head_dim=D, page_size=16)
    g = torch.Generator().manual_seed(seed)
    ps, b = layout.page_size, len(CACHED)
    need = [math.ceil((c + n) / ps) for c, n in zip(CACHED, NEW)]
    pool_a, pool_b = KVPool(layout, sum(need) + 3), KVPool(layout, sum(need) + 3)
    scales = torch.tensor([[0.05, 0.02], [0.03, 0.04], [1.0, 0.5]])
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
    for layer in range(LAYERS):
        kc, vc = (torch.randn((len(cached_slots), H, D), generator=g) for _ in range(2))
        store_kv_ref(layout, pool_a.layer(layer), kc, vc, cached_slots, *pool_a.scales(layer))
    pool_b.pages.copy_(pool_a.pages)
    starts = [sum(NEW[:i]) for i in range(b)]
    new_slots = torch.cat([slots(i, c, c + n) for i, (c, n) in enumerate(zip(CACHED, NEW))])
    return pool_a, pool_b, AttentionMetadata(starts, NEW, CACHED, new_slots, tables)


def qkv(seed: int, t: int = sum(NEW)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((t, HQ, D), generator=g), torch.randn((t, H, D), generator=g),
            torch.randn((t, H, D), generator=g))


def compare_step(kv: str, fresh: str = "auto", windows=(), meta_of=lambda m: m):
    pool_a, pool_b, meta = pools(kv)
    meta = meta_of(meta)
    ref = TorchAttentionBackend(pool_a, 0.125, fresh, sliding_windows=windows)
    got = FastTorchAttentionBackend(pool_b, 0.125, fresh, sliding_windows=windows)
    ref.plan(meta)
    got.plan(meta)
    for layer in range(LAYERS):
        q, k, v = qkv(layer, meta.num_tokens)
        want = ref.forward(layer, q, k, v, meta)
        out = got.forward(layer, q, k, v, meta)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(pool_b.pages, pool_a.pages), "the fast store wrote different bytes"
    return got


def only_decode(m: AttentionMetadata) -> AttentionMetadata:
    """The decode sequences of ``m`` alone: a pure decode step (the backend's lean path)."""
    dec = [i for i, n in enumerate(m.new_lens) if n == 1 and m.cached_lens[i]]
    pick = lambda xs: [xs[i] for i in dec]  # noqa: E731
    slots = torch.cat([m.slot_mapping[m.seq_starts[i]:m.seq_starts[i] + 1] for i in dec])
    return AttentionMetadata(list(range(len(dec))), pick(m.new_lens), pick(m.cached_lens),
                             slots, m.block_tables[dec])


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("kv", kv_format_names(experimental=True))
def test_step_matches_reference_for_every_format(kv, pure):
    got = compare_step(kv, meta_of=only_decode if pure else lambda m: m)
    assert got.fast == (kv not in ("nvfp4_khad", "nvfp4_khad46"))


@pytest.mark.parametrize("pure", [False, True])
def test_fp8_fresh_kv(pure):
    compare_step("nvfp4", fresh="fp8_e4m3", meta_of=only_decode if pure else lambda m: m)


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_sliding_windows(kv):
    compare_step(kv, windows=(8, None, 30))
    compare_step(kv, windows=(8, None, 30), meta_of=only_decode)


def test_workspace_in_one_layer_chunks(monkeypatch):
    """A workspace budget below one layer dequantizes layer by layer, same results."""
    monkeypatch.setattr(tfb, "WORKSPACE_BYTES", 1)
    chunks = []
    real = tfb.dequantize_pages
    monkeypatch.setattr(tfb, "dequantize_pages",
                        lambda *a, **kw: chunks.append(a[3]) or real(*a, **kw))
    compare_step("nvfp4")
    assert chunks == [range(i, i + 1) for i in range(LAYERS)]


def test_one_page_dequantize_per_step_when_it_fits(monkeypatch):
    chunks = []
    real = tfb.dequantize_pages
    monkeypatch.setattr(tfb, "dequantize_pages",
                        lambda *a, **kw: chunks.append(a[3]) or real(*a, **kw))
    compare_step("fp8_e4m3")
    assert chunks == [range(0, LAYERS)]


def test_auto_picks_it_on_cpu():
    layout = PageLayout("nvfp4", num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    assert select_attention_backend("auto", layout, torch.device("cpu")) == "torch_fast"
    assert select_attention_backend("auto", layout, torch.device("cpu"), True) == "torch_fast"


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "nvfp4"])
def test_engine_logits_match_reference(kv):
    """Prefill, chunked extend, prefix-cache extend and decode through a real EngineCore."""
    model = tiny_model(tiny_arch("llama", head_dim=32, num_heads=6), torch.float32)
    runs = {}
    for name in ("torch", "torch_fast"):
        eng = make_engine_with(model, name, kv=kv, chunked_prefill_size=16)
        assert eng.runner.backend.name == name
        runs[name] = run_scenario(eng, mixed_arrivals())
    (ref, ref_tok, ref_paths), (got, got_tok, paths) = runs["torch"], runs["torch_fast"]
    assert paths == ref_paths == {"prefill", "extend", "decode", "mixed"}
    assert got_tok == ref_tok
    assert len(got) == len(ref) >= 5
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    assert worst <= 1e-4, f"{kv}: logits differ by {worst:.2e}"


def test_pure_decode_step_takes_the_lean_path(monkeypatch):
    """A pure decode step never enters the reference forward (no prefill/extend loops)."""
    _, pool, meta = pools("nvfp4")
    meta = only_decode(meta)
    got = FastTorchAttentionBackend(pool, 0.125)
    got.plan(meta)
    monkeypatch.setattr(TorchAttentionBackend, "forward",
                        lambda *a, **kw: pytest.fail("reference forward on a pure decode step"))
    q, k, v = qkv(0, meta.num_tokens)
    assert got.forward(0, q, k, v, meta).shape == q.shape
