"""Fused residual-add + RMSNorm and SiLU-and-mul against their torch references."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError
from nibble.kernels.fused_ref import add_rms_norm_ref, silu_mul_ref
from nibble.kernels.triton.layer_ops import add_rms_norm, silu_mul

HAS_CUDA = torch.cuda.is_available()
CPU = pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA,
                                                  reason="interpreter only without CUDA"))
GPU = pytest.param("cuda", marks=pytest.mark.gpu)
# Relative tolerance per output dtype: one rounding of the result (bf16 has 8 bits).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def _shapes(device):
    # Real shapes on the GPU (Qwen3-8B: hidden 4096, MLP 12288), small ones interpreted.
    return [(16, 4096), (3, 5120)] if device == "cuda" else [(3, 96), (1, 64)]


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(device, dtype, with_residual):
    gen = torch.Generator().manual_seed(7)
    for t, n in _shapes(device):
        x = (torch.randn(t, n, generator=gen) * 3).to(dtype)
        r = (torch.randn(t, n, generator=gen) * 5).to(dtype) if with_residual else None
        w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
        ref, ref_s = add_rms_norm_ref(x, r, w, 1e-6)
        args = [a.to(device) if a is not None else None for a in (x, r, w)]
        out, s = add_rms_norm(*args, 1e-6)
        assert out.dtype == dtype and s.dtype == dtype and out.shape == (t, n)
        assert _rel(out, ref) < TOL[dtype]
        assert _rel(s, ref_s) < TOL[dtype]
        if not with_residual:
            assert s is args[0]


@pytest.mark.parametrize("device", [CPU, GPU])
def test_add_rms_norm_gemma_offset(device):
    gen = torch.Generator().manual_seed(8)
    x, r = torch.randn(2, 80, generator=gen), torch.randn(2, 80, generator=gen)
    w = torch.randn(80, generator=gen) * 0.1
    ref, _ = add_rms_norm_ref(x, r, w, 1e-6, weight_offset=1.0)
    out, _ = add_rms_norm(x.to(device), r.to(device), w.to(device), 1e-6, weight_offset=1.0)
    assert _rel(out, ref) < 1e-5


def test_add_rms_norm_reference_matches_model_norm():
    """The reference is the model's unfused path (fp32: no intermediate rounding)."""
    from nibble.services.models.llama import rms_norm
    gen = torch.Generator().manual_seed(9)
    x, r, w = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen), torch.rand(64)
    out, s = add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(out, rms_norm(x + r, w, 1e-5))


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_matches_reference(device, dtype):
    gen = torch.Generator().manual_seed(10)
    shapes = [(16, 2 * 12288), (5, 2 * 1000)] if device == "cuda" else [(3, 2 * 40), (2, 2 * 1100)]
    for t, two_i in shapes:
        x = (torch.randn(t, two_i, generator=gen) * 4).to(dtype)
        ref = silu_mul_ref(x)
        out = silu_mul(x.to(device))
        assert out.shape == (t, two_i // 2) and out.dtype == dtype
        assert _rel(out, ref) < TOL[dtype]


def test_silu_mul_reference_is_swiglu():
    x = torch.randn(3, 16)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul_ref(x), torch.nn.functional.silu(gate) * up)


def test_checks():
    x = torch.randn(2, 8)
    with pytest.raises(KernelInputError, match="residual must be"):
        add_rms_norm(x, torch.randn(2, 9), torch.ones(8), 1e-6)
    with pytest.raises(KernelInputError, match="weight must be"):
        add_rms_norm(x, None, torch.ones(9), 1e-6)
    with pytest.raises(KernelInputError, match="2-D"):
        add_rms_norm(x[None], None, torch.ones(8), 1e-6)
    with pytest.raises(KernelInputError, match="contiguous"):
        add_rms_norm(torch.randn(8, 2).t(), None, torch.ones(8), 1e-6)
    with pytest.raises(KernelInputError, match="even"):
        silu_mul(torch.randn(2, 7))
    with pytest.raises(KernelInputError, match="bf16/fp16/fp32"):
        silu_mul(torch.ones(2, 8, dtype=torch.int32))
