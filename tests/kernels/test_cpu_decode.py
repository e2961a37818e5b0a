"""The C decode layer (kernels/cpu) against its torch reference.

The store's bytes must equal the reference's (bit for bit without a recipe; with one, the
recipe's matmuls sum in another order, so a value on a code boundary may round to the
neighbouring code: compared as dequantized values within one code step of the block's
scale), and the attention output must equal the reference's within fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError, NonFiniteInputError, PageLayout, quantize_nvfp4
from nibble.kernels.cpu import DecodeStep, available, decode_nvfp4_cpu, decode_nvfp4_ref
from nibble.kernels.paged_ref import gather_rows_ref

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler")

L, H, G, D, S, P = 2, 2, 3, 32, 4, 24


def _case(b: int, ctx: list[int], recipe: str, rope: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lay = PageLayout("nvfp4", L, H, D, S)
    pool = lay.allocate(P)
    pool.copy_(torch.randint(0, 256, pool.shape, generator=g, dtype=torch.uint8))
    # E4M3 scale bytes 0x7f/0xff are NaN: keep the random pages finite
    pool[pool == 0x7F] = 0x3F
    pool[pool == 0xFF] = 0xBF
    m = max(ctx) // S + 1
    perm = torch.randperm(P, generator=g)[:b * m]
    page_ids = perm.view(b, m).long().contiguous()
    hi = torch.tensor(ctx, dtype=torch.long)
    lo = torch.tensor([max(0, c - 5) if i % 2 else 0 for i, c in enumerate(ctx)], dtype=torch.long)
    slots = page_ids[torch.arange(b), hi // S] * S + hi % S
    q = torch.randn(b, H * G, D, generator=g)
    qkv = torch.randn(b, (H * G + 2 * H) * D, generator=g) * 3
    q, k, v = (t.unflatten(1, (-1, D)) for t in qkv.split([H * G * D, H * D, H * D], 1))
    rec = None
    if recipe == "map":
        km = torch.eye(D) + 0.1 * torch.randn(H, D, D, generator=g)
        rec = dict(k_map=km, k_bias=torch.randn(H, D, generator=g), q_map=torch.linalg.inv(km).mT
                   .contiguous(), v_shift=torch.randn(H, D, generator=g))
    elif recipe == "shift":
        rec = dict(k_shift=torch.randn(H, D, generator=g))
    rp = None
    if rope:
        ang = torch.rand(b, D // 2, generator=g) * 6
        rp = (torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1))
    return lay, pool, dict(q=q, k=k, v=v, slots=slots, page_ids=page_ids, lo=lo, hi=hi,
                           k_scale=0.37, v_scale=1.3, sm_scale=D ** -0.5, recipe=rec, rope=rp)


@pytest.mark.parametrize("recipe", [None, "shift", "map"])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("b,ctx", [(1, [0]), (1, [9]), (3, [5, 17, 2])])
def test_matches_reference(recipe, rope, b, ctx):
    lay, pool, kw = _case(b, ctx, recipe, rope)
    ref_pool = pool.clone()
    want = decode_nvfp4_ref(lay, ref_pool, 1, **kw)
    got = decode_nvfp4_cpu(lay, pool, 1, **kw)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    if recipe != "map":
        assert torch.equal(pool, ref_pool)
        return
    # with the recipe's matmuls: the same rows dequantize within one E2M1 step of the scale
    pages, ref_pages = lay.layer_view(pool, 1), lay.layer_view(ref_pool, 1)
    rows = (kw["slots"] // S, kw["slots"] % S)
    for a, r in zip(gather_rows_ref(lay, pages, *rows, 0.37, 1.3, torch.float32),
                    gather_rows_ref(lay, ref_pages, *rows, 0.37, 1.3, torch.float32)):
        step = 2 * r.unflatten(-1, (-1, 16)).abs().amax(-1, keepdim=True) / 6
        assert ((a - r).unflatten(-1, (-1, 16)).abs() <= step + 1e-6).all()
    pool[:, 1], ref_pool[:, 1] = 0, 0
    assert torch.equal(pool, ref_pool)                       # nothing else written


@pytest.mark.parametrize("q_gain", [1.0, 300.0])
def test_long_rows_and_far_apart_scores(q_gain):
    """A row of 66 positions (whole vectors and a tail in the softmax), and queries scaled
    until most scores sit more than 87 below their row's max, where the vector exp flushes
    to zero: the output still matches the reference."""
    lay, pool, kw = _case(1, [65], None, True, seed=3)
    kw["q"] = kw["q"] * q_gain
    want = decode_nvfp4_ref(lay, pool.clone(), 1, **kw)
    got = decode_nvfp4_cpu(lay, pool, 1, **kw)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("hi", [14, 15, 16, 31, 47, 80])
def test_rows_at_the_batched_score_groups(hi):
    """The AVX512 scores come 16 positions at a time: rows of 15, 16, 17, 32, 48 and 81
    positions (a group cut short, whole groups, one past) over 4-position pages."""
    lay, pool, kw = _case(1, [hi], "shift", True, seed=hi)
    want = decode_nvfp4_ref(lay, pool.clone(), 1, **kw)
    got = decode_nvfp4_cpu(lay, pool, 1, **kw)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_quantizer_is_bit_identical_on_edge_values():
    """Every E2M1 tie, zeros, -0, subnormal and saturating scales: the C store writes
    ``quantize_nvfp4``'s bytes."""
    from tests.kernels.test_paged_fast import edge_values
    g = torch.Generator().manual_seed(1)
    b = 8
    lay, pool, kw = _case(b, [3] * b, None, False)
    for trial in range(4):
        k = edge_values((b, H, D), g) * (10.0 ** (trial - 2))
        v = edge_values((b, H, D), g)
        kw.update(k=k, v=v)
        decode_nvfp4_cpu(lay, pool, 0, **kw)
        pages = lay.layer_view(pool, 0)
        page, off = kw["slots"] // S, kw["slots"] % S
        for x, gs, data, sc in ((k, 0.37, pages.k_data, pages.k_scale),
                                (v, 1.3, pages.v_data, pages.v_scale)):
            codes, scales = quantize_nvfp4(x, gs)
            assert torch.equal(data[page, :, off], codes)
            assert torch.equal(sc[page, :, off], scales)


