"""The step budget: what a prefill chunk costs, and the scheduler's defaults per device.

A mixed step runs every decode plus prefill chunks; its length is what a streaming
user waits between two tokens. Counting only tokens makes late chunks of a long
prompt far dearer than early ones: a chunk of ``n`` tokens after ``c`` cached ones
attends over ``c + n/2`` keys per token on average, so on a 32K prompt the last
2K chunk of an 8B model costs about 3.5x the first. With ``chunk_cost_context = A``
such a chunk counts as ``n * (1 + (c + n/2) / A)`` tokens against
``--max-prefill-tokens``: chunks shrink as the prefix grows and every mixed step
costs about the same. ``A`` is the context length at which a prompt token's
attention costs as much as the rest of its forward pass (``--chunk-cost-context``; -1
derives it from the model; 0, the default, counts tokens only).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..config import SchedulerConfig

# FlashAttention-2's forward runs at about half of the dense GEMM rate on Hopper.
ATTENTION_EFFICIENCY = 0.5


def attention_cost_context(arch) -> int:
    """``A`` for a model: linear FLOPs per token over attention FLOPs per (query, key) pair,
    scaled by :data:`ATTENTION_EFFICIENCY` (Qwen3-8B: about 11.8K tokens)."""
    hd, q, kv = arch.head_dim, arch.num_heads, arch.num_kv_heads
    linear = arch.hidden_size * (q + 2 * kv) * hd + q * hd * arch.hidden_size \
        + 3 * arch.hidden_size * arch.intermediate_size          # per layer, multiply-adds
    per_key = 2 * q * hd                                         # QK^T and PV, multiply-adds
    return max(1, int(linear / per_key * ATTENTION_EFFICIENCY))


def resolve_scheduler(cfg: SchedulerConfig, arch) -> SchedulerConfig:
    """``cfg`` with ``chunk_cost_context`` -1 replaced by the model's ``A``
    (:func:`attention_cost_context` of ``arch``, a ``ModelArchConfig``)."""
    if cfg.chunk_cost_context != -1:
        return cfg
    return replace(cfg, chunk_cost_context=attention_cost_context(arch))


def chunk_cost(n: int, cached: int, ctx: int) -> float:
    """Budget tokens of an ``n``-token chunk after ``cached`` tokens (a decode: 1)."""
    if n <= 1 or not ctx:
        return float(n)
    return n * (1.0 + (cached + n / 2.0) / ctx)


def max_chunk(budget: float, cached: int, ctx: int) -> int:
    """The largest ``n`` with ``chunk_cost(n, cached, ctx) <= budget`` (at least 1)."""
    if not ctx:
        return max(1, int(budget))
    a, b = 1.0 / (2.0 * ctx), 1.0 + cached / ctx
    n = int((-b + math.sqrt(b * b + 4.0 * a * budget)) / (2.0 * a))
    while n > 1 and chunk_cost(n, cached, ctx) > budget:   # float rounding at the edge
        n -= 1
    return max(1, n)
