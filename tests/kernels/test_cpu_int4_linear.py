"""The CPU weight-only 4-bit and 8-bit linear layers against their fp32 reference."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels.cpu.int4_linear import (GROUP, dequant_ref, int4_linear, int8_linear,
                                            linear_ref, pack_int4, pack_int8)


def _q4(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.02 + 1e-3
    offset = -8 * scale + torch.randn(n, k // GROUP, generator=g) * 0.01
    return codes, scale, offset


def _bf16_group_ref(x, codes, scale, offset):
    """The product the kernel is specified to compute: ``(code - 8) * s + z`` with ``s`` and
    ``z = offset + 8 * scale`` rounded to bf16, in fp32."""
    s = scale.to(torch.bfloat16).float()
    z = (offset + 8 * scale).to(torch.bfloat16).float()
    return linear_ref(x, codes.to(torch.int16) - 8, s, z)


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_int4_matches_its_bf16_group_reference(rows):
    codes, scale, offset = _q4(96, 128)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    y = int4_linear(x, pack_int4(codes, scale, offset))
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    ref = _bf16_group_ref(x, codes, scale, offset)
    # only the output's bf16 rounding and the fp32 summation order are left
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


def test_int4_close_to_the_exact_weight():
    codes, scale, offset = _q4(64, 256, seed=1)
    x = torch.randn(4, 256).to(torch.bfloat16)
    y = int4_linear(x, pack_int4(codes, scale, offset)).float()
    exact = linear_ref(x, codes, scale, offset)
    dense = (x.float() @ dequant_ref(codes, scale, offset).to(torch.bfloat16).float().t())
    err, dense_err = (y - exact).norm(), (dense - exact).norm()
    # group parameters rounded to bf16 cost about what rounding every weight to bf16 costs
    assert err <= 4 * dense_err + 1e-6, (err, dense_err)


def test_int4_bias_and_swapped_offset_convention_detected():
    codes, scale, offset = _q4(32, 64, seed=2)
    x = torch.randn(2, 64).to(torch.bfloat16)
    bias = torch.randn(32).to(torch.bfloat16)
    w = pack_int4(codes, scale, offset)
    y = int4_linear(x, w, bias).float()
    torch.testing.assert_close(y, int4_linear(x, w).float() + bias.float(), rtol=2 ** -7,
                               atol=2e-2)
    # a kernel reading the offset as Q4_0's ``(q - 8) * s`` alone would miss by the offsets
    wrong = linear_ref(x, codes.to(torch.int16) - 8, scale, None)
    assert (int4_linear(x, w).float() - wrong).abs().max() > 0.05


def test_int8_planes_match_the_q8_reference():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (80, 192), generator=g, dtype=torch.int16).to(torch.int8)
    scale = torch.rand(80, 192 // GROUP, generator=g) * 0.01 + 1e-4
    w = pack_int8(codes, scale)
    assert w.out_features == 80 and w.in_features == 192
    x = torch.randn(3, 192).to(torch.bfloat16)
    exact = linear_ref(x, codes, scale)
    y = int8_linear(x, w).float()
    torch.testing.assert_close(y, exact, rtol=2 ** -6, atol=2e-2 * exact.abs().max().item())
    # the extreme codes survive the split: -128 and 127 in one row
    codes2 = torch.zeros(16, GROUP, dtype=torch.int8)
    codes2[0, 0], codes2[0, 1] = -128, 127
    one = pack_int8(codes2, torch.ones(16, 1))
    e = torch.zeros(2, GROUP, dtype=torch.bfloat16)
    e[0, 0], e[1, 1] = 1, 1
    assert int8_linear(e, one).float()[:, 0].tolist() == [-128.0, 127.0]


def test_bad_inputs_raise_clear_errors():
    codes, scale, offset = _q4(16, 64)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(codes + 16, scale, offset)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(codes[:, :48], scale, offset)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_int4(codes[:8], scale[:8], offset[:8])
    with pytest.raises(ValueError, match="group parameters"):
        pack_int4(codes, scale[:, :1], offset)
    with pytest.raises(ValueError, match="uint8"):
        pack_int4(codes.to(torch.int32), scale, offset)
    with pytest.raises(ValueError, match="int8"):
        pack_int8(codes, scale)
    w = pack_int4(codes, scale, offset)
    with pytest.raises(ValueError, match="bf16"):
        int4_linear(torch.randn(1, 64), w)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        int4_linear(torch.randn(1, 32).to(torch.bfloat16), w)
