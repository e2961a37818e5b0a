"""Causal attention over ragged sequences whose keys may start with a cached prefix.

The prefill and extend paths of the attention backends attend ``n_b`` new query
rows of sequence ``b`` over ``c_b + n_b`` keys: ``c_b`` cached prefix rows
(dequantized from pages; 0 for a prefill) followed by the chunk's own fresh K/V.
Query row ``i`` sees key rows ``j <= c_b + i`` (causal, aligned bottom-right).

Layout (all sequences back to back):

* ``q``: ``[sum n_b, Hq, D]``; ``k``/``v``: ``[sum (c_b + n_b), H, D]``, ``Hq % H == 0``
  (grouped-query attention, query head ``h`` reads KV head ``h // (Hq // H)``);
* ``cu_q``/``cu_k``: int32 ``[B + 1]`` exclusive prefix sums of ``n_b`` and ``c_b + n_b``.

:func:`ragged_causal_attention` runs on CUDA for fp16/bf16 either one FlashAttention-2
varlen launch (no score matrix, no mask tensor, no repeated K/V heads) or, on Hopper for a
few long sequences, cuDNN's fused attention two or three times per sequence
(:mod:`nibble.kernels.ragged_cudnn`, 1.6-1.9x faster there); :func:`choose_kernel` picks.
Elsewhere it loops over sequences with torch SDPA and a lower-right causal bias.
:func:`ragged_causal_attention_ref` is the fp32 reference with explicit masks.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.bias import causal_lower_right

from .errors import KernelInputError
from .ragged_cudnn import (KEY_BLOCK, MID_BLOCK, Q_BUCKET, cudnn_available, cudnn_dense,
                           split_attention)
from .triton.lse_merge import merge_lse_into

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
RAGGED_KERNELS = ("auto", "fa2", "cudnn")    # the choices of --prefill-attention-kernel
# auto takes cuDNN on sm_90 for at most this many sequences (two or three launches each per layer)
# of at least this many query rows in all; below, FlashAttention-2's one launch.
CUDNN_AUTO_MAX_SEQS = 4
CUDNN_AUTO_MIN_ROWS = 256


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
           cu_k: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise KernelInputError(f"q must be [Tq, Hq, D] and k, v the same [Tk, H, D]; got "
                               f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise KernelInputError(f"head dims differ or {q.shape[1]} query heads are not a "
                               f"multiple of {k.shape[1]} KV heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (*_FLASH_DTYPES, torch.float32):
        raise KernelInputError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, "
                               f"{v.dtype}")
    if not (q.device == k.device == v.device == cu_q.device == cu_k.device):
        raise KernelInputError("q, k, v, cu_q and cu_k must be on one device")
    for name, cu in (("cu_q", cu_q), ("cu_k", cu_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise KernelInputError(f"{name} must be int32 [B + 1], got {cu.dtype} "
                                   f"{tuple(cu.shape)}")
    if cu_q.shape != cu_k.shape or cu_q.shape[0] < 1:
        raise KernelInputError("cu_q and cu_k must both be [B + 1]")


def flash_applies(q: torch.Tensor) -> bool:
    """Whether ``q`` suits the fused CUDA paths (FlashAttention-2 varlen, or cuDNN)."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in _FLASH_DTYPES and d % 8 == 0 and d <= 256


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def choose_kernel(q: torch.Tensor, num_seqs: int | None, kernel: str = "auto") -> str:
    """``"fa2"``, ``"cudnn"`` or ``"sdpa"`` (the per-sequence torch loop) for ``q``.

    ``num_seqs``: the number of sequences when the host knows the layout (None: it does
    not, so ``auto`` stays on FlashAttention-2 rather than sync for it). Raises
    :class:`KernelInputError` for a ``kernel`` that cannot run on ``q``.
    """
    if kernel not in RAGGED_KERNELS:
        raise KernelInputError(f"kernel must be one of {RAGGED_KERNELS}, got {kernel!r}")
    cudnn_ok = flash_applies(q) and q.shape[-1] <= 128 and cudnn_available(q.device)
    if kernel == "cudnn":
        if not cudnn_ok:
            raise KernelInputError(f"the cuDNN ragged attention needs CUDA with cuDNN >= 9 and "
                                   f"fp16/bf16 of head dim <= 128; got {q.dtype} "
                                   f"{tuple(q.shape)} on {q.device}")
        return "cudnn"
    if not flash_applies(q):
        return "sdpa"
    if (kernel == "auto" and cudnn_ok and num_seqs is not None and num_seqs <= CUDNN_AUTO_MAX_SEQS
            and q.shape[0] >= CUDNN_AUTO_MIN_ROWS and _hopper(q.device)):
        return "cudnn"
    return "fa2"


def ragged_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                            scale: float, *, spans: list[tuple[int, int, int, int]] | None = None,
                            kernel: str = "auto") -> torch.Tensor:
    """Ragged bottom-right causal attention (layout in the module docstring) -> ``[Tq, Hq, D]``.

    Args:
        max_q, max_k: the largest ``n_b`` and ``c_b + n_b`` (host ints: the launch needs them).
        scale: softmax scale.
        spans: optional host copy of the layout, ``(q_start, n_b, k_start, c_b + n_b)`` per
            sequence, for the per-sequence path (read from ``cu_q``/``cu_k`` when absent,
            a device sync).
        kernel: ``auto``, ``fa2`` or ``cudnn`` (:func:`choose_kernel`).
    """
    _check(q, k, v, cu_q, cu_k)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    route = choose_kernel(q, None if spans is None else len(spans), kernel)
    if route == "fa2":
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0,
            True, False, scale=scale)[0]
    if spans is None:
        spans = _spans(cu_q, cu_k)
    if route == "cudnn":           # contiguous: one stride pattern, so cached cuDNN plans apply
        return split_attention(q.contiguous(), k.contiguous(), v.contiguous(), spans, scale,
                               cudnn_dense, Q_BUCKET, KEY_BLOCK, merge=merge_lse_into,
                               mid_block=MID_BLOCK)
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for qs, n, ks, kn in spans:
        if n == 0:
            continue
        qq = q[qs:qs + n].transpose(0, 1).unsqueeze(0)
        kk = k[ks:ks + kn].transpose(0, 1).unsqueeze(0)
        vv = v[ks:ks + kn].transpose(0, 1).unsqueeze(0)
        if group > 1:
            kk, vv = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=causal_lower_right(n, kn), scale=scale)
        out[qs:qs + n] = o.squeeze(0).transpose(0, 1)
    return out


def _spans(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    cq, ck = cu_q.tolist(), cu_k.tolist()
    spans = []
    for b in range(len(cq) - 1):
        n, kn = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if kn < n:
            raise KernelInputError(f"sequence {b} has {kn} keys for {n} queries")
        spans.append((cq[b], n, ck[b], kn))
    return spans


def ragged_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float
                                ) -> torch.Tensor:
    """fp32 reference of :func:`ragged_causal_attention` with explicit masks; ``q``'s dtype."""
    _check(q, k, v, cu_q, cu_k)
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for qs, n, ks, kn in _spans(cu_q, cu_k):
        if n == 0:
            continue
        qq = q[qs:qs + n].float()
        kk = k[ks:ks + kn].float().repeat_interleave(group, dim=1)
        vv = v[ks:ks + kn].float().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        qpos = torch.arange(n).unsqueeze(1) + (kn - n)
        mask = torch.arange(kn).unsqueeze(0) <= qpos
        s = s.masked_fill(~mask.to(s.device), float("-inf"))
        out[qs:qs + n] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv).to(q.dtype)
    return out
