"""Shared fixtures: reference attention callables for CausalLM.forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


class VarlenCausalAttention:
    """Plain causal attention over back-to-back sequences, no KV cache.

    ``seq_lens`` gives the length of each sequence in the flattened stream;
    a token attends to earlier-or-equal tokens of its own sequence only.
    """

    def __init__(self, sm_scale: float, seq_lens: list[int] | None = None):
        self.sm_scale = sm_scale
        self.seq_lens = seq_lens
        self.calls: list[int] = []

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.calls.append(layer_id)
        t = q.shape[0]
        lens = self.seq_lens or [t]
        assert sum(lens) == t
        seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        idx = torch.arange(t)
        mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            attn_mask=mask, scale=self.sm_scale, enable_gqa=True)
        return out.transpose(0, 1).to(q.dtype)


class CachedAttention:
    """Single-sequence attention with a growing per-layer KV cache (for decode loops)."""

    def __init__(self, sm_scale: float):
        self.sm_scale = sm_scale
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer_id in self.k:
            k = torch.cat([self.k[layer_id], k])
            v = torch.cat([self.v[layer_id], v])
        self.k[layer_id], self.v[layer_id] = k, v
        n_new, n_all = q.shape[0], k.shape[0]
        # New token i sits at absolute index n_all - n_new + i.
        mask = torch.arange(n_all)[None, :] <= (n_all - n_new + torch.arange(n_new))[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=self.sm_scale, enable_gqa=True)
        return out.transpose(0, 1)


@pytest.fixture
def varlen_attention():
    return VarlenCausalAttention


@pytest.fixture
def cached_attention():
    return CachedAttention
