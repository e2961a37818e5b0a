"""--attention-backend resolution: auto picks Triton on CUDA, a forced Triton that cannot run fails early."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.services import attention
from nibble.services.attention import TritonAttentionBackend
from nibble.services.engine.builder import select_attention_backend
from nibble.services.errors import ConfigError
from nibble.tiering import KVPool

CPU, CUDA = torch.device("cpu"), torch.device("cuda")   # no CUDA needed to name a device


def layout(head_dim=64, kv="nvfp4"):
    return PageLayout(kv, num_layers=2, num_kv_heads=2, head_dim=head_dim, page_size=16)


def test_auto_is_triton_on_cuda_and_torch_fast_on_cpu():
    assert select_attention_backend("auto", layout(), CUDA) == "triton"
    assert select_attention_backend("auto", layout(), CPU) == "torch_fast"
    # A head_dim the decode kernel lacks falls back to torch rather than failing.
    assert select_attention_backend("auto", layout(head_dim=80), CUDA) == "torch"


def test_forced_backends():
    assert select_attention_backend("torch", layout(), CUDA) == "torch"
    assert select_attention_backend("triton", layout(), CUDA) == "triton"
    with pytest.raises(ConfigError, match="head_dim"):
        select_attention_backend("triton", layout(head_dim=80), CUDA)
    with pytest.raises(ConfigError, match="not available"):
        select_attention_backend("flash", layout(), CUDA)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_attention_backend("triton", layout(), CPU) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        select_attention_backend("triton", layout(), CPU)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        TritonAttentionBackend(KVPool(layout(), 2), 0.125)


def test_without_triton_auto_falls_back_and_forcing_explains(monkeypatch):
    monkeypatch.setattr(attention, "TritonAttentionBackend", None)
    monkeypatch.setattr(attention, "TRITON_IMPORT_ERROR", "ModuleNotFoundError: triton")
    assert select_attention_backend("auto", layout(), CUDA) == "torch"
    with pytest.raises(ConfigError, match="ModuleNotFoundError: triton"):
        select_attention_backend("triton", layout(), CUDA)


def test_constructor_rejects_unsupported_head_dim():
    with pytest.raises(ConfigError, match="head_dim"):
        TritonAttentionBackend(KVPool(layout(head_dim=16), 2), 0.25)
