"""The attention backend interface and its per-step metadata.

The model runner flattens a step's sequences into one token stream of ``T``
tokens and builds one :class:`AttentionMetadata`; every layer's attention call
reuses it. A backend implements three paths:

1. **prefill** (no cached prefix): attend over the fresh K/V, then store pages;
2. **extend** (cached prefix + new chunk): dequantize the prefix into a
   workspace shared by all layers, attend over prefix + chunk, store the chunk;
3. **decode** (one new token): store it, then attend over the pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from nibble.kernels.errors import KernelInputError
from nibble.kernels.nvfp4 import e4m3_round
from nibble.kernels.recipes import RecipeParams

from ..errors import ConfigError
from ..models.base import QKVInput


@dataclass
class AttentionMetadata:
    """Layout of one step's flattened token stream (shared by all layers).

    ``new_lens[b]`` tokens of sequence ``b`` start at ``seq_starts[b]`` in the
    stream; ``cached_lens[b]`` of its tokens were already in pages.
    """

    seq_starts: list[int]            # [B] offset of each sequence's new tokens
    new_lens: list[int]              # [B] tokens run this step
    cached_lens: list[int]           # [B] tokens already stored in pages
    slot_mapping: torch.Tensor       # int64 [T]: page_id * page_size + offset of each new token
    block_tables: torch.Tensor       # int32 [B, M]: page ids per sequence (padded with 0)

    def __post_init__(self) -> None:
        b = len(self.seq_starts)
        if not len(self.new_lens) == len(self.cached_lens) == b == self.block_tables.shape[0]:
            raise KernelInputError("AttentionMetadata lists disagree on the batch size")
        self.prefill = [i for i in range(b) if self.cached_lens[i] == 0]
        self.decode = [i for i in range(b) if self.cached_lens[i] > 0 and self.new_lens[i] == 1]
        self.extend = [i for i in range(b) if self.cached_lens[i] > 0 and self.new_lens[i] > 1]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(ABC):
    """Stores each layer's new K/V as pages and computes attention."""

    name: str = ""
    # Sliding-window attention (Gemma 3): per layer, None = full attention; () = every layer full.
    supports_sliding_window: bool = False
    sliding_windows: tuple[int | None, ...] = ()

    def set_sliding_windows(self, windows: Sequence[int | None]) -> None:
        """Give layer ``l`` a window: a token at position ``p`` sees positions ``> p - windows[l]``.

        Raises:
            ConfigError: a window is set and this backend has no sliding-window attention.
        """
        windows = tuple(windows)
        if any(w is not None for w in windows) and not self.supports_sliding_window:
            raise ConfigError(f"the {self.name!r} attention backend has no sliding-window attention")
        self.sliding_windows = windows

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens, or None (full attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare per-step state (gather indices, the shared workspace) once per step."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v`` ``[T, H, D]`` (RoPE applied) -> ``[T, Hq, D]`` in q's dtype."""

    def forward_fused(self, layer: int, inp: QKVInput, meta: AttentionMetadata
                      ) -> torch.Tensor | None:
        """Attention from the QKV projection's output (``inp``, see
        :class:`~nibble.services.models.base.QKVInput`) -> ``[T, Hq, D]``, or None where this
        backend does not fuse this step (the model then computes q, k, v and calls
        :meth:`forward`). The default fuses nothing."""
        return None

    def bind(self, meta: AttentionMetadata) -> "BoundAttention":
        """The model's attention callable for one step (``AttentionFn``, with ``fused``)."""
        return BoundAttention(self, meta)

    # CUDA graphs (services/engine/cuda_graph.py): a backend that can be captured sets
    # supports_cuda_graph and implements the two methods below.
    supports_cuda_graph: bool = False

    def bind_decode_graph(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          slots: torch.Tensor, max_seq_len: int) -> AttentionMetadata:
        """Point the decode state at static device buffers (all ``B`` rows decode).

        ``block_tables`` int32 ``[B, M]``, ``seq_lens`` int32 ``[B]`` (cached + 1),
        ``slots`` int64 ``[B]`` (-1 = padding, not stored); ``max_seq_len`` fixes the
        split-K grid. Returns the metadata to pass to :meth:`forward`. No host sync.
        """
        raise NotImplementedError(f"the {self.name!r} backend does not support CUDA graphs")

    def prepare_graph_replay(self) -> None:
        """Refresh per-step device state in place (e.g. global scales) before a replay."""

    def warm_prefill(self, num_q_heads: int, dtype: torch.dtype, max_chunk: int,
                     context: int, qk_norm: bool = False) -> int:
        """Prepare the prefill/extend kernels for chunks of up to ``max_chunk`` rows over up
        to ``context`` keys at server start (``qk_norm``: the model normalizes q and k per
        head); returns the attention shapes prepared (none here)."""
        return 0


class BoundAttention:
    """A backend and one step's metadata as the model's ``AttentionFn``."""

    def __init__(self, backend: AttentionBackend, meta: AttentionMetadata):
        self.backend, self.meta = backend, meta
        # every sequence decodes one token (models/base.is_decode_step)
        self.decode_only = not meta.prefill and not meta.extend

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.meta)

    def fused(self, layer: int, inp: QKVInput) -> torch.Tensor | None:
        return self.backend.forward_fused(layer, inp, self.meta)


