"""The CPU decode batch's split gate/up GEMMs give the fused GEMM's values, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ..engine.conftest import tiny_arch, tiny_model


@pytest.mark.parametrize("t", [1, 8, 64, 65, 200])
def test_gate_up_equals_the_fused_gemm(t):
    model = tiny_model(tiny_arch("llama", head_dim=32, num_heads=6), torch.float32)
    layer = model.layers[0]
    h = torch.randn(t, model.arch.hidden_size, generator=torch.Generator().manual_seed(t))
    gate, up = layer._gate_up(h, None)
    want_gate, want_up = F.linear(h, layer.gate_up_weight).chunk(2, dim=-1)
    assert torch.equal(gate, want_gate) and torch.equal(up, want_up)
