"""Ragged bottom-right causal attention through cuDNN's fused attention (Hopper kernels).

Same layout as :mod:`nibble.kernels.ragged` (``q [sum n_b, Hq, D]``, ``k``/``v``
``[sum (c_b + n_b), H, D]``, host ``spans`` ``(q_start, n_b, k_start, c_b + n_b)``).
cuDNN's dense attention has top-left causal alignment only, and its varlen entry gave
wrong outputs on the lent H200 (docs/benchmarks.md), so each sequence is split in dense
calls over disjoint keys (:func:`split_plan`): the prefix in whole key blocks (no mask),
the rest of the prefix in whole mid blocks (no mask), and a causal square over the last
keys, combined by their log-sum-exp (:func:`merge_by_lse`). On the H200 this is 1.6-1.9x
FlashAttention-2's varlen forward at the Qwen3-8B head shape.

:func:`split_attention` holds the split and merge with the dense call passed in, so the
composition is tested on CPU with a torch dense attention (:func:`dense_attention_ref`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

# dense(q [1, Hq, S, D], k [1, H, T, D], v, causal top-left) -> (out [1, Hq, S, D], lse fp32 [1, Hq, S])
DenseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float],
                   tuple[torch.Tensor, torch.Tensor]]

# merge(out [n, Hq, D], o1, lse1, o2, lse2[, o3, lse3]): the parts' first n rows merged into out.
MergeFn = Callable[..., torch.Tensor]

CUDNN_MIN_VERSION = 90000     # cuDNN 9: the SDPA graphs torch builds
# Shape buckets of the server's calls (split_plan): query rows round up to Q_BUCKET, the
# first unmasked part covers whole KEY_BLOCKs of the prefix, the second whole MID_BLOCKs of
# the rest, and the rest joins the causal square (fewer than MID_BLOCK zero rows lead it).
Q_BUCKET = 512
KEY_BLOCK = 4096
MID_BLOCK = 1024


class DenseCall(NamedTuple):
    """One dense attention call of a sequence's chunk (host ints, see :func:`split_plan`)."""

    lead: int       # zero query rows before the chunk's own (causal square only)
    rows: int       # query rows: lead + n padded to the query bucket
    key0: int       # first key, counted from the sequence's first
    keys: int       # keys read (the square pads them with zeros up to ``rows``)
    causal: bool    # top-left causal (the square) or no mask


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def split_plan(c: int, n: int, q_bucket: int = 1, key_block: int = 1, mid_block: int = 0
               ) -> list[DenseCall]:
    """The dense calls that attend ``n`` chunk rows over ``c`` prefix keys and themselves
    (bottom-right causal): with ``p = c - c % key_block`` and ``m`` the whole ``mid_block``s
    of ``c - p``, an unmasked call over keys ``[0, p)``, one over ``[p, p + m)``, and a causal
    square over ``[p + m, c + n)`` whose ``c - p - m`` leading query rows are zero dummies
    (so real row ``i`` sees the prefix's tail and its own rows up to ``i``); empty parts are
    left out. The dummy rows cost the square their triangle: without the middle part they
    could number up to ``key_block - 1``, whose ``r^2/2`` scores cost a 2K chunk up to
    ~10 ms a step on the H200 (docs/benchmarks.md). ``mid_block`` 0: no middle part."""
    p = c - c % key_block
    m = (c - p) - (c - p) % mid_block if mid_block else 0
    lead = c - p - m
    nb = _round_up(n, q_bucket)
    calls = [DenseCall(0, nb, start, size, False) for start, size in ((0, p), (p, m)) if size]
    calls.append(DenseCall(lead, _round_up(lead + n, q_bucket), p + m, lead + n, True))
    return calls


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                 o3: torch.Tensor | None = None, lse3: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """One attention from two (or three) partial ones over disjoint key sets.

    ``o1``/``o2``/``o3``: ``[..., S, D]`` (any float dtype), each normalised over its own keys;
    ``lse1``/``lse2``/``lse3``: fp32 ``[..., S]``, the log-sum-exp of their scaled scores.
    Returns ``o1``'s dtype and shape.
    """
    parts = [(o1, lse1), (o2, lse2)] + ([(o3, lse3)] if o3 is not None else [])
    m = torch.stack([lse for _, lse in parts]).amax(0)
    ws = [torch.exp(lse - m) for _, lse in parts]
    den = sum(ws)
    out = sum(o.float() * (w / den).unsqueeze(-1) for (o, _), w in zip(parts, ws))
    return out.to(o1.dtype)


