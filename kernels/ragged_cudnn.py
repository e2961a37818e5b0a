"""Ragged bottom-right causal attention through cuDNN's fused attention (Hopper kernels).

Same layout as :mod:`nibble.kernels.ragged` (``q [sum n_b, Hq, D]``, ``k``/``v``
``[sum (c_b + n_b), H, D]``, host ``spans`` ``(q_start, n_b, k_start, c_b + n_b)``).
cuDNN's dense attention has top-left causal alignment only, and its varlen entry gave
wrong outputs on the lent H200 (docs/benchmarks.md), so each sequence is split in two
dense calls over disjoint keys: its ``n x c`` prefix (no mask) and its own ``n x n``
causal square, combined by their log-sum-exp (:func:`merge_by_lse`). On the H200 this
is 1.6-1.9x FlashAttention-2's varlen forward at the Qwen3-8B head shape.

:func:`split_attention` holds the split and merge with the dense call passed in, so the
composition is tested on CPU with a torch dense attention (:func:`dense_attention_ref`).
"""

from __future__ import annotations

from typing import Callable

import torch

# dense(q [1, Hq, S, D], k [1, H, T, D], v, causal top-left) -> (out [1, Hq, S, D], lse fp32 [1, Hq, S])
DenseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float],
                   tuple[torch.Tensor, torch.Tensor]]

# merge(out [n, Hq, D], o1, lse1, o2, lse2): the two parts' first n rows merged into out.
MergeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   torch.Tensor]

CUDNN_MIN_VERSION = 90000     # cuDNN 9: the SDPA graphs torch builds
# Shape buckets of the server's calls (split_attention): query rows round up to Q_BUCKET,
# the unmasked prefix part covers whole KEY_BLOCKs (the rest joins the causal square).
Q_BUCKET = 512
KEY_BLOCK = 4096


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                 ) -> torch.Tensor:
    """One attention from two partial ones over disjoint key sets.

    ``o1``/``o2``: ``[..., S, D]`` (any float dtype), each normalised over its own keys;
    ``lse1``/``lse2``: fp32 ``[..., S]``, the log-sum-exp of their scaled scores.
    Returns ``o1``'s dtype and shape.
    """
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    den = w1 + w2
    out = o1.float() * (w1 / den).unsqueeze(-1) + o2.float() * (w2 / den).unsqueeze(-1)
    return out.to(o1.dtype)


def merge_into(out: torch.Tensor, o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
               lse2: torch.Tensor) -> torch.Tensor:
    """:func:`merge_by_lse` of the first ``n`` rows written into ``out [n, Hq, D]``
    (``o1``/``o2`` ``[1, Hq, >= n, D]``, ``lse1``/``lse2`` fp32 ``[1, Hq, >= n]``); the torch
    form of :func:`nibble.kernels.triton.lse_merge.merge_lse_into`."""
    n = out.shape[0]
    o = merge_by_lse(o1[:, :, :n], lse1[..., :n], o2[:, :, :n], lse2[..., :n])
    out.copy_(o.squeeze(0).transpose(0, 1))
    return out


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    spans: list[tuple[int, int, int, int]], scale: float, dense: DenseFn,
                    q_bucket: int = 1, key_block: int = 1, merge: MergeFn = merge_into
                    ) -> torch.Tensor:
    """Ragged bottom-right causal attention from two ``dense`` calls per sequence -> ``[Tq, Hq, D]``.

    Sequence ``b``'s ``c`` prefix keys split at ``p = c - c % key_block``: its queries see
    keys ``[0, p)`` fully (no mask) and keys ``[p, c + n)`` through a top-left causal
    square whose first ``c % key_block`` query rows are zero dummies, so the real row
    ``i`` sees the prefix's tail and its own rows up to ``i``. Query rows, and the
    square's keys, are zero-padded at the end to multiples of ``q_bucket`` (padded keys
    are seen by padded queries only). The buckets bound the distinct shapes, and so the
    execution plans cuDNN builds, 65-130 ms each on the H200 (:func:`warm_plans`).
    ``merge`` combines the two parts into the output rows (:func:`merge_into`, or the fused
    Triton kernel on a GPU).
    """
    out = torch.empty_like(q)
    for qs, n, ks, kn in spans:
        if n == 0:
            continue
        c = kn - n
        p = c - c % key_block
        r = c - p
        qq = q[qs:qs + n]
        size = _round_up(r + n, q_bucket)
        sq, sk, sv = (_heads_first(_padded(x, lead, size)) for x, lead in
                      ((qq, r), (k[ks + p:ks + kn], 0), (v[ks + p:ks + kn], 0)))
        o, lse = dense(sq, sk, sv, True, scale)
        o, lse = o[:, :, r:r + n], lse[:, :, r:r + n]
        if not p:
            out[qs:qs + n] = o.squeeze(0).transpose(0, 1)
            continue
        pq = _heads_first(_padded(qq, 0, _round_up(n, q_bucket)))
        op, lsep = dense(pq, _heads_first(k[ks:ks + p]), _heads_first(v[ks:ks + p]), False, scale)
        merge(out[qs:qs + n], op, lsep, o, lse)
    return out


def warm_plans(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, max_chunk: int, context: int,
               q_bucket: int = Q_BUCKET, key_block: int = KEY_BLOCK,
               dense: DenseFn | None = None) -> int:
    """Builds cuDNN's plans for every bucketed shape of a chunk of up to ``max_chunk`` rows
    over a prefix of up to ``context`` rows (the server calls it once at start, beside the
    CUDA-graph capture); returns how many shapes it ran. ``dense``: the call to warm
    (default :func:`cudnn_dense`)."""
    dense = dense or cudnn_dense
    n_max = _round_up(max_chunk, q_bucket)
    rows = max(n_max + key_block, context)
    q = torch.zeros(n_max + key_block, num_q_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device)
    shapes = 0
    with torch.inference_mode():
        for size in range(q_bucket, n_max + key_block + 1, q_bucket):
            dense(*(_heads_first(x[:size]) for x in (q, kv, kv)), True, 1.0)
            shapes += 1
        for nb in range(q_bucket, n_max + 1, q_bucket):
            for p in range(key_block, context, key_block):
                dense(_heads_first(q[:nb]), _heads_first(kv[:p]), _heads_first(kv[:p]), False,
                      1.0)
                shapes += 1
    return shapes


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _padded(x: torch.Tensor, lead: int, total: int) -> torch.Tensor:
    """``x [T, H, D]`` at rows ``[lead, lead + T)`` of zeros ``[total, H, D]``; ``x`` itself
    when nothing pads."""
    if lead == 0 and total == x.shape[0]:
        return x
    out = x.new_zeros((total, *x.shape[1:]))
    out[lead:lead + x.shape[0]] = x
    return out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` as a ``[1, H, T, D]`` view."""
    return x.transpose(0, 1).unsqueeze(0)


def cudnn_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One cuDNN fused attention with its log-sum-exp; grouped-query heads natively."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].reshape(q.shape[0], q.shape[1], q.shape[2])


def dense_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch stand-in for :func:`cudnn_dense` (same shapes, top-left causal)."""
    g = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1)
    vv = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), kk) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
                          .triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), vv)
    return o.to(q.dtype), lse


def cudnn_available(device: torch.device) -> bool:
    """Whether torch's cuDNN attention can run on ``device`` (CUDA, cuDNN 9)."""
    if device.type != "cuda" or not torch.backends.cudnn.is_available():
        return False
    return (torch.backends.cudnn.version() or 0) >= CUDNN_MIN_VERSION
