"""K recipes: "4 or 6" NVFP4 block scaling (nvfp4_k46) and FP8 K + NVFP4 V.

Expected bytes were worked out by hand (E2M1 magnitudes {0, .5, 1, 1.5, 2, 3,
4, 6}; E4M3 byte 0x38 = 1.0, 4/6 rounds to 0.6875 = 0x33). Never regenerate
them by running the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nibble.kernels import (KernelInputError, NonFiniteInputError, PageLayout, dequantize_fp8,
                            dequantize_nvfp4, get_kv_format, gather_rows_ref, quantize_fp8,
                            quantize_nvfp4, store_kv_ref)
from nibble.kernels.recipes import quantize_nvfp4_k46

# (name, 16 inputs, global scale, expected code bytes, expected scale byte)
CASES = [
    # amax 4: amax->4 gives scale 1.0 and every value on the grid (error 0);
    # amax->6 gives 0.6875 and misses 4 and every 0.5. The 4-scale wins.
    ("four_wins", [4] + [.5] * 15, 1.0, [0x16] + [0x11] * 7, 0x38),
    ("four_wins_negative", [-4] + [-.5] * 15, 1.0, [0x9E] + [0x99] * 7, 0x38),
    # The same block times 2 with global scale 2.
    ("four_wins_gs2", [8] + [1] * 15, 2.0, [0x16] + [0x11] * 7, 0x38),
    # amax 6: scale 1.0 is exact; the 4-scale 1.5 turns 0.5 into 0.75. Six wins.
    ("six_wins", [6, .5] + [0] * 14, 1.0, [0x17] + [0x00] * 7, 0x38),
    # Both scales are exact (1.0 and 1.5): the tie keeps the standard scale 1.0.
    ("tie_keeps_six", [6, 3, 3] + [0] * 13, 1.0, [0x57, 0x05] + [0x00] * 6, 0x38),
    ("zeros", [0] * 16, 1.0, [0x00] * 8, 0x00),
]


@pytest.mark.parametrize("name,values,gs,codes,scale", CASES, ids=[c[0] for c in CASES])
def test_k46_hand_cases(name, values, gs, codes, scale):
    c, s = quantize_nvfp4_k46(torch.tensor([values], dtype=torch.float32), gs)
    assert c.tolist() == [codes]
    assert s.tolist() == [[scale]]


def test_k46_differs_from_plain_nvfp4_where_it_should():
    x = torch.tensor([[4] + [.5] * 15], dtype=torch.float32)
    assert quantize_nvfp4(x, 1.0)[1].tolist() == [[0x33]]       # plain: amax -> 6
    assert quantize_nvfp4_k46(x, 1.0)[1].tolist() == [[0x38]]


def test_k46_rejects_bad_input():
    with pytest.raises(KernelInputError):
        quantize_nvfp4_k46(torch.zeros(2, 15), 1.0)
    with pytest.raises(KernelInputError):
        quantize_nvfp4_k46(torch.zeros(2, 16, dtype=torch.int32), 1.0)
    with pytest.raises(NonFiniteInputError):
        quantize_nvfp4_k46(torch.tensor([[float("nan")] * 16]), 1.0)


@st.composite
def blocks(draw):
    vals = draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=32, max_size=32))
    exp = draw(st.integers(-12, 8))
    gs = draw(st.sampled_from([1.0, 0.5, 3.0]))
    return torch.tensor(vals, dtype=torch.float32).reshape(2, 16) * 2.0 ** exp, gs


def _block_sq_err(x, codes, scales, gs):
    deq = dequantize_nvfp4(codes, scales, gs).double()
    return (deq - x.double()).square().reshape(x.shape[0], -1, 16).sum(-1)


@settings(max_examples=150, deadline=None)
@given(blocks())
def test_k46_never_worse_than_nvfp4_per_block(case):
    x, gs = case
    plain, k46 = quantize_nvfp4(x, gs), quantize_nvfp4_k46(x, gs)
    e_plain, e_k46 = _block_sq_err(x, *plain, gs), _block_sq_err(x, *k46, gs)
    assert (e_k46 <= e_plain * (1 + 1e-5) + 1e-30).all()
    # The scale is one of the two candidates, and the standard one when codes equal.
    s4 = (x.abs().reshape(2, -1, 16).amax(-1) / 4 / gs).clamp(max=448).to(
        torch.float8_e4m3fn).view(torch.uint8)
    chosen = k46[1]
    assert ((chosen == plain[1]) | (chosen == s4)).all()


@settings(max_examples=50, deadline=None)
@given(blocks())
def test_k46_round_trip_error_bounded(case):
    # Where the block scale is a normal E4M3 value, every element is off by at
    # most a quarter of the block's amax (half a grid gap, plus scale rounding).
    x, gs = case
    c, s = quantize_nvfp4_k46(x, gs)
    err = (dequantize_nvfp4(c, s, gs) - x).abs().reshape(2, -1, 16)
    amax = x.abs().reshape(2, -1, 16).amax(-1, keepdim=True)
    normal = (amax / 6 / gs >= 2.0 ** -6).expand_as(err)
    assert (err[normal] <= (amax.expand_as(err) / 4)[normal]).all()


def test_k46_lowers_error_on_gaussian_data():
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    mse = [((dequantize_nvfp4(*q(x, 1.0), 1.0) - x) ** 2).mean().item()
           for q in (quantize_nvfp4, quantize_nvfp4_k46)]
    assert mse[1] < 0.9 * mse[0]


def test_formats_registered_with_expected_sizes():
    k46, mixed = get_kv_format("nvfp4_k46"), get_kv_format("fp8k_nvfp4v")
    assert (k46.k.bytes_per_row(64), k46.v.name) == (36, "nvfp4")
    assert (mixed.k.name, mixed.v.name) == ("fp8_e4m3", "nvfp4")
    # SmolLM2: 3 KV heads, D = 64 -> 300 bytes per token-layer against fp8's 384.
    assert mixed.bytes_per_token_per_layer(3, 64) == 300
    geo = (30, 3, 64, 16)
    fp8 = PageLayout("fp8_e4m3", *geo).bytes_per_token
    assert fp8 / PageLayout("fp8k_nvfp4v", *geo).bytes_per_token == pytest.approx(1.28)
    assert fp8 / PageLayout("nvfp4_k46", *geo).bytes_per_token == pytest.approx(384 / 216)


@pytest.mark.parametrize("kv", ["nvfp4_k46", "fp8k_nvfp4v"])
def test_recipe_pages_round_trip(kv):
    g = torch.Generator().manual_seed(1)
    layout = PageLayout(kv, 1, 2, 32, 16)
    pool = layout.allocate(3)
    pages = layout.layer_view(pool, 0)
    k, v = torch.randn(20, 2, 32, generator=g), torch.randn(20, 2, 32, generator=g)
    slots = torch.arange(20) + 16
    store_kv_ref(layout, pages, k, v, slots, 1.0, 1.0)
    kk, vv = gather_rows_ref(layout, pages, slots // 16, slots % 16, 1.0, 1.0, torch.float32)
    if kv == "nvfp4_k46":
        k_ref = dequantize_nvfp4(*quantize_nvfp4_k46(k, 1.0), 1.0)
    else:
        k_ref = dequantize_fp8(quantize_fp8(k, 1.0), 1.0, torch.float32)
    np.testing.assert_array_equal(kk.numpy(), k_ref.numpy())
    v_ref = dequantize_nvfp4(*quantize_nvfp4(v, 1.0), 1.0)
    np.testing.assert_array_equal(vv.numpy(), v_ref.numpy())


def test_hadamard_is_orthonormal_and_exact_for_small_d():
    from nibble.kernels.recipes import hadamard
    h4 = hadamard(4)
    expected = 0.5 * torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1.]])
    assert torch.equal(h4, expected)
    h = hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6)
    with pytest.raises(KernelInputError):
        hadamard(48)


@pytest.mark.parametrize("kv,inner,peak", [("nvfp4_khad", quantize_nvfp4, 39.0),
                                           ("nvfp4_khad46", quantize_nvfp4_k46, 40.0)])
def test_rotated_k_stores_rotated_codes(kv, inner, peak):
    from nibble.kernels.recipes import hadamard
    elem = get_kv_format(kv).k
    # One outlier channel: the rotation spreads it, so the rotated codes differ from plain ones.
    x = torch.zeros(2, 64)
    x[:, 3] = 40.0
    x[1, 10] = -2.0
    codes, scales = elem.quantize(x, 1.0)
    ref_codes, ref_scales = inner(x @ hadamard(64), 1.0)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    # Row 0 is +-5 in every rotated channel. Plain scaling: scale e4m3(5/6) =
    # 0.8125, 5 -> 6 * 0.8125 = 4.875, so 40 comes back as 8 * 4.875 = 39.
    # "4 or 6": scale 1.25, 5 -> 4 * 1.25 exactly, so 40 comes back.
    out = elem.dequantize(codes, scales, 1.0)
    expected = torch.zeros(64)
    expected[3] = peak
    assert torch.allclose(out[0], expected, atol=1e-5)
    assert elem.name not in ("nvfp4",) and get_kv_format(kv).v.name == "nvfp4"
