"""Torch paged-KV references: store/gather round trip, exact slot placement, attention.

Geometry: L = 2 layers, H = 2 KV heads, D = 32, S = 4 tokens per page. Hand-computed
per-layer sections (offset, row bytes) used to place bytes independently of
``layer_view``:

* nvfp4: K data (0, 16), V data (128, 16), K scales (256, 2), V scales (272, 2); 288 per layer
* fp8_e4m3: K data (0, 32), V data (256, 32); 512 per layer
* bf16: K data (0, 64), V data (512, 64); 1024 per layer
"""

from __future__ import annotations

import math

import pytest
import torch

from nibble.kernels import (KernelInputError, KVCacheFormat, NonFiniteInputError, PageLayout,
                            attention_ref, decode_attention_ref, formats, gather_kv_ref,
                            store_kv_ref)
from nibble.kernels.formats import FP8_E4M3, NVFP4

L, H, D, S = 2, 2, 32, 4
KS, VS = 0.7, 1.9
SECTIONS = {
    "nvfp4": ({"k": (0, 16), "v": (128, 16)}, {"k": (256, 2), "v": (272, 2)}, 288),
    "fp8_e4m3": ({"k": (0, 32), "v": (256, 32)}, {}, 512),
    "bf16": ({"k": (0, 64), "v": (512, 64)}, {}, 1024),
}
FORMATS = list(SECTIONS)


@pytest.fixture
def mixed_format(monkeypatch):
    """A K-fp8 / V-nvfp4 format in a test-local copy of the registry."""
    monkeypatch.setattr(formats, "KV_CACHE_FORMATS", dict(formats.KV_CACHE_FORMATS))
    formats.register_kv_format(KVCacheFormat("test_paged_mixed", FP8_E4M3, NVFP4))
    return "test_paged_mixed"


def _kv(t: int, seed: int, h: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, D, generator=g) * 3, torch.randn(t, h, D, generator=g))


def _expected(elem, x: torch.Tensor, scale: float) -> torch.Tensor:
    data, scales = elem.quantize(x, scale)
    return elem.dequantize(data, scales, scale, torch.float32)


