"""The CPU decode fast path: the torch backend with a batched, vectorized decode.

Registered as ``torch_fast``; ``--attention-backend auto`` picks it on CPU. Prefill
and extend run exactly as in the reference ``torch`` backend (``torch_backend.py``),
which stays the reference the tests compare against. The decode path differs:

* ``plan`` computes once per step the decode sequences' page ids ``[B, M]`` (``M``
  pages of the longest), their new tokens' slots, and one key mask ``[B, 1, 1, M*S]``
  per distinct sliding window;
* the first decode layer of a chunk of layers dequantizes the pages of the whole chunk
  at once (``kernels.paged_fast.dequantize_pages``) into ``[2, L, B, H, M*S, D]``
  (K, V); the chunk is every layer unless that workspace would pass
  ``WORKSPACE_BYTES``; its memory is kept from step to step (about 1.5x the largest
  workspace so far, lookup indices included), which saves a large allocation's page
  faults every step;
* each layer stores its new K/V (``store_kv_fast``: plain NVFP4 K and V in one
  pass), dequantizes just those rows into the workspace, and runs one SDPA for the
  batch with each KV head's query heads as the query length (no K/V copy for GQA).

Values are the reference's: the dequantized K/V are bit-identical, the attention
output equal within fp32 rounding (a different SDPA call shape and padding).
Formats outside ``paged_fast.FAST_ELEMENTS`` (the rotated-K research formats)
decode through the reference path.

Plain NVFP4 K and V (``nvfp4`` and its calibrated recipes) go one step further on a pure
decode step where the C kernel builds (``kernels/cpu``; a bf16 or fp16 model's rows are
widened to fp32 for the call and the output rounded back): each layer is one
C call doing the recipe, the store and the attention (and RoPE, through
:meth:`forward_fused`, which the model tries first), with no workspace at all.
``NIBBLE_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nibble.kernels import cpu as cpu_kernels
from nibble.kernels.paged_fast import (dequantize_pages, dequantize_rows, dequantize_stored,
                                       split_slots, store_kv_fast, supports_layout)

from ..models.base import QKVInput
from .base import AttentionMetadata, fresh_kv, register_backend
from .torch_backend import TorchAttentionBackend, _first_visible

# Upper bound on one chunk's dequantized K+V workspace.
WORKSPACE_BYTES = 256 * 2**20
# Model dtypes whose decode steps the C kernel takes (it computes in fp32; bf16 and fp16 rows
# are widened for the call).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@register_backend("torch_fast")
class FastTorchAttentionBackend(TorchAttentionBackend):
    """:class:`TorchAttentionBackend` (same arguments) with the batched decode above."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast = supports_layout(self.layout)
        self._fd: dict | None = None
        self._chunk: tuple[range, torch.Tensor] | None = None
        self._stored = None         # what the last store returned (plain NVFP4 codes, scales)
        self._scratch: dict = {}    # the workspace's memory, kept from step to step
        self.native = (self.pool.device.type == "cpu" and not self.fp8_fresh
                       and cpu_kernels.supports_layout(self.layout) and cpu_kernels.available())
        self._nd: dict | None = None                  # the native decode step's plan
        self._native_recipe: tuple = (None,)          # (params, tensors, their pointers)

    def plan(self, meta: AttentionMetadata) -> None:
        self._fd = self._chunk = self._nd = None
        if self.native and meta.decode and len(meta.decode) == len(meta.seq_starts):
            self._plan_native(meta)
            return
        self.plan_torch(meta)

    def plan_torch(self, meta: AttentionMetadata) -> None:
        """The torch decode's plan (see the module docstring)."""
        self._nd = None
        if not self.fast or not meta.decode:
            super().plan(meta)
            return
        bt = meta.block_tables.cpu()
        windows = set(self.sliding_windows) or {None}
        self._ext = {w: self._plan_extend(meta, bt, w) for w in windows} if meta.extend else {}
        self._dec = {}
        ps, dev = self.layout.page_size, self.pool.device
        dec = torch.tensor(meta.decode, dtype=torch.long)
        cached = torch.tensor([meta.cached_lens[b] for b in meta.decode], dtype=torch.long)
        m = (int(cached.max()) // ps) + 1
        pos = torch.arange(m * ps)
        masks = {}
        for w in windows:
            lo = torch.tensor([_first_visible(int(c), w) for c in cached])
            ok = (pos[None, :] <= cached[:, None]) & (pos[None, :] >= lo[:, None])
            masks[w] = ok[:, None, None, :].to(dev)
        pure = len(meta.decode) == len(meta.seq_starts)
        self._fd = dict(
            meta=meta, pure=pure, page_ids=bt[dec, :m].long().to(dev),
            new_page=bt[dec, cached // ps].long().to(dev), new_off=(cached % ps).to(dev),
            batch=torch.arange(len(dec), device=dev), cached=cached.to(dev), masks=masks,
            rows=torch.tensor([meta.seq_starts[b] for b in meta.decode], device=dev),
            gs=self.pool.global_scales.to(dev), gs_list=self.pool.global_scales.tolist(),
            slots=split_slots(self.layout, self.pool.layer(0), meta.slot_mapping.to(dev))
            if pure else None)

    def _plan_native(self, meta: AttentionMetadata) -> None:
        """A pure decode step for the C kernel: page ids ``[B, M]``, slots, and per window the
        first visible position of each sequence (``lo``; the last, ``hi``, is its new row)."""
        ps = self.layout.page_size
        hi = torch.tensor(meta.cached_lens, dtype=torch.long)
        m = int(hi.max()) // ps + 1
        slots = meta.slot_mapping.cpu().long().contiguous()
        split_slots(self.layout, self.pool.layer(0), slots)          # checks them
        lo = {w: torch.tensor([_first_visible(c, w) for c in meta.cached_lens], dtype=torch.long)
              for w in set(self.sliding_windows) or {None}}
        step = cpu_kernels.DecodeStep(self.layout, self.pool.pages, slots,
                                      meta.block_tables[:, :m].long().contiguous(), hi,
                                      self.sm_scale)
        self._nd = dict(meta=meta, step=step, lo=lo, scales=self.pool.global_scales.tolist(),
                        recipe=self._recipe_ptrs(step))
        self._dec = {}

    def _recipe_ptrs(self, step) -> list[tuple]:
        """Per layer, the pool's recipe parameters as the C kernel takes them (all None: no
        recipe, or not calibrated: identity); converted once per parameter set."""
        p = getattr(self.pool, "recipe_params", None)
        if p is None or not p.digest:
            return [(None,) * 5] * self.layout.num_layers
        if self._native_recipe[0] is not p:
            f32 = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731
            per = [dict(k_map=f32(p.k_map[i]) if p.k_map is not None else None,
                        k_bias=f32(p.k_bias[i, :, 0]) if p.k_map is not None else None,
                        k_shift=f32(p.k_shift[i]) if p.k_map is None else None,
                        q_map=f32(p.q_map[i]) if p.q_map is not None else None,
                        v_shift=f32(p.v_shift[i]) if p.v_shift is not None else None)
                   for i in range(self.layout.num_layers)]
            self._native_recipe = (p, per, [step.recipe(r) for r in per])
        return self._native_recipe[2]

    def _native(self, layer: int, q, k, v, rope=None) -> torch.Tensor:
        nd = self._nd
        ks, vs = nd["scales"][layer]
        return nd["step"].layer(layer, q, k, v, nd["lo"][self.window(layer)], ks, vs,
                                nd["recipe"][layer], rope)

    def forward_fused(self, layer: int, inp: QKVInput, meta: AttentionMetadata
                      ) -> torch.Tensor | None:
        """A pure decode step's attention straight from the QKV output (RoPE in the C call);
        None where the C kernel does not take this step (QK-norm, a mixed step). float32 or
        bf16 rows go in as they are; the output comes back in ``inp.out_dtype`` where that is
        float32 or bf16, else in qkv's dtype."""
        nd, qkv = self._nd, inp.qkv
        if nd is None or meta is not nd["meta"] or inp.q_norm is not None or \
                qkv.dtype not in _NATIVE_DTYPES or not qkv.is_contiguous():
            return None
        if nd.get("rope", (None,))[0] is not inp.cos:     # the step's cos/sin: once, not per layer
            nd["rope"] = (inp.cos, inp.cos.float().contiguous(), inp.sin.float().contiguous())
        want = inp.out_dtype or qkv.dtype
        io = want if want in cpu_kernels.IO_DTYPES else torch.float32
        rows = qkv if qkv.dtype in cpu_kernels.IO_DTYPES else qkv.float()
        ks, vs = nd["scales"][layer]
        out = nd["step"].layer_qkv(layer, rows, inp.num_heads, nd["lo"][self.window(layer)], ks,
                                   vs, nd["recipe"][layer], nd["rope"][1:], io)
        return out if out.dtype == want else out.to(want)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        nd = self._nd
        if nd is not None and meta is nd["meta"] and q.dtype in _NATIVE_DTYPES:
            f32 = lambda x: x if x.dtype == torch.float32 and x.stride(-1) == 1 and \
                x.stride(-2) == x.shape[-1] else x.float().contiguous()  # noqa: E731
            return self._native(layer, f32(q), f32(k), f32(v)).to(q.dtype)
        if nd is not None:          # the C kernel declined: plan the torch decode now
            self.plan_torch(meta)
        fd = self._fd
        if fd is None or not fd["pure"] or meta is not fd["meta"]:
            return super().forward(layer, q, k, v, meta)
        # A pure decode step: token b is sequence b's new token, nothing else to attend.
        pages = self.pool.layer(layer)
        ks, vs = fd["gs_list"][layer]
        q, k, v = self._recipe.apply(layer, q, k, v)
        k, v = fresh_kv(k, self.fp8_fresh), fresh_kv(v, self.fp8_fresh)
        self._stored = store_kv_fast(self.layout, pages, k, v, meta.slot_mapping, ks, vs,
                                     fd["slots"])
        out = self._attend(layer, pages, q, ks, vs, self.window(layer), pure=True)
        return self._recipe.finish(layer, out)

    def _store(self, pages, k, v, slot_mapping, ks, vs):
        self._stored = store_kv_fast(self.layout, pages, k, v, slot_mapping, ks, vs)

    def _workspace(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """Layer ``layer``'s dequantized pages ``[2, B, H, M*S, D]`` (K, V) from the current
        chunk, dequantizing the next chunk (from ``layer`` on) when it is not there."""
        if self._chunk is None or layer not in self._chunk[0] or self._chunk[1].dtype != dtype:
            fd, lay = self._fd, self.layout
            b, m = fd["page_ids"].shape
            per_layer = 2 * b * lay.num_kv_heads * m * lay.page_size * lay.head_dim * \
                torch.empty((), dtype=dtype).element_size()
            n = max(1, WORKSPACE_BYTES // per_layer)
            layers = range(layer, min(layer + n, lay.num_layers))
            kv = dequantize_pages(lay, self.pool.pages, fd["page_ids"], layers, fd["gs"], dtype,
                                  self._scratch)
            self._chunk = (layers, kv)
        layers, kv = self._chunk
        return kv[:, layer - layers.start]

    def _attend(self, layer, pages, q, ks, vs, w, pure: bool) -> torch.Tensor:
        """The decode rows' attention ``[B, Hq, D]`` (q: the step's ``[T, Hq, D]``)."""
        fd = self._fd
        kv = self._workspace(layer, q.dtype)
        # The rows this step just stored (stale in the workspace, dequantized before the store).
        if self._stored is not None:
            codes, scales = self._stored
            if not pure:
                codes, scales = codes[:, fd["rows"]], scales[:, fd["rows"]]
            new = dequantize_stored(self.layout, codes, scales, fd["gs"][layer], q.dtype)
        else:
            new = dequantize_rows(self.layout, pages, fd["new_page"], fd["new_off"], ks, vs,
                                  q.dtype)
        kv[:, fd["batch"], :, fd["cached"]] = new.transpose(0, 1)    # [B, 2, H, D]
        _, b, h, _, d = kv.shape
        qq = (q if pure else q[fd["rows"]]).reshape(b, h, -1, d)     # [B, H, G, D]
        o = F.scaled_dot_product_attention(qq, kv[0], kv[1], attn_mask=fd["masks"][w],
                                           scale=self.sm_scale)
        return o.reshape(b, -1, d)

    def _decode(self, layer, pages, q, meta, out, ks, vs, w):
        if self._fd is None:
            super()._decode(layer, pages, q, meta, out, ks, vs, w)
            return
        out[self._fd["rows"]] = self._attend(layer, pages, q, ks, vs, w, pure=False)