def merge_into(out: torch.Tensor, o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
               lse2: torch.Tensor, o3: torch.Tensor | None = None,
               lse3: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`merge_by_lse` of the first ``n`` rows written into ``out [n, Hq, D]``
    (``o*`` ``[1, Hq, >= n, D]``, ``lse*`` fp32 ``[1, Hq, >= n]``); the torch form of
    :func:`nibble.kernels.triton.lse_merge.merge_lse_into`."""
    n = out.shape[0]
    third = (o3[:, :, :n], lse3[..., :n]) if o3 is not None else ()
    o = merge_by_lse(o1[:, :, :n], lse1[..., :n], o2[:, :, :n], lse2[..., :n], *third)
    out.copy_(o.squeeze(0).transpose(0, 1))
    return out


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    spans: list[tuple[int, int, int, int]], scale: float, dense: DenseFn,
                    q_bucket: int = 1, key_block: int = 1, merge: MergeFn = merge_into,
                    mid_block: int = 0) -> torch.Tensor:
    """Ragged bottom-right causal attention from up to three ``dense`` calls per sequence
    (:func:`split_plan`) -> ``[Tq, Hq, D]``.

    Query rows, and the square's keys, are zero-padded at the end to multiples of
    ``q_bucket`` (padded keys are seen by padded queries only). The buckets bound the
    distinct shapes, and so the execution plans cuDNN builds, 65-130 ms each on the H200
    (:func:`warm_plans`). ``merge`` combines the parts into the output rows
    (:func:`merge_into`, or the fused Triton kernel on a GPU).
    """
    out = torch.empty_like(q)
    for qs, n, ks, kn in spans:
        if n == 0:
            continue
        qq = q[qs:qs + n]
        parts, pq = [], None
        for call in split_plan(kn - n, n, q_bucket, key_block, mid_block):
            kk = k[ks + call.key0:ks + call.key0 + call.keys]
            vv = v[ks + call.key0:ks + call.key0 + call.keys]
            if call.causal:
                sq, sk, sv = (_heads_first(_padded(x, lead, call.rows)) for x, lead in
                              ((qq, call.lead), (kk, 0), (vv, 0)))
                o, lse = dense(sq, sk, sv, True, scale)
                rows = slice(call.lead, call.lead + n)
                parts.append((o[:, :, rows], lse[:, :, rows]))
                continue
            if pq is None:          # the unmasked parts share one padded copy of q
                pq = _heads_first(_padded(qq, 0, call.rows))
            parts.append(dense(pq, _heads_first(kk), _heads_first(vv), False, scale))
        if len(parts) == 1:
            out[qs:qs + n] = parts[0][0].squeeze(0).transpose(0, 1)
        else:
            merge(out[qs:qs + n], *(t for part in parts for t in part))
    return out


def warm_plans(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, max_chunk: int, context: int,
               q_bucket: int = Q_BUCKET, key_block: int = KEY_BLOCK,
               dense: DenseFn | None = None, mid_block: int = MID_BLOCK) -> int:
    """Builds cuDNN's plans for every bucketed shape of a chunk of up to ``max_chunk`` rows
    over a prefix of up to ``context`` rows (the server calls it once at start, beside the
    CUDA-graph capture); returns how many shapes it ran. ``dense``: the call to warm
    (default :func:`cudnn_dense`)."""
    dense = dense or cudnn_dense
    n_max = _round_up(max_chunk, q_bucket)
    most_lead = min(key_block, mid_block or key_block) - 1
    square_max = _round_up(n_max + most_lead, q_bucket)
    q = torch.zeros(square_max, num_q_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(max(square_max, context), num_kv_heads, head_dim, dtype=dtype,
                     device=device)
    unmasked = sorted(set(range(key_block, context, key_block)) |
                      set(range(mid_block, key_block, mid_block) if mid_block else ()))
    shapes = 0
    with torch.inference_mode():
        for size in range(q_bucket, square_max + 1, q_bucket):
            dense(*(_heads_first(x[:size]) for x in (q, kv, kv)), True, 1.0)
            shapes += 1
        for nb in range(q_bucket, n_max + 1, q_bucket):
            for keys in unmasked:
                dense(_heads_first(q[:nb]), _heads_first(kv[:keys]), _heads_first(kv[:keys]),
                      False, 1.0)
                shapes += 1
    return shapes


def _padded(x: torch.Tensor, lead: int, total: int) -> torch.Tensor:
    """``x [T, H, D]`` at rows ``[lead, lead + T)`` of zeros ``[total, H, D]``; ``x`` itself
    when nothing pads."""
    if lead == 0 and total == x.shape[0]:
        return x
    end = lead + x.shape[0]
    out = x.new_empty((total, *x.shape[1:]))       # zeros written to the padding rows only
    out[:lead].zero_()
    out[lead:end] = x
    out[end:].zero_()
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
