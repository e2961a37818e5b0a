"""The C residual add + RMSNorm and SiLU-and-mul against their torch references
(``kernels/fused_ref.py``)."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels.cpu import layer_ops
from nibble.kernels.errors import KernelInputError
from nibble.kernels.fused_ref import add_rms_norm_ref, silu_mul_ref

pytestmark = pytest.mark.skipif(not layer_ops.available(), reason="no C compiler here")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place between two bf16 tensors."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_matches_the_reference(rows, with_residual):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 4).to(torch.bfloat16)
    res = torch.randn(rows, 576, generator=g).to(torch.bfloat16) if with_residual else None
    w = torch.randn(576, generator=g).to(torch.bfloat16)
    h, s = layer_ops.add_rms_norm(x, res, w, 1e-5)
    href, sref = add_rms_norm_ref(x, res, w, 1e-5)
    assert h.dtype == s.dtype == torch.bfloat16 and h.shape == (rows, 576)
    assert torch.equal(s, sref)                  # the residual sum rounds exactly as torch's
    if rows:
        assert _ulps(h, href) <= 1               # the mean square summed in another order


def test_fp32_strided_rows_weight_offset():
    g = torch.Generator().manual_seed(7)
    big = torch.randn(3, 200, generator=g)
    x, res = big[:, :96], torch.randn(3, 96, generator=g)        # x rows with stride 200
    w = torch.randn(96, generator=g)
    h, s = layer_ops.add_rms_norm(x, res, w, 1e-6, weight_offset=1.0)
    href, sref = add_rms_norm_ref(x, res, w, 1e-6, weight_offset=1.0)
    torch.testing.assert_close(h, href, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, sref, rtol=0, atol=0)
    # without the offset the result is another one: the offset is applied, not ignored
    assert (layer_ops.add_rms_norm(x, res, w, 1e-6)[0] - href).abs().max() > 0.1


def test_bad_inputs_raise():
    x = torch.randn(2, 32)
    w = torch.ones(32)
    with pytest.raises(KernelInputError, match="float32/bfloat16"):
        layer_ops.add_rms_norm(x.half(), None, w, 1e-6)
    with pytest.raises(KernelInputError, match=r"\[2, 32\]"):
        layer_ops.add_rms_norm(x, torch.randn(3, 32), w, 1e-6)
    with pytest.raises(KernelInputError, match="out_dtype"):
        layer_ops.add_rms_norm(x, None, w, 1e-6, out_dtype=torch.float16)
    with pytest.raises(KernelInputError, match="weight"):
        layer_ops.add_rms_norm(x, None, torch.ones(16), 1e-6)
    with pytest.raises(KernelInputError, match="unit inner stride"):
        layer_ops.add_rms_norm(x.t(), None, torch.ones(2), 1e-6)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32])
def test_bf16_rows_on_a_float32_residual(out_dtype):
    """A float32 model's packed projection hands over bf16 rows: the sum widens them (exactly)
    into the float32 residual, and the normed output comes in the dtype asked for, equal to
    the reference's float32 output rounded once."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 576, generator=g) * 3).to(torch.bfloat16)
    res, w = torch.randn(4, 576, generator=g), torch.randn(576, generator=g)
    h, s = layer_ops.add_rms_norm(x, res, w, 1e-5, out_dtype=out_dtype)
    href32, sref = add_rms_norm_ref(x.float(), res, w, 1e-5)
    assert s.dtype == torch.float32 and torch.equal(s, sref)
    assert h.dtype == (out_dtype or torch.float32)
    torch.testing.assert_close(h.float(), href32.to(h.dtype).float(), rtol=0,
                               atol=0 if h.dtype == torch.bfloat16 else 1e-5)
    href, _ = add_rms_norm_ref(x, res, w, 1e-5, out_dtype=out_dtype)
    assert href.dtype == h.dtype


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("cols", [1536, 37])                 # 37: the scalar tail alone
def test_silu_mul_matches_the_reference(dtype, out_dtype, cols):
    g = torch.Generator().manual_seed(cols)
    gate_up = (torch.randn(3, 2 * cols, generator=g) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])      # 0, saturation both ways
    gate, up = gate_up.chunk(2, dim=-1)                            # halves: row stride 2I
    got = layer_ops.silu_mul(gate, up, out_dtype=out_dtype)
    ref = silu_mul_ref(gate_up, out_dtype=out_dtype)
    assert got.dtype == ref.dtype and got.shape == (3, cols)
    # silu(-90) = -7e-38: torch's exp(90) overflows to -0 there, this one does not
    if got.dtype == torch.bfloat16:          # the fp32 values differ by a few ulps at most
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-30)
        assert (got != ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, ref, rtol=4e-7, atol=1e-30)
    # two separate tensors give the same bytes as the halves of one
    assert torch.equal(layer_ops.silu_mul(gate.contiguous(), up.contiguous(), out_dtype), got)


def test_silu_mul_keeps_nan_and_refuses_bad_inputs():
    gate, up = torch.tensor([[float("nan"), 1.0]]), torch.ones(1, 2)
    out = layer_ops.silu_mul(gate, up)
    assert out[0, 0].isnan() and out[0, 1] == pytest.approx(0.7310586)
    with pytest.raises(KernelInputError, match="share a dtype"):
        layer_ops.silu_mul(gate, up.to(torch.bfloat16))
    with pytest.raises(KernelInputError, match=r"up must be .* of shape \[1, 2\]"):
        layer_ops.silu_mul(gate, torch.ones(1, 3))
    with pytest.raises(KernelInputError, match="float32/bfloat16"):
        layer_ops.silu_mul(gate.half(), up.half())