def test_non_finite_input_stores_nothing():
    lay, pool, kw = _case(2, [4, 6], "map", False)
    before = pool.clone()
    kw["v"] = kw["v"].clone()
    kw["v"][1, 0, 3] = float("nan")
    with pytest.raises(NonFiniteInputError):
        decode_nvfp4_cpu(lay, pool, 0, **kw)
    assert torch.equal(pool, before)


def test_rejects_bad_arguments():
    lay, pool, kw = _case(2, [4, 6], None, False)
    with pytest.raises(KernelInputError):
        decode_nvfp4_cpu(lay, pool, 0, **{**kw, "q": kw["q"].double()})
    with pytest.raises(KernelInputError):
        decode_nvfp4_cpu(lay, pool, 0, **{**kw, "slots": kw["slots"].int()})
    with pytest.raises(KernelInputError):
        decode_nvfp4_cpu(PageLayout("fp8_e4m3", L, H, D, S), pool, 0, **kw)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.bfloat16)])
def test_layer_qkv_equals_layer_in_either_dtype(rope, in_dtype, out_dtype):
    """``DecodeStep.layer_qkv`` reads one QKV output (q, k, v heads side by side) in float32 or
    bf16 and writes float32 or bf16: the same stored bytes as :meth:`layer` on the widened
    views, and its output rounded once."""
    lay, pool, kw = _case(3, [5, 17, 2], "map", rope)
    qkv = torch.cat([kw[n].flatten(1) for n in "qkv"], 1).to(in_dtype)
    q, k, v = (t.unflatten(1, (-1, D)) for t in qkv.float().split([H * G * D, H * D, H * D], 1))
    steps, outs, pools = [], [], []
    for use_qkv in (False, True):
        p = pool.clone()
        step = DecodeStep(lay, p, kw["slots"], kw["page_ids"], kw["hi"], kw["sm_scale"])
        args = (kw["lo"], kw["k_scale"], kw["v_scale"], step.recipe(kw["recipe"]), kw["rope"])
        outs.append(step.layer_qkv(1, qkv, H * G, *args, out_dtype=out_dtype) if use_qkv
                    else step.layer(1, q, k, v, *args))
        steps.append(step)
        pools.append(p)
    assert torch.equal(pools[0], pools[1])
    assert outs[1].dtype == out_dtype and outs[1].shape == (3, H * G, D)
    assert torch.equal(outs[1], outs[0].to(out_dtype))


def test_layer_qkv_rejects_bad_rows():
    lay, pool, kw = _case(2, [4, 6], None, False)
    step = DecodeStep(lay, pool, kw["slots"], kw["page_ids"], kw["hi"], kw["sm_scale"])
    args = (kw["lo"], kw["k_scale"], kw["v_scale"])
    good = torch.zeros(2, (H * G + 2 * H) * D)
    with pytest.raises(KernelInputError, match="qkv must be"):
        step.layer_qkv(0, good.half(), H * G, *args)
    with pytest.raises(KernelInputError, match="qkv must be"):
        step.layer_qkv(0, good[:, :-1], H * G, *args)
    with pytest.raises(KernelInputError, match="qkv must be"):
        step.layer_qkv(0, good, H * G + 1, *args)
    with pytest.raises(KernelInputError, match="out_dtype"):
        step.layer_qkv(0, good, H * G, *args, out_dtype=torch.float16)