class RecipeHook:
    """Applies the pool's calibrated K recipe (``kernels.recipes.RecipeParams``) in a backend.

    ``apply`` at the top of ``forward`` transforms q, K (and V) before the store
    and before every attention path (prefill, extend, decode), so every key a
    query sees carries the same shift; ``finish`` adds the V shift back to the
    output. Formats without a recipe pass through. For a format with one, the
    device tensors are allocated once (identity until the pool is calibrated)
    and updated in place when the pool's parameters change, so captured CUDA
    graphs always read the current ones.
    """

    def __init__(self, pool, device: torch.device | None = None):
        self.pool = pool
        self.recipe = pool.layout.fmt.k_recipe
        self._src = self._dev = self._identity = None
        self._cast: dict[torch.dtype, RecipeParams] = {}
        if device is not None and (device.type != "cuda" or torch.cuda.is_available()):
            self._sync(torch.empty(0, device=device).device)      # before any graph capture

    def _sync(self, device: torch.device):
        if self.recipe is None:
            return None
        p = getattr(self.pool, "recipe_params", None)     # duck-typed pools may lack it
        if p is None:
            p = self._identity
            if p is None:               # built once: rebuilding it cost every layer a copy
                lay = self.pool.layout
                p = self._identity = RecipeParams.identity(self.recipe, lay.num_layers,
                                                           lay.num_kv_heads, lay.head_dim)
        if self._dev is None or self._dev.k_shift.device != device:
            self._src, self._dev = p, p.to(device)
        elif p is not self._src and p.digest != self._dev.digest:
            self._dev.load_(p)
            self._src = p
        return self._dev

    def _params(self, q: torch.Tensor):
        """The parameters on q's device in q's dtype (a cached copy kept in step with them)."""
        p = self._sync(q.device)
        if p is None or q.dtype == torch.float32:
            return p
        return self._cast_of(p, q.dtype)

    def _cast_of(self, p, dtype: torch.dtype):
        """``p`` (the device copy) in ``dtype``: a cached copy, reloaded when ``p`` changes."""
        cast = self._cast.get(dtype)
        if cast is None:
            cast = self._cast[dtype] = p.to(p.k_shift.device, dtype)
        elif cast.digest != p.digest:
            cast.load_(p)
        return cast

    def apply(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``q [T, Hq, D]``, ``k``/``v`` ``[T, H, D]`` -> transformed, computed in q's dtype
        (k and v are cast to it first; the store quantizes from there)."""
        p = self._params(q)
        if p is None:
            return q, k, v
        return p.apply(layer, q, k.to(q.dtype), v.to(q.dtype))

    def layer_params(self, layer: int, device: torch.device) -> dict[str, torch.Tensor | None]:
        """Layer ``layer``'s parameters on ``device`` (with its index, e.g. a tensor's
        ``.device``: ``cuda`` alone would not match ``cuda:0`` and copy them again, which a
        CUDA graph capture refuses) as fused kernels take them: fp32 ``k_shift``/``v_shift``
        ``[H, D]`` and ``k_map``/``q_map`` ``[H, D, D]`` (None: absent), the maps in bf16 on
        a GPU, where the kernels' MMAs round them to bf16 anyway (the same values, half the
        bytes read per step). Views of tensors kept current, so graphs read the current ones.
        """
        p = self._sync(device)
        if p is None:
            return dict(k_shift=None, k_map=None, q_map=None, v_shift=None)
        maps = self._cast_of(p, torch.bfloat16) if device.type == "cuda" else p
        pick = lambda t: None if t is None else t[layer]  # noqa: E731
        return dict(k_shift=pick(p.k_shift), k_map=pick(maps.k_map), q_map=pick(maps.q_map),
                    v_shift=pick(p.v_shift))

    def finish(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, Hq, D]`` -> with the V shift added back (if the recipe has one)."""
        if self._dev is None or self._dev.v_shift is None:
            return out
        return self._params(out).finish(layer, out)


def fresh_kv(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Fresh K/V as prefill attends over them: ``--prefill-kv-dtype fp8_e4m3`` casts them to
    float8_e4m3fn (RNE, saturating, as SGLang's recipe does) and they are quantized from there."""
    return e4m3_round(x.float()) if fp8 else x


ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str):
    """Class decorator: register an attention backend under ``name``."""
    def deco(cls):
        if name in ATTENTION_BACKENDS:
            raise KernelInputError(f"attention backend {name!r} already registered")
        cls.name = name
        ATTENTION_BACKENDS[name] = cls
        return cls
    return deco
