"""Interfaces between the model and the attention implementation it delegates to."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionFn(Protocol):
    """Attention over a flattened varlen token stream, supplied by the caller.

    The model calls it once per layer. It owns everything that needs sequence
    boundaries: writing K/V into the cache, reading cached K/V of earlier
    tokens, and the causal mask.

    Args:
        layer_id: decoder layer index, 0-based.
        q: ``[T, Hq, D]`` queries, RoPE (and QK-norm) already applied.
        k: ``[T, Hkv, D]`` keys of the step's tokens, RoPE (and QK-norm) applied.
        v: ``[T, Hkv, D]`` values of the step's tokens.

    Returns:
        ``[T, Hq, D]`` attention output in ``q.dtype``. The callable applies the
        softmax scale itself (``ModelArchConfig.sm_scale``); GQA groups are
        ``Hq // Hkv`` consecutive query heads per KV head.
    """

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor: ...
