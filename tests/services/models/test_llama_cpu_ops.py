"""CausalLM on the CPU's C residual add + RMSNorm against its torch ops."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels.cpu import layer_ops

from ..engine.conftest import tiny_arch, tiny_model
from .conftest import VarlenCausalAttention

pytestmark = pytest.mark.skipif(not layer_ops.available(), reason="no C compiler here")


@pytest.mark.parametrize("arch,dtype,tol", [("llama", torch.float32, 1e-5),
                                            ("qwen2", torch.float32, 1e-5),
                                            ("llama", torch.bfloat16, 0.05)])
def test_c_layer_ops_match_the_torch_layers(arch, dtype, tol, monkeypatch):
    model = tiny_model(tiny_arch(arch), dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ids, pos = torch.tensor([5, 9, 17, 3, 40, 2]), torch.arange(6)
    attn = VarlenCausalAttention(model.arch.sm_scale)
    ref = model(ids, pos, attn)
    calls = []
    real = layer_ops.add_rms_norm
    monkeypatch.setattr(layer_ops, "add_rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    model.set_cpu_layer_ops(True)
    assert model.cpu_layer_ops
    out = model(ids, pos, attn)
    assert len(calls) == 2 * model.arch.num_layers + 1          # two per layer, the final norm
    assert out.dtype == ref.dtype
    # fp32: summation order only; bf16: the norm's product rounded once instead of twice
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < tol


def test_not_for_other_dtypes_or_gemma():
    from nibble.services.models.gemma3 import Gemma3CausalLM
    half = tiny_model(tiny_arch("llama"), torch.float16)
    half.set_cpu_layer_ops(True)
    assert not half.cpu_layer_ops
    gemma = Gemma3CausalLM(tiny_arch("gemma3", qk_norm=True))
    gemma.set_cpu_layer_ops(True)
    assert not gemma.cpu_layer_ops
