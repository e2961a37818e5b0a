"""The C residual add + RMSNorm against its torch reference (``kernels/fused_ref.py``)."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels.cpu import layer_ops
from nibble.kernels.errors import KernelInputError
from nibble.kernels.fused_ref import add_rms_norm_ref

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
    with pytest.raises(KernelInputError, match="bfloat16"):
        layer_ops.add_rms_norm(x, torch.randn(2, 32).to(torch.bfloat16), w, 1e-6)
    with pytest.raises(KernelInputError, match="weight"):
        layer_ops.add_rms_norm(x, None, torch.ones(16), 1e-6)
    with pytest.raises(KernelInputError, match="unit inner stride"):
        layer_ops.add_rms_norm(x.t(), None, torch.ones(2), 1e-6)
