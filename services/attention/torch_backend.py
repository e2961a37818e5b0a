"""Reference attention backend in plain torch (CPU and GPU).

Pages are read and written through the kernels' torch references; attention
runs through ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nibble.kernels import gather_rows_ref, store_kv_ref
from nibble.tiering import KVPool

from .base import AttentionBackend, AttentionMetadata, fresh_kv, register_backend


def _rows(block_tables: torch.Tensor, b: int, n: int, page_size: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_idx, off_idx) int64 [n] of the first ``n`` token slots of sequence ``b``."""
    slots = torch.arange(n)
    return block_tables[b, slots // page_size].long(), slots % page_size


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Args:
        pool: the KV pool (L1).
        sm_scale: softmax scale (usually head_dim ** -0.5).
        prefill_kv_dtype: "auto" or "fp8_e4m3" (fresh K/V and the extend
            workspace are cast to FP8 E4M3 first, as SGLang's recipe does).
    """

    def __init__(self, pool: KVPool, sm_scale: float, prefill_kv_dtype: str = "auto"):
        self.pool = pool
        self.layout = pool.layout
        self.sm_scale = sm_scale
        self.fp8_fresh = prefill_kv_dtype == "fp8_e4m3"

    def plan(self, meta: AttentionMetadata) -> None:
        ps = self.layout.page_size
        bt = meta.block_tables.cpu()
        # Extend: prefix rows of every extend sequence, back to back.
        idx = [_rows(bt, b, meta.cached_lens[b], ps) for b in meta.extend]
        self._ext_rows = (torch.cat([p for p, _ in idx]), torch.cat([o for _, o in idx])) if idx else None
        self._ext_offsets = []
        start = 0
        for b in meta.extend:
            self._ext_offsets.append(start)
            start += meta.cached_lens[b]
        # Decode: rows padded to the longest context; padding points at row 0, masked.
        if meta.decode:
            lens = [meta.cached_lens[b] + 1 for b in meta.decode]
            lmax = max(lens)
            pages = torch.zeros((len(lens), lmax), dtype=torch.long)
            offs = torch.zeros_like(pages)
            for i, (b, n) in enumerate(zip(meta.decode, lens)):
                pages[i, :n], offs[i, :n] = _rows(bt, b, n, ps)
            mask = torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]
            self._dec = (pages.flatten(), offs.flatten(), mask[:, None, None, :], lmax)
        else:
            self._dec = None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        pages = self.pool.layer(layer)
        ks, vs = self.pool.scales(layer)
        k, v = fresh_kv(k, self.fp8_fresh), fresh_kv(v, self.fp8_fresh)
        dev = self.pool.device
        store_kv_ref(self.layout, pages, k.to(dev), v.to(dev), meta.slot_mapping.to(dev), ks, vs)
        k, v = k.to(q.dtype), v.to(q.dtype)
        out = torch.empty_like(q)
        for b in meta.prefill:
            s, n = meta.seq_starts[b], meta.new_lens[b]
            out[s:s + n] = self._sdpa(q[s:s + n], k[s:s + n], v[s:s + n], causal=True)
        if meta.extend:
            self._extend(layer, pages, q, k, v, meta, out, ks, vs)
        if self._dec is not None:
            self._decode(pages, q, meta, out, ks, vs)
        return out

    def _sdpa(self, q, k, v, causal=False, mask=None):
        """q [Tq, Hq, D], k/v [Tk, H, D] -> [Tq, Hq, D] (GQA by head grouping)."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal,
            scale=self.sm_scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _extend(self, layer, pages, q, k, v, meta, out, ks, vs):
        # One workspace for the whole batch; every layer overwrites the same rows.
        ws_dtype = torch.float8_e4m3fn if self.fp8_fresh else q.dtype
        pk, pv = gather_rows_ref(self.layout, pages, *self._ext_rows, ks, vs, ws_dtype)
        for b, ws_start in zip(meta.extend, self._ext_offsets):
            s, n, c = meta.seq_starts[b], meta.new_lens[b], meta.cached_lens[b]
            kk = torch.cat([pk[ws_start:ws_start + c].to(q.dtype), k[s:s + n]])
            vv = torch.cat([pv[ws_start:ws_start + c].to(q.dtype), v[s:s + n]])
            mask = torch.ones((n, c + n), dtype=torch.bool, device=q.device).tril(diagonal=c)
            out[s:s + n] = self._sdpa(q[s:s + n], kk, vv, mask=mask)

    def _decode(self, pages, q, meta, out, ks, vs):
        page_idx, off_idx, mask, lmax = self._dec
        bsz = len(meta.decode)
        kk, vv = gather_rows_ref(self.layout, pages, page_idx, off_idx, ks, vs, q.dtype)
        kk = kk.view(bsz, lmax, *kk.shape[1:]).transpose(1, 2)     # [B, H, L, D]
        vv = vv.view(bsz, lmax, *vv.shape[1:]).transpose(1, 2)
        rows = torch.tensor([meta.seq_starts[b] for b in meta.decode], device=q.device)
        qq = q[rows].unsqueeze(2)                                    # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask.to(q.device),
                                           scale=self.sm_scale, enable_gqa=True)
        out[rows] = o.squeeze(2)
