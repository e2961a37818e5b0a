"""The Triton backend's wiring of the Hopper CUDA decode kernel.

CPU tests check the backend's choice and wiring with the CUDA kernel replaced by a
spy around the Triton one (through Triton's interpreter); nothing is ever compiled.
GPU tests (Hopper only) run a real EngineCore with ``decode_impl == "cuda-sm90"``.
The selection rules themselves are in ``test_decode_select.py``.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from nibble.kernels import PageLayout, store_kv_ref
from nibble.kernels import cuda as kcuda
from nibble.services.attention import (AttentionMetadata, TorchAttentionBackend,
                                       TritonAttentionBackend)
from nibble.services.attention import decode_select as ds
from nibble.services.attention import triton_backend as tb
from nibble.services.errors import ConfigError
from nibble.tiering import KVPool

from .conftest import greedy, kv_layout as layout, make_engine_with, prompt, run_scenario
from .conftest import tiny_arch, tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")   # no CUDA needed to name a device
IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not IS_HOPPER, reason="needs an sm_90 GPU")


def fake_backend(lay, **kw):
    """The constructor only reads the pool's layout and device."""
    return TritonAttentionBackend(SimpleNamespace(layout=lay, device=CUDA), 0.1, **kw)


def test_constructor_decides_once_and_logs(fake_cap, no_compile, monkeypatch, caplog):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or (9, 0))
    with caplog.at_level(logging.INFO, logger=tb.__name__):
        backend = fake_backend(layout())
    assert backend.decode_impl == "cuda-sm90" and len(asked) == 1
    assert backend.store_impl == "triton"           # the CUDA store is opt-in
    assert backend._decode_fn.func is tb.decode_attention_cuda
    assert backend._decode_fn.keywords == {"variant": kcuda.DEFAULT_VARIANT}
    assert "decode kernel: cuda-sm90" in caplog.text
    fake_cap((8, 0))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=tb.__name__):
        backend = fake_backend(layout())
    assert backend.decode_impl == "triton" and backend._decode_fn is tb.decode_attention
    assert "decode kernel: triton" in caplog.text and "8.0" in caplog.text


def test_env_override(fake_cap, no_compile, monkeypatch):
    monkeypatch.setenv(ds.ENV_VAR, "triton")
    assert fake_backend(layout()).decode_impl == "triton"
    monkeypatch.setenv(ds.ENV_VAR, " CUDA ")
    assert fake_backend(layout()).decode_impl == "cuda-sm90"
    with pytest.raises(ConfigError, match=r"NIBBLE_DECODE_KERNEL=cuda: .*head_dim 128"):
        fake_backend(layout(head_dim=64))
    with pytest.raises(ConfigError, match=r"NIBBLE_DECODE_KERNEL=cuda: .*query heads"):
        fake_backend(layout(), num_q_heads=18)
    fake_cap((8, 0))
    with pytest.raises(ConfigError, match=r"NIBBLE_DECODE_KERNEL=cuda: .*9\.0"):
        fake_backend(layout())
    monkeypatch.setenv(ds.ENV_VAR, "flash")
    with pytest.raises(ConfigError, match="auto"):
        fake_backend(layout())
    monkeypatch.setenv(ds.ENV_VAR, "auto")
    assert fake_backend(layout(), num_q_heads=32).decode_impl == "triton"


# ---------------------------------------------------------------- one decode step