def _slots(table: list[int], n: int) -> list[int]:
    return [table[i // S] * S + i % S for i in range(n)]


@pytest.mark.parametrize("fmt", FORMATS + ["mixed"])
def test_store_gather_round_trip(fmt, request):
    if fmt == "mixed":
        fmt = request.getfixturevalue("mixed_format")
    lay = PageLayout(fmt, L, H, D, S)
    pool = lay.allocate(7)
    pages = lay.layer_view(pool, 1)
    tables, lens = [[4, 1, 5], [0, 6, 3]], [10, 5]
    k, v = _kv(sum(lens), seed=1)
    if fmt == "bf16":
        k, v = k.bfloat16(), v.bfloat16()
    slots = torch.tensor(_slots(tables[0], 10) + _slots(tables[1], 5))
    store_kv_ref(lay, pages, k, v, slots, KS, VS)
    gk, gv = gather_kv_ref(lay, pages, torch.tensor(tables, dtype=torch.int32),
                           torch.tensor(lens), KS, VS, torch.float32)
    assert gk.shape == gv.shape == (15, H, D) and gk.dtype == torch.float32
    if fmt == "bf16":
        assert torch.equal(gk, k.float()) and torch.equal(gv, v.float())
    else:
        assert torch.equal(gk, _expected(lay.fmt.k, k, KS))
        assert torch.equal(gv, _expected(lay.fmt.v, v, VS))
        assert not torch.equal(gk, k)   # it really was quantized
    assert not pool[:, 0].any()         # layer 0 untouched
    # shorter prefixes and another workspace dtype
    hk, _ = gather_kv_ref(lay, pages, torch.tensor(tables, dtype=torch.int32),
                          torch.tensor([3, 0]), KS, VS, torch.bfloat16)
    assert hk.dtype == torch.bfloat16 and torch.equal(hk, gk[:3].bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer", [0, 1])
def test_exact_slot_placement(fmt, layer):
    lay = PageLayout(fmt, L, H, D, S)
    data_secs, scale_secs, layer_nbytes = SECTIONS[fmt]
    assert lay.layer_nbytes == layer_nbytes
    pool = torch.randint(0, 256, (4, L, layer_nbytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    before = pool.clone()
    k, v = _kv(4, seed=2)
    slots = [5, 0, 13, 7]                  # (page, offset) = (1,1) (0,0) (3,1) (1,3)
    store_kv_ref(lay, lay.layer_view(pool, layer), k, v,
                 torch.tensor(slots, dtype=torch.int32), KS, VS)
    expected = before.clone().view(-1)
    for name, x, scale in (("k", k, KS), ("v", v, VS)):
        elem = getattr(lay.fmt, name)
        data, scales = elem.quantize(x, scale)
        for secs, payload in ((data_secs, data), (scale_secs, scales)):
            if name not in secs:
                continue
            off, row = secs[name]
            for t, slot in enumerate(slots):
                for h in range(H):
                    start = ((slot // S) * L + layer) * layer_nbytes + off + (h * S + slot % S) * row
                    expected[start:start + row] = payload[t, h]
    assert torch.equal(pool.view(-1), expected)
    changed = (pool != before).sum().item()
    assert 0 < changed <= 4 * H * (lay.fmt.k.bytes_per_row(D) + lay.fmt.v.bytes_per_row(D))


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_attention_equals_attention_on_dequantized(fmt):
    lay = PageLayout(fmt, L, H, D, S)
    pool = lay.allocate(8)
    pages = lay.layer_view(pool, 0)
    tables, lens = [[2, 7, 0], [5, 0, 0], [1, 3, 6]], [6, 1, 9]
    k, v = _kv(sum(lens), seed=3)
    slots = sum((_slots(t, n) for t, n in zip(tables, lens)), [])
    store_kv_ref(lay, pages, k, v, torch.tensor(slots), KS, VS)
    q = torch.randn(3, 4 * H, D, generator=torch.Generator().manual_seed(4))
    sm = 1 / math.sqrt(D)
    out = decode_attention_ref(lay, pages, q, torch.tensor(tables, dtype=torch.int32),
                               torch.tensor(lens), sm, KS, VS)
    assert out.shape == (3, 4 * H, D) and out.dtype == torch.float32
    kd, vd = _expected(lay.fmt.k, k, KS), _expected(lay.fmt.v, v, VS)
    start = 0
    for b, n in enumerate(lens):
        ref = attention_ref(q[b:b + 1], kd[start:start + n], vd[start:start + n], sm, None)
        torch.testing.assert_close(out[b:b + 1], ref, rtol=0, atol=0)
        torch.testing.assert_close(out[b:b + 1], _loop_attention(
            q[b:b + 1], kd[start:start + n], vd[start:start + n], sm, None), rtol=1e-5, atol=1e-5)
        start += n
    if fmt == "bf16":  # sanity: the quantized cache differs from the true K/V only by bf16 rounding
        torch.testing.assert_close(kd, k, rtol=1e-2, atol=1e-2)


def _loop_attention(q, k, v, sm, offset):
    """Explicit per-query-head loop in float64: head i reads KV head i // (Hq // H)."""
    tq, hq, _ = q.shape
    tk, h, _ = k.shape
    out = torch.empty(tq, hq, q.shape[-1], dtype=torch.float64)
    for i in range(hq):
        kv = i // (hq // h)
        scores = (q[:, i].double() @ k[:, kv].double().T) * sm            # [Tq, Tk]
        if offset is not None:
            for qi in range(tq):
                for kj in range(tk):
                    if kj > qi + offset:
                        scores[qi, kj] = -math.inf
        out[:, i] = torch.softmax(scores, dim=-1) @ v[:, kv].double()
    return out.float()


@pytest.mark.parametrize("hq,h", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("offset", [None, 0, 2, 4])
def test_attention_ref_gqa_and_causal_offsets(hq, h, offset):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, hq, D, generator=g)
    k, v = torch.randn(5, h, D, generator=g), torch.randn(5, h, D, generator=g)
    out = attention_ref(q, k, v, 0.3, offset)
    assert out.shape == (3, hq, D) and out.dtype == torch.float32
    torch.testing.assert_close(out, _loop_attention(q, k, v, 0.3, offset), rtol=1e-5, atol=1e-5)


def test_causal_offset_semantics():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 4, D, generator=g)
    k, v = torch.randn(5, 2, D, generator=g), torch.randn(5, 2, D, generator=g)
    # offset 0: query 0 sees key 0 only, so its output is exactly v[0] of its KV head
    out0 = attention_ref(q, k, v, 0.5, 0)
    assert torch.equal(out0[0], v[0, [0, 0, 1, 1]])
    # offset Tk - Tq: query i sees keys 0..i+2; the last query sees everything
    out = attention_ref(q, k, v, 0.5, 2)
    torch.testing.assert_close(out[2], attention_ref(q[2:], k, v, 0.5, None)[0],
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0], attention_ref(q[:1], k[:3], v[:3], 0.5, None)[0],
                               rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[0], attention_ref(q[:1], k, v, 0.5, None)[0])


def _store_args(lay, pool, t=2, h=H, d=D):
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g)
    return lay.layer_view(pool, 0), k, v


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_errors(fmt):
    lay = PageLayout(fmt, L, H, D, S)
    pool = lay.allocate(3)
    pages, k, v = _store_args(lay, pool)
    for slots in ([0, 12], [-1, 0], [0, 1, 2], [[0, 1]]):
        with pytest.raises(KernelInputError, match="slot_mapping"):
            store_kv_ref(lay, pages, k, v, torch.tensor(slots), KS, VS)
    with pytest.raises(KernelInputError, match="int32/int64"):
        store_kv_ref(lay, pages, k, v, torch.tensor([0.0, 1.0]), KS, VS)
    ok = torch.tensor([0, 11])
    for kk, vv in ((_store_args(lay, pool, h=H + 1)[1], _store_args(lay, pool, h=H + 1)[2]),
                   (_store_args(lay, pool, d=2 * D)[1], _store_args(lay, pool, d=2 * D)[2]),
                   (k, v[:, :1]), (k[0], v[0])):
        with pytest.raises(KernelInputError, match="k/v must be"):
            store_kv_ref(lay, pages, kk, vv, ok, KS, VS)
    bad_v = v.clone()
    bad_v[1, 0, 3] = float("nan")
    with pytest.raises(NonFiniteInputError):
        store_kv_ref(lay, pages, k, bad_v, ok, KS, VS)
    assert not pool.any()   # nothing stored by any rejected call
    store_kv_ref(lay, pages, k, v, ok, KS, VS)   # the same call with good input works
    assert pool.any()


def test_gather_and_decode_errors():
    lay = PageLayout("nvfp4", L, H, D, S)
    pages = lay.layer_view(lay.allocate(3), 0)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="longer than its block table"):
        gather_kv_ref(lay, pages, table, torch.tensor([9]), KS, VS, torch.float32)
    with pytest.raises(KernelInputError, match=r"\[B, M\]"):
        gather_kv_ref(lay, pages, table[0], torch.tensor([1]), KS, VS, torch.float32)
    with pytest.raises(KernelInputError, match=r"\[B, M\]"):
        gather_kv_ref(lay, pages, table, torch.tensor([1, 1]), KS, VS, torch.float32)
    empty = gather_kv_ref(lay, pages, torch.zeros(0, 2, dtype=torch.int32),
                          torch.zeros(0, dtype=torch.int64), KS, VS, torch.float32)
    assert empty[0].shape == empty[1].shape == (0, H, D)
    with pytest.raises(KernelInputError, match="not a multiple"):
        attention_ref(torch.zeros(1, 3, D), torch.zeros(2, 2, D), torch.zeros(2, 2, D), 1.0, None)
    with pytest.raises(KernelInputError, match="q must be"):
        decode_attention_ref(lay, pages, torch.zeros(2, 4, D), table, torch.tensor([1]),
                             1.0, KS, VS)
