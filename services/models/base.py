"""Interfaces between the model and the attention implementation it delegates to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class QKVInput:
    """A layer's QKV projection output and what turns it into attention inputs.

    Handed to :meth:`AttentionFn.fused` by models whose attention inputs are
    ``rope(qk_norm(q))``, ``rope(qk_norm(k))`` and ``v`` (Llama, Qwen2, Qwen3), so
    that a backend can do the norms, RoPE, its K recipe and the KV store in one kernel.
    """

    qkv: torch.Tensor                 # [T, (Hq + 2 * Hkv) * D]: q heads, k heads, v heads
    num_heads: int                    # Hq
    num_kv_heads: int                 # Hkv
    head_dim: int                     # D
    cos: torch.Tensor                 # [T, 1, D] RoPE tables (HF rotate_half layout), x's dtype
    sin: torch.Tensor                 # [T, 1, D]
    q_norm: torch.Tensor | None       # [D] QK-norm gain of q (RMSNorm per head), or None
    k_norm: torch.Tensor | None       # [D] QK-norm gain of k, or None
    eps: float                        # the norms' epsilon
    # the output's dtype, where it may differ from qkv's (a float32 model whose next projection
    # multiplies bf16 rows asks for bf16); a backend may ignore it and return qkv's dtype
    out_dtype: torch.dtype | None = None


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

    An implementation may also offer ``fused(layer_id, inp: QKVInput) -> [T, Hq, D] | None``
    (see :func:`fused_attention`): attention straight from the QKV projection's output,
    or None where it does not apply to this step (the model then calls it as above), and
    ``decode_only: bool``: every sequence of the step decodes one token (see
    :func:`is_decode_step`; a model may multiply such a step by other weights).
    """

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor: ...


def fused_attention(attn: AttentionFn, layer_id: int, inp: QKVInput) -> torch.Tensor | None:
    """``attn.fused(layer_id, inp)`` where ``attn`` offers it, else None."""
    fused = getattr(attn, "fused", None)
    return None if fused is None else fused(layer_id, inp)


def is_decode_step(attn: AttentionFn) -> bool:
    """``attn.decode_only`` where ``attn`` states it, else False (a prompt may be in it)."""
    return bool(getattr(attn, "decode_only", False))