def decode_step(device, cached=(20, 9, 33), prefill=0, kv_heads=2, head_dim=64,
                page_size=16, seed=0):
    """Two pools with identical random NVFP4 prefixes and one step's metadata.

    Every sequence decodes one token after ``cached[i]`` tokens; with
    ``prefill > 0`` a sequence prefilling that many tokens comes first (so the
    decode rows are gathered from the token stream).
    """
    lay = PageLayout("nvfp4", 2, kv_heads, head_dim, page_size)
    cached = ([0] if prefill else []) + list(cached)
    new = ([prefill] if prefill else []) + [1] * (len(cached) - bool(prefill))
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil((c + n) / page_size) for c, n in zip(cached, new)]
    src = KVPool(lay, sum(need) + 2)
    src.set_global_scales(torch.tensor([[0.05, 0.02], [0.03, 0.04]]))
    perm = torch.randperm(src.num_pages, generator=g)[:sum(need)].to(torch.int32)
    tables = torch.zeros((len(cached), max(need)), dtype=torch.int32)
    for i, chunk in enumerate(perm.split(need)):
        tables[i, :len(chunk)] = chunk

    def slots(i, lo, hi):
        p = torch.arange(lo, hi)
        return tables[i, p // page_size].long() * page_size + p % page_size

    old = torch.cat([slots(i, 0, c) for i, c in enumerate(cached)])
    for layer in range(2):
        k, v = (torch.randn((len(old), kv_heads, head_dim), generator=g) for _ in range(2))
        store_kv_ref(lay, src.layer(layer), k, v, old, *src.scales(layer))
    pools = []
    for _ in range(2):
        pool = KVPool(lay, src.num_pages, device)
        pool.set_global_scales(src.global_scales)
        pool.pages.copy_(src.pages)
        pools.append(pool)
    starts = [sum(new[:i]) for i in range(len(new))]
    fresh = torch.cat([slots(i, c, c + n) for i, (c, n) in enumerate(zip(cached, new))])
    return pools[0], pools[1], AttentionMetadata(starts, new, cached, fresh, tables)


def qkv(meta, q_heads, kv_heads, head_dim, device, seed):
    g = torch.Generator().manual_seed(seed)
    t = meta.num_tokens
    return tuple(torch.randn((t, h, head_dim), generator=g).to(device)
                 for h in (q_heads, kv_heads, kv_heads))


def check_step(ref_pool, pool, meta, backend, q_heads, atol, rtol, rel=None):
    """Both layers of one step through ``backend`` against the torch backend.

    ``rel``: also bound each token's relative error (norm over ``[Hq, D]``);
    long contexts average to small outputs, where ``atol`` alone says little.
    """
    ref = TorchAttentionBackend(ref_pool, 0.125)
    ref.plan(meta)
    backend.plan(meta)
    lay = pool.layout
    for layer in range(2):
        q, k, v = qkv(meta, q_heads, lay.num_kv_heads, lay.head_dim, pool.device, layer)
        want = ref.forward(layer, q, k, v, meta)
        got = backend.forward(layer, q, k, v, meta)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        if rel is not None:
            err = (got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
            print(f"layer {layer}: relative error per token {err.cpu().numpy().round(5)}")
            assert float(err.max()) < rel, f"layer {layer}: relative errors {err.tolist()}"
    assert torch.equal(pool.pages, ref_pool.pages)


@pytest.fixture
def spy_cuda(monkeypatch, no_compile):
    """Stand-ins for the CUDA kernel and its split count; both record their calls."""
    calls = {"decode": [], "splits": []}
    real = tb.decode_attention

    def decode(*args, variant, **kw):
        calls["decode"].append(dict(kw, variant=variant))
        return real(*args, **kw)

    def splits(*args, **kw):
        calls["splits"].append(args)
        return 3
    monkeypatch.setattr(tb, "decode_attention_cuda", decode)
    monkeypatch.setattr(tb, "cuda_num_splits", splits)
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    return calls


def force_choice(monkeypatch, forced=False):
    choice = ds.DecodeChoice(ds.CUDA_SM90, "test", forced)
    monkeypatch.setattr(tb, "select_decode_impl", lambda *a: choice)


@pytest.mark.parametrize("prefill", [0, 5])
def test_cuda_impl_is_launched_with_plan_splits(monkeypatch, spy_cuda, prefill):
    """One CUDA-kernel launch per layer, the plan's split count, ``out`` written in place."""
    force_choice(monkeypatch)
    ref_pool, pool, meta = decode_step(CPU, prefill=prefill)
    backend = TritonAttentionBackend(pool, 0.125)
    assert backend.decode_impl == "cuda-sm90"
    check_step(ref_pool, pool, meta, backend, 4, 2e-5, 1e-4)
    assert spy_cuda["splits"] == [(3, 2, 34, CPU)]                # batch, H, max len, device
    assert [kw["num_splits"] for kw in spy_cuda["decode"]] == [3, 3]
    assert {kw["variant"] for kw in spy_cuda["decode"]} == {kcuda.DEFAULT_VARIANT}
    assert all((kw.get("out") is not None) == (prefill == 0) for kw in spy_cuda["decode"])


@pytest.mark.parametrize("forced", [False, True])
def test_group_over_8_falls_back_at_first_decode(monkeypatch, spy_cuda, caplog, forced):
    """Without num_q_heads the group is checked at the first decode (16 here)."""
    force_choice(monkeypatch, forced)
    ref_pool, pool, meta = decode_step(CPU, kv_heads=1)
    backend = TritonAttentionBackend(pool, 0.125)
    if forced:
        backend.plan(meta)
        with pytest.raises(ConfigError, match="NIBBLE_DECODE_KERNEL=cuda: .*16 query"):
            backend.forward(0, *qkv(meta, 16, 1, 64, CPU, 0), meta)
        return
    with caplog.at_level(logging.WARNING, logger=tb.__name__):
        check_step(ref_pool, pool, meta, backend, 16, 2e-5, 1e-4)
    assert backend.decode_impl == "triton" and not spy_cuda["decode"]
    assert "triton instead of cuda-sm90" in caplog.text


# ---------------------------------------------------------------- GPU (Hopper)

@pytest.fixture(scope="module")
def gqa8_model():
    """bf16 Qwen3-style tiny model: head_dim 128, 16 query heads on 2 KV heads (group 8)."""
    model = tiny_model(tiny_arch("qwen3", head_dim=128, num_heads=16, num_kv_heads=2),
                       torch.bfloat16)
    return model.to("cuda")


def count_launches(monkeypatch):
    counts = {"cuda": 0, "triton": 0}
    for name, attr in (("cuda", "decode_attention_cuda"), ("triton", "decode_attention")):
        def wrapped(*a, _fn=getattr(tb, attr), _name=name, **kw):
            counts[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(tb, attr, wrapped)
    return counts


def engine(model, impl, monkeypatch, **kw):
    monkeypatch.setenv(ds.ENV_VAR, {"cuda-sm90": "cuda", "triton": "triton"}[impl])
    eng = make_engine_with(model, "triton", kv="nvfp4", device="cuda", **kw)
    assert eng.runner.backend.decode_impl == impl
    return eng


def within_tolerance(got, ref, what):
    """The GPU test's NVFP4 bound (0.08 relative logit norm) until the first other token."""
    agree, worst = 0, 0.0
    for g, r in zip(got, ref):
        worst = max(worst, float((g - r).norm() / r.norm()))
        assert worst < 0.08, f"{what}: step {agree} logits differ by {worst:.3f} (relative norm)"
        if not torch.equal(g.argmax(-1), r.argmax(-1)):
            break
        agree += 1
    print(f"{what}: {agree}/{len(ref)} steps agree, worst relative logit error {worst:.4f}, "
          f"first flip: {first_flip(got, ref)}")
    return agree


def arrivals():
    """Mixed steps; the 300-token prompt makes the CUDA kernel split (2 CTAs per head)."""
    return {0: [greedy("a", prompt(21), 12)],
            1: [greedy("b", prompt(300, 1), 10)],
            3: [greedy("c", prompt(21), 6)]}


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("prefill", [0, 7])
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_one_step_matches_torch(monkeypatch, prefill, page_size):
    """Layer level, identical pages: lengths 2 to 4001, one split to many, direct and gathered."""
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    ref_pool, pool, meta = decode_step(CUDA, cached=(1, 20, 700, 33, 4000), prefill=prefill,
                                       head_dim=128, page_size=page_size)
    backend = TritonAttentionBackend(pool, 0.125)
    assert backend.decode_impl == "cuda-sm90"
    # fp32 q and P through fp16 MMAs: about 1e-3 relative against the fp32 reference.
    check_step(ref_pool, pool, meta, backend, 8, 2e-3, 1e-2, rel=1e-2)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("kv", ["nvfp4", "fp8_e4m3"])
def test_gpu_engine_logits_match_torch(gqa8_model, monkeypatch, kv):
    counts = count_launches(monkeypatch)
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    eng = make_engine_with(gqa8_model, "triton", kv=kv, device="cuda", chunked_prefill_size=64)
    assert eng.runner.backend.decode_impl == "cuda-sm90"     # chosen without the override
    got, _, paths = run_scenario(eng, arrivals())
    assert paths == {"prefill", "extend", "decode", "mixed"}
    assert counts["cuda"] > 0 and counts["triton"] == 0
    ref, _, _ = run_scenario(make_engine_with(gqa8_model, "torch", kv=kv, device="cuda",
                                              chunked_prefill_size=64), arrivals())
    assert len(got) == len(ref)
    assert within_tolerance(got, ref, f"cuda-sm90 vs torch, {kv}") >= 3


def first_flip(got, ref) -> str:
    """Where two runs' greedy choices first differ, with the reference's top-2 margin there."""
    for step, (g, r) in enumerate(zip(got, ref)):
        rows = (g.argmax(-1) != r.argmax(-1)).nonzero().flatten()
        if len(rows):
            top = r[rows].topk(2, dim=-1).values
            return (f"step {step}: top-2 margin {float((top[:, 0] - top[:, 1]).min()):.4f}, "
                    f"max |logit difference| {float((g - r)[rows].abs().max()):.4f}")
    return "none"


@pytest.mark.gpu
@hopper_only
def test_gpu_greedy_equals_triton_decode(gqa8_model, monkeypatch):
    """A short run: the same greedy tokens as the portable Triton decode.

    Both read the same page bytes and differ by ~3e-4 relative per attention
    output (summation order, fp16 MMA operands); that can move a decoded token's
    K/V in the next layer to another E2M1 code, so over long runs a near-tie
    may flip at a near-tie: over :func:`arrivals` request c's 4th token does (top-2
    margin 0.002; Triton and torch flip at the same place, margin 0.011).
    """
    arr = {0: [greedy("a", prompt(21), 8)], 1: [greedy("b", prompt(300, 1), 8)],
           3: [greedy("c", prompt(21), 3)]}
    runs = {}
    for impl in ("cuda-sm90", "triton"):
        runs[impl] = run_scenario(engine(gqa8_model, impl, monkeypatch, chunked_prefill_size=64),
                                  arr)
    (got, got_tok, paths), (ref, ref_tok, _) = runs["cuda-sm90"], runs["triton"]
    assert paths == {"prefill", "extend", "decode", "mixed"}
    worst = max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref))
    print(f"cuda-sm90 vs triton decode: {len(ref)} steps, worst relative logit error "
          f"{worst:.4f}, first flip: {first_flip(got, ref)}")
    assert got_tok == ref_tok, f"first flip: {first_flip(got, ref)}"
    assert worst < 0.03, f"logits differ by {worst:.3f} (relative norm)"


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_multi_step_decode_of_uneven_batch(gqa8_model, monkeypatch, page_size):
    """Five sequences of 1 to 400 prompt tokens decode together; one joins late.

    Against the Triton decode kernel, so that prefill and extend run the same ragged
    attention in both: the torch backend's per-sequence SDPA prefill differs in summation
    order and flips this batch's first token at a top-2 margin of 0.008."""
    counts = count_launches(monkeypatch)
    lens = (1, 17, 64, 129, 400)
    arr = {0: [greedy(f"s{n}", prompt(n, i), 24) for i, n in enumerate(lens)],
           9: [greedy("late", prompt(50, 9), 8)]}
    kw = dict(num_pages=4096 // page_size, page_size=page_size, chunked_prefill_size=1024,
              max_prefill_tokens=4096)
    got, tokens, paths = run_scenario(engine(gqa8_model, "cuda-sm90", monkeypatch, **kw), arr)
    assert "decode" in paths and counts["cuda"] > 0 and counts["triton"] == 0
    assert {r: len(t) for r, t in tokens.items()} == {**{f"s{n}": 24 for n in lens}, "late": 8}
    assert all(bool(torch.isfinite(g).all()) for g in got)
    ref, _, _ = run_scenario(engine(gqa8_model, "triton", monkeypatch, **kw), arr)
    assert within_tolerance(got, ref, f"uneven batch, page {page_size}") >= 3
