"""Attention backend on the portable Triton paged-KV kernels (GPU; CPU via the interpreter).

Per step, :meth:`TritonAttentionBackend.plan` moves everything the kernels index
to the device once (slot mapping, the decode and extend block tables and
lengths, the extend masks) and allocates the extend workspace; every layer's
:meth:`~TritonAttentionBackend.forward` then launches without a host sync:

* **store**: one :func:`~nibble.kernels.triton.store_kv` launch per layer for all
  new tokens of the step;
* **prefill and extend**: one :func:`~nibble.kernels.triton.gather_kv` launch per
  layer dequantizes every extend sequence's prefix into the shared workspace, the
  chunks' fresh K/V are copied after each prefix, then one ragged causal attention
  (:func:`~nibble.kernels.ragged.ragged_causal_attention`: FlashAttention varlen on
  CUDA, bottom-right causal, grouped KV heads, no mask) covers every sequence;
* **fused step** (:meth:`~TritonAttentionBackend.forward_fused`, where the model hands
  over the QKV projection's output): one :func:`~nibble.kernels.triton.qkv_rope_store`
  launch does QK-norm, RoPE, the K recipe and the store, and for prefill and extend rows
  also writes the transformed fresh K/V that the ragged attention reads; then the
  attention below (``--disable-fused-kernels`` turns it off);
* **decode**: one fused split-K paged-decode launch (plus its reduce) per layer
  for all decode sequences: the register-level Hopper kernel
  :func:`~nibble.kernels.cuda.decode_attention_cuda` where it applies
  (``decode_impl == "cuda-sm90"``), else the portable
  :func:`~nibble.kernels.triton.decode_attention` (``"triton"``); chosen once at
  construction by :mod:`.decode_select` (``--decode-kernel`` overrides).

Global scales live on the device as one-element fp32 views of a ``[L, 2]``
tensor, refreshed in ``plan`` only when the pool's ``scale_version`` changes.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
import triton

from nibble.kernels import PageLayout
from nibble.kernels.cuda import decode_attention_cuda, default_variant, store_kv_nvfp4_cuda
from nibble.kernels.cuda import default_num_splits as cuda_num_splits
from nibble.kernels.cuda.store import unsupported_reason as cuda_store_reason
from nibble.kernels.ragged import CUDNN_AUTO_MIN_ROWS, choose_kernel
from nibble.kernels.ragged_cudnn import cudnn_available, warm_plans
from nibble.kernels.triton import (decode_attention, default_num_splits, gather_kv,
                                   qkv_rope_store, store_kv)
from nibble.kernels.triton._common import FORMAT_CODES
from nibble.kernels.triton.qkv import LONG_INPUT, warm_long_inputs
from nibble.tiering import KVPool

from ..errors import ConfigError
from ..host_copy import ints_to_device, to_device
from ..models.base import QKVInput
from .base import AttentionBackend, AttentionMetadata, RecipeHook, fresh_kv, register_backend
from .decode_select import (CUDA_SM90, DecodeChoice, confirm_group, select_decode_impl,
                            select_store_impl)
from .ragged_plan import RaggedPlan

if TYPE_CHECKING:
    from ..config import DeviceConfig

DECODE_HEAD_DIMS = (64, 128, 256)
log = logging.getLogger(__name__)
# cuDNN plans are built at start for chunks up to this many rows (bigger ones amortize theirs)
WARM_MAX_CHUNK = 4096
MIN_WORKSPACE_ROWS = 4096       # smallest kept extend workspace, rows (see _alloc_workspace)


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter is chosen when a kernel is decorated, so the variable must be
    set before ``nibble.kernels.triton`` is first imported.
    """
    return bool(triton.knobs.runtime.interpret)


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """Args:
        pool: the KV pool (L1); the kernels run on ``pool.device``.
        sm_scale: softmax scale (usually head_dim ** -0.5).
        prefill_kv_dtype: "auto" or "fp8_e4m3" (fresh K/V and the extend
            workspace are cast to FP8 E4M3 first, as in the torch backend).
        num_q_heads: the model's query heads, if known; else the GQA group is
            checked at the first decode (a group the CUDA kernel lacks falls
            back to Triton there, with a warning).
        device_cfg: the device slice; its ``decode_kernel`` and ``store_kernel``
            (auto|triton|cuda) pick the kernels (None: both auto), and
            ``disable_fused_kernels`` turns :meth:`forward_fused` off, and ``disable_pdl``
            the decode kernel's programmatic dependent launch.

    Attributes:
        decode_impl: "cuda-sm90" or "triton", the decode kernel (see :mod:`.decode_select`).

    Raises:
        ConfigError: where :meth:`unsupported_reason` finds a reason, or
            ``--decode-kernel``/``--store-kernel`` force a CUDA kernel that cannot run.
    """

    def __init__(self, pool: KVPool, sm_scale: float, prefill_kv_dtype: str = "auto",
                 num_q_heads: int | None = None, device_cfg: DeviceConfig | None = None):
        reason = self.unsupported_reason(pool.layout, pool.device)
        if reason is not None:
            raise ConfigError(reason)
        decode_kernel, store_kernel = ("auto", "auto") if device_cfg is None else \
            (device_cfg.decode_kernel, device_cfg.store_kernel)
        self.fused = device_cfg is None or not device_cfg.disable_fused_kernels
        self.pdl = device_cfg is None or not device_cfg.disable_pdl
        self.ragged_kernel = "auto" if device_cfg is None else device_cfg.prefill_attention_kernel
        if self.ragged_kernel == "cudnn" and not cudnn_available(pool.device):
            raise ConfigError("--prefill-attention-kernel cudnn needs CUDA with cuDNN >= 9")
        self.layout = pool.layout
        self.store_impl = select_store_impl(pool.layout, pool.device, store_kernel)
        self._set_decode(select_decode_impl(pool.layout, pool.device, num_q_heads, decode_kernel))
        self._group_checked = num_q_heads is not None
        log.info("decode kernel: %s (%s); store kernel: %s", self.decode_impl,
                 self._decode_choice.why, self.store_impl)
        self.pool = pool
        self.layout = pool.layout
        self.device = pool.device
        self.sm_scale = sm_scale
        self.fp8_fresh = prefill_kv_dtype == "fp8_e4m3"
        self._scale_version: int | None = None
        self._scales: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._gs: torch.Tensor | None = None                  # fp32 [L, 2] (k, v) global scales
        self._compute_dtype: torch.dtype | None = None   # learned from the first q
        self._ws: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ws_store: tuple[torch.Tensor, torch.Tensor] | None = None   # kept across steps
        self._ragged: RaggedPlan | None = None
        self._recipe = RecipeHook(pool, pool.device)     # the format's calibrated K recipe

    def _store(self, pages, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor,
               vs: torch.Tensor) -> None:
        """Quantize and store this step's K/V: the CUDA kernel where it takes them, else Triton."""
        if self.store_impl == CUDA_SM90 and cuda_store_reason(self.layout, k, v) is None:
            store_kv_nvfp4_cuda(self.layout, pages, k, v, self._slots, ks, vs)
        else:
            store_kv(self.layout, pages, k, v, self._slots, ks, vs)

    def _set_decode(self, choice: DecodeChoice) -> None:
        self._decode_choice = choice
        self.decode_impl = choice.impl
        if choice.impl == CUDA_SM90:
            variant = default_variant(self.layout)
            self._decode_fn = functools.partial(decode_attention_cuda, variant=variant)
            self._splits_fn = functools.partial(cuda_num_splits, variant=variant)
        else:
            self._decode_fn, self._splits_fn = decode_attention, default_num_splits

    @staticmethod
    def unsupported_reason(layout: PageLayout, device: torch.device) -> str | None:
        """Why the kernels cannot serve ``layout`` on ``device``, or None if they can."""
        if device.type == "cpu" and not _interpreting():
            return ("the triton attention backend on CPU needs Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before start-up (it is slow; for tests), or use "
                    "--attention-backend torch")
        if device.type not in ("cpu", "cuda"):
            return f"the triton attention backend does not run on {device.type!r} devices"
        if layout.fmt.k.name not in FORMAT_CODES or layout.fmt.v.name not in FORMAT_CODES:
            return f"no Triton kernels for KV format {layout.kv_format!r}"
        if layout.head_dim not in DECODE_HEAD_DIMS:
            return (f"the Triton decode kernel supports head_dim {DECODE_HEAD_DIMS}, the model "
                    f"has {layout.head_dim}")
        return None

    # ------------------------------------------------------------------ per step

    def plan(self, meta: AttentionMetadata) -> None:
        """Move this step's indices to the device and allocate the extend workspace, without
        waiting for the device (``host_copy.to_device``: the step before may still run).

        Builds: ``_slots`` int64 ``[T]``; for decode ``_dec_bt`` int32 ``[Bd, M]``,
        ``_dec_lens`` int32 ``[Bd]`` (cached + 1), ``_dec_rows`` int64 ``[Bd]``
        (their rows in the token stream); for prefill and extend one
        :class:`~.ragged_plan.RaggedPlan`.
        """
        dev = self.device
        self._refresh_scales()
        self._slots = to_device(meta.slot_mapping, dev)
        bt = meta.block_tables
        self._plan_decode(meta, bt)
        self._ragged = RaggedPlan.build(meta, bt, dev)
        self._ws = None
        if self._ragged is not None and self._ragged.prefix_bt is not None \
                and self._compute_dtype is not None:
            self._ws = self._alloc_workspace(self._compute_dtype)

    def _plan_decode(self, meta: AttentionMetadata, bt: torch.Tensor) -> None:
        self._dec = bool(meta.decode)
        if not self._dec:
            return
        dev = self.device
        idx = meta.decode
        lens = [meta.cached_lens[b] + 1 for b in idx]
        # Every sequence decodes: the token stream is the decode batch, in order.
        self._dec_direct = len(idx) == len(meta.seq_starts) and meta.num_tokens == len(idx)
        self._dec_rows = ints_to_device([meta.seq_starts[b] for b in idx], dev)
        self._dec_bt = to_device(bt[idx], dev)           # bt: int32 on the host
        self._dec_lens = ints_to_device(lens, dev, torch.int32)
        self._dec_shape = (len(idx), self.layout.num_kv_heads, max(lens))
        self._dec_splits = self._splits_fn(*self._dec_shape, dev)

    def _refresh_scales(self) -> None:
        """Per-layer (k, v) global scales as one-element fp32 device views.

        Updated in place after the first call, so captured CUDA graphs keep reading them.
        """
        if self._scale_version == self.pool.scale_version and self._scales:
            return
        gs = self.pool.global_scales.to(device=self.device, dtype=torch.float32)
        if self._gs is None or self._gs.shape != gs.shape:
            self._gs = gs.contiguous().clone()
            self._scales = [(self._gs[i, 0:1], self._gs[i, 1:2]) for i in range(gs.shape[0])]
        else:
            self._gs.copy_(gs)
        self._scale_version = self.pool.scale_version

    # ------------------------------------------------------------------ CUDA graphs

    supports_cuda_graph = True

    def bind_decode_graph(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          slots: torch.Tensor, max_seq_len: int) -> AttentionMetadata:
        """Decode every row of the static buffers (see the base class); no host sync."""
        b = int(block_tables.shape[0])
        self._refresh_scales()
        self._slots = slots
        self._dec, self._dec_direct = True, True
        self._ragged = None
        self._dec_bt, self._dec_lens = block_tables, seq_lens
        self._dec_shape = (b, self.layout.num_kv_heads, max_seq_len)
        self._dec_splits = self._splits_fn(*self._dec_shape, self.device)
        self._ws = None
        return AttentionMetadata(list(range(b)), [1] * b, [1] * b, slots, block_tables)

    def prepare_graph_replay(self) -> None:
        self._refresh_scales()

    def _alloc_workspace(self, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's extend workspace ``(k, v)``, each ``[sum(prefix + chunk lens), H, D]``.

        Views of two buffers kept across steps, grown to the next power of two of rows
        (at least :data:`MIN_WORKSPACE_ROWS`): a new size every chunk would send the
        caching allocator to ``cudaMalloc`` (and, near the memory limit, to freeing its
        cache and retrying) inside a step."""
        dtype = torch.float8_e4m3fn if self.fp8_fresh else compute_dtype
        rows = self._ragged.num_k
        kept = self._ws_store
        if kept is None or kept[0].dtype != dtype or kept[0].shape[0] < rows:
            cap = max(MIN_WORKSPACE_ROWS, 1 << (rows - 1).bit_length())
            self._ws_store = None                      # free the old pair before the new one
            shape = (cap, self.layout.num_kv_heads, self.layout.head_dim)
            kept = (torch.empty(shape, dtype=dtype, device=self.device),
                    torch.empty(shape, dtype=dtype, device=self.device))
            self._ws_store = kept
        return kept[0][:rows], kept[1][:rows]

    # ------------------------------------------------------------------ per layer

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v`` ``[T, H, D]`` on the pool's device -> ``[T, Hq, D]``.

        Stores the step's new K/V first, so decode reads its own token from the pages.
        """
        pages = self.pool.layer(layer)
        ks, vs = self._scales[layer]
        q, k, v = self._recipe.apply(layer, q, k, v)
        k, v = fresh_kv(k, self.fp8_fresh), fresh_kv(v, self.fp8_fresh)
        self._store(pages, k, v, ks, vs)
        out = torch.empty_like(q)
        if self._ragged is not None:
            self._prefill_extend(pages, q, k.to(q.dtype), v.to(q.dtype), out, ks, vs)
        if self._dec:
            self._decode(pages, q, out, ks, vs)
        return self._recipe.finish(layer, out)

    def _fresh_prompts_only(self) -> bool:
        """Every row of the step is a prompt's, from its first token: no cached prefix, no
        decode rows. Such a step attends over its own fresh keys alone, which it may take
        before the recipe's map: ``q . (k - c)`` is ``q' . K'`` with ``K' = (k - c) M`` and
        ``q' = q M^-T``, so the query map is not needed (``qkv_rope_store(unmapped_kv_out=)``)."""
        return self._ragged is not None and self._ragged.prefix_bt is None and not self._dec

    def forward_fused(self, layer: int, inp: QKVInput, meta: AttentionMetadata
                      ) -> torch.Tensor | None:
        """Any step from the QKV output: one launch transforms q, K and V (QK-norm, RoPE, the
        K recipe) and stores K/V (for prefill and extend rows it also hands back K' and V',
        the fresh keys of the ragged attention, or for fresh prompts alone K before the map),
        then the attention; ``[T, Hq, D]``. None
        with ``--prefill-kv-dtype fp8_e4m3`` (K/V are stored from FP8 there) or with fused
        kernels off."""
        if not self.fused or self.fp8_fresh:
            return None
        pages = self.pool.layer(layer)
        ks, vs = self._scales[layer]
        kv_out = {}
        if self._ragged is not None:
            shape = (inp.qkv.shape[0], self.layout.num_kv_heads, self.layout.head_dim)
            kv_out = {name: torch.empty(shape, dtype=inp.qkv.dtype, device=inp.qkv.device)
                      for name in ("k_out", "v_out")}
        params = self._recipe.layer_params(layer, inp.qkv.device)
        # fresh prompts alone: no query map (the largest part of the recipe's cost here)
        unmapped = self._fresh_prompts_only() and params["q_map"] is not None
        if unmapped:
            params = {**params, "q_map": None}
        # a decode-only step: the CUDA decode kernel follows the QKV kernel as its
        # programmatic dependent (nothing runs between them; it reads only q and each
        # sequence's newest token from what the QKV kernel writes)
        pdl = (self.pdl and self.decode_impl == CUDA_SM90 and self._dec and self._dec_direct
               and not kv_out)
        q = qkv_rope_store(self.layout, pages, inp.qkv, inp.num_heads, inp.cos, inp.sin,
                           self._slots, ks, vs, inp.q_norm, inp.k_norm, inp.eps, **params,
                           **kv_out, unmapped_kv_out=unmapped, pdl_trigger=pdl)
        out = torch.empty_like(q)
        if kv_out:
            self._prefill_extend(pages, q, kv_out["k_out"], kv_out["v_out"], out, ks, vs)
        if self._dec:
            self._decode(pages, q, out, ks, vs, pdl)
        return self._recipe.finish(layer, out)

    def _prefill_extend(self, pages, q, k, v, out, ks, vs) -> None:
        """Every prefill and extend sequence in one ragged causal attention: the cached
        prefixes are dequantized into the workspace in one launch, the chunks' fresh K/V
        follow them there (see :class:`~.ragged_plan.RaggedPlan`)."""
        plan = self._ragged
        if plan.prefix_bt is not None and (self._ws is None or self._compute_dtype != q.dtype):
            # First step only: the compute dtype was not known at plan time.
            self._compute_dtype = q.dtype
            self._ws = self._alloc_workspace(q.dtype)

        def gather(bt, lens, starts, ws):
            gather_kv(self.layout, pages, bt, lens, ks, vs, ws[0].dtype, cu_seqlens=starts,
                      out=ws)

        plan.attend(q, k, v, out, self.sm_scale, gather, self._ws, self.ragged_kernel)

    def warm_prefill(self, num_q_heads: int, dtype: torch.dtype, max_chunk: int,
                     context: int, qk_norm: bool = False) -> int:
        """Compiles the fused QKV kernel's prompt-sized variants (``warm_long_inputs``) and
        builds cuDNN's execution plans for the bucketed chunk shapes when the prefill
        attention takes cuDNN (a plan costs 65-130 ms the first time a shape is seen)."""
        if self.fused and not self.fp8_fresh and self.device.type == "cuda" and \
                max_chunk >= LONG_INPUT:
            self._refresh_scales()
            ks, vs = self._scales[0]
            warm_long_inputs(self.layout, self.pool.layer(0), num_q_heads, dtype, qk_norm,
                             self._recipe.layer_params(0, self.device), ks, vs, self.device)
        probe = torch.empty(CUDNN_AUTO_MIN_ROWS, num_q_heads, self.layout.head_dim, dtype=dtype,
                            device=self.device)
        if choose_kernel(probe, 1, self.ragged_kernel) != "cudnn":
            return 0
        return warm_plans(num_q_heads, self.layout.num_kv_heads, self.layout.head_dim, dtype,
                          self.device, min(max_chunk, WARM_MAX_CHUNK), context)

    def _check_group(self, num_q_heads: int) -> None:
        """First decode without ``num_q_heads``: fall back to Triton for a group > 8."""
        self._group_checked = True
        choice = confirm_group(self._decode_choice, num_q_heads, self.layout.num_kv_heads)
        if choice is not self._decode_choice:
            log.warning("decode kernel: %s instead of %s (%s)", choice.impl, self.decode_impl,
                        choice.why)
            self._set_decode(choice)
            self._dec_splits = self._splits_fn(*self._dec_shape, self.device)

    def _decode(self, pages, q, out, ks, vs, pdl: bool = False) -> None:
        """One fused paged-decode launch for every decode sequence of the step (``pdl``: as
        the programmatic dependent of the QKV kernel just launched; CUDA kernel only)."""
        if not self._group_checked:
            self._check_group(q.shape[1])
        if self._dec_direct:
            extra = {}
            if self.decode_impl == CUDA_SM90 and pdl:
                extra["pdl"] = True
            self._decode_fn(self.layout, pages, q, self._dec_bt, self._dec_lens, self.sm_scale,
                            ks, vs, out=out, num_splits=self._dec_splits, **extra)
            return
        qd = q.index_select(0, self._dec_rows)
        od = self._decode_fn(self.layout, pages, qd, self._dec_bt, self._dec_lens,
                             self.sm_scale, ks, vs, num_splits=self._dec_splits)
        out.index_copy_(0, self._dec_rows, od)
