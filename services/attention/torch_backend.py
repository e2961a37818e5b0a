"""Reference attention backend in plain torch (CPU and GPU).

Pages are read and written through the kernels' torch references; attention
runs through ``scaled_dot_product_attention``.

Sliding windows (``set_sliding_windows``): a token at position ``p`` of a layer
with window ``w`` sees positions ``p - w < j <= p``. ``plan`` builds the gather
indices once per distinct window, so a windowed layer dequantizes only the
prefix rows some query of the step can see (the last ``w - 1`` before the
chunk for extend, the last ``w`` for decode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from nibble.kernels import gather_rows_ref, store_kv_ref
from nibble.tiering import KVPool

from .base import AttentionBackend, AttentionMetadata, RecipeHook, fresh_kv, register_backend


def _rows(block_tables: torch.Tensor, b: int, start: int, stop: int, page_size: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_idx, off_idx) int64 ``[stop - start]``: token slots ``[start, stop)`` of sequence ``b``."""
    slots = torch.arange(start, stop)
    return block_tables[b, slots // page_size].long(), slots % page_size


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool ``[Tq, Tk]``: key position ``j`` is visible to query position ``p`` (causal, windowed)."""
    rel = q_pos[:, None] - k_pos[None, :]
    ok = rel >= 0
    return ok if window is None else ok & (rel < window)


def _first_visible(last_pos: int, window: int | None) -> int:
    """Lowest position a query at ``last_pos`` (or later) can see."""
    return 0 if window is None else max(0, last_pos - window + 1)


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Args:
        pool: the KV pool (L1).
        sm_scale: softmax scale (usually head_dim ** -0.5).
        prefill_kv_dtype: "auto" or "fp8_e4m3" (fresh K/V and the extend
            workspace are cast to FP8 E4M3 first, as SGLang's recipe does).
        sliding_windows: per-layer windows (see ``set_sliding_windows``); empty = all full.
        device_cfg: the device slice (accepted like every backend's; torch has no kernel
            choice to make).
    """

    supports_sliding_window = True

    def __init__(self, pool: KVPool, sm_scale: float, prefill_kv_dtype: str = "auto",
                 sliding_windows: Sequence[int | None] = (), device_cfg=None):
        self.pool = pool
        self.layout = pool.layout
        self.sm_scale = sm_scale
        self.fp8_fresh = prefill_kv_dtype == "fp8_e4m3"
        self.set_sliding_windows(sliding_windows)
        self._recipe = RecipeHook(pool)

    def plan(self, meta: AttentionMetadata) -> None:
        """Per distinct window ``w``: ``_ext[w]`` and ``_dec[w]`` gather indices (see below)."""
        bt = meta.block_tables.cpu()
        windows = set(self.sliding_windows) or {None}
        self._ext = {w: self._plan_extend(meta, bt, w) for w in windows} if meta.extend else {}
        self._dec = {w: self._plan_decode(meta, bt, w) for w in windows} if meta.decode else {}

    def _plan_extend(self, meta: AttentionMetadata, bt: torch.Tensor, w: int | None):
        """``(rows or None, [(workspace start, first prefix position)] per extend sequence)``.

        The prefix rows every extend sequence's chunk can see, back to back in one
        workspace (``rows``: page_idx, off_idx int64 ``[N]``).
        """
        ps = self.layout.page_size
        spans, idx, start = [], [], 0
        for b in meta.extend:
            c = meta.cached_lens[b]
            lo = _first_visible(c, w)
            spans.append((start, lo))
            idx.append(_rows(bt, b, lo, c, ps))
            start += c - lo
        rows = (torch.cat([p for p, _ in idx]), torch.cat([o for _, o in idx])) if start else None
        return rows, spans

    def _plan_decode(self, meta: AttentionMetadata, bt: torch.Tensor, w: int | None):
        """``(page_idx, off_idx, mask, lmax)``: rows padded to ``lmax`` (padding -> row 0,
        masked); mask bool ``[B, 1, 1, lmax]``."""
        ps = self.layout.page_size
        spans = [(_first_visible(meta.cached_lens[b], w), meta.cached_lens[b] + 1)
                 for b in meta.decode]
        lens = [hi - lo for lo, hi in spans]
        lmax = max(lens)
        pages = torch.zeros((len(lens), lmax), dtype=torch.long)
        offs = torch.zeros_like(pages)
        for i, (b, (lo, hi)) in enumerate(zip(meta.decode, spans)):
            pages[i, :hi - lo], offs[i, :hi - lo] = _rows(bt, b, lo, hi, ps)
        mask = torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]
        return pages.flatten(), offs.flatten(), mask[:, None, None, :], lmax

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        pages = self.pool.layer(layer)
        ks, vs = self.pool.scales(layer)
        q, k, v = self._recipe.apply(layer, q, k, v)      # the format's K recipe, if any
        k, v = fresh_kv(k, self.fp8_fresh), fresh_kv(v, self.fp8_fresh)
        dev = self.pool.device
        self._store(pages, k.to(dev), v.to(dev), meta.slot_mapping.to(dev), ks, vs)
        k, v = k.to(q.dtype), v.to(q.dtype)
        w = self.window(layer)
        out = torch.empty_like(q)
        for b in meta.prefill:
            s, n = meta.seq_starts[b], meta.new_lens[b]
            if w is None or n <= w:
                out[s:s + n] = self._sdpa(q[s:s + n], k[s:s + n], v[s:s + n], causal=True)
            else:
                pos = torch.arange(n, device=q.device)
                out[s:s + n] = self._sdpa(q[s:s + n], k[s:s + n], v[s:s + n],
                                          mask=_visible(pos, pos, w))
        if meta.extend:
            self._extend(pages, q, k, v, meta, out, ks, vs, w)
        if meta.decode:
            self._decode(layer, pages, q, meta, out, ks, vs, w)
        return self._recipe.finish(layer, out)

    def _store(self, pages, k, v, slot_mapping, ks, vs):
        """Quantize and write the step's K/V ``[T, H, D]`` to their slots (int64 ``[T]``)."""
        store_kv_ref(self.layout, pages, k, v, slot_mapping, ks, vs)

    def _sdpa(self, q, k, v, causal=False, mask=None):
        """q [Tq, Hq, D], k/v [Tk, H, D] -> [Tq, Hq, D] (GQA by head grouping)."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal,
            scale=self.sm_scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _extend(self, pages, q, k, v, meta, out, ks, vs, w):
        # One workspace for the whole batch; every layer overwrites the same rows.
        rows, spans = self._ext[w]
        if rows is not None:
            ws_dtype = torch.float8_e4m3fn if self.fp8_fresh else q.dtype
            pk, pv = gather_rows_ref(self.layout, pages, *rows, ks, vs, ws_dtype)
        for b, (ws_start, lo) in zip(meta.extend, spans):
            s, n, c = meta.seq_starts[b], meta.new_lens[b], meta.cached_lens[b]
            m = c - lo
            kk, vv = k[s:s + n], v[s:s + n]
            if m:
                kk = torch.cat([pk[ws_start:ws_start + m].to(q.dtype), kk])
                vv = torch.cat([pv[ws_start:ws_start + m].to(q.dtype), vv])
            q_pos = torch.arange(c, c + n, device=q.device)
            mask = _visible(q_pos, torch.arange(lo, c + n, device=q.device), w)
            out[s:s + n] = self._sdpa(q[s:s + n], kk, vv, mask=mask)

    def _decode(self, layer, pages, q, meta, out, ks, vs, w):
        page_idx, off_idx, mask, lmax = self._dec[w]
        bsz = len(meta.decode)
        kk, vv = gather_rows_ref(self.layout, pages, page_idx, off_idx, ks, vs, q.dtype)
        kk = kk.view(bsz, lmax, *kk.shape[1:]).transpose(1, 2)     # [B, H, L, D]
        vv = vv.view(bsz, lmax, *vv.shape[1:]).transpose(1, 2)
        rows = torch.tensor([meta.seq_starts[b] for b in meta.decode], device=q.device)
        qq = q[rows].unsqueeze(2)                                    # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask.to(q.device),
                                           scale=self.sm_scale, enable_gqa=True)
        out[rows] = o.squeeze(2)
