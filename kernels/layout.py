"""The one definition of Nibble's KV page layout (layout version 1).

A *page* holds ``page_size`` consecutive tokens of one sequence for **every
layer**, K and V, codes and scales. The pool is a single uint8 tensor::

    pool[num_pages, num_layers, layer_nbytes]

so page ``p`` is one contiguous run of ``page_nbytes = num_layers *
layer_nbytes`` bytes: one unit to copy between tiers or to describe to a
transport. Inside one layer's slice of a page, sections follow in this order,
each head-major (HND) and 16-byte aligned::

    K data   [H, S, k.data_bytes(D)]
    V data   [H, S, v.data_bytes(D)]
    K scales [H, S, k.scale_bytes(D)]   (absent when 0 bytes)
    V scales [H, S, v.scale_bytes(D)]   (absent when 0 bytes)

with ``H`` KV heads, ``S`` = page_size tokens, ``D`` = head_dim. For NVFP4 and
D = 128 a token-head row is 64 code bytes and 8 scale bytes, so one 8-byte
load fetches a row's scales. Token slot ``s`` of a sequence lives at page
``block_table[s // S]``, offset ``s % S``.

Global scales (FP32, one for K and one for V per layer) live beside the pool
in ``[num_layers, 2]`` with a version number; they are not part of the page
bytes but travel with every page record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from .errors import KernelInputError
from .formats import KVCacheFormat, get_kv_format

ALIGN = 16


class LayerPages(NamedTuple):
    """Views of one layer across all pages (uint8, strided over pages).

    ``k_data``/``v_data``: ``[P, H, S, data_bytes]``; ``k_scale``/``v_scale``:
    ``[P, H, S, scale_bytes]`` or ``None`` for formats without block scales.
    """

    k_data: torch.Tensor
    v_data: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


@dataclass(frozen=True)
class PageLayout:
    """Geometry of a page for one model and one KV cache format."""

    kv_format: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    VERSION: ClassVar[int] = 1

    def __post_init__(self) -> None:
        get_kv_format(self.kv_format)
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise KernelInputError(f"PageLayout.{name} must be > 0")
        if self.head_dim % 16:
            raise KernelInputError(f"head_dim must be a multiple of 16, got {self.head_dim}")
        for name, size, _ in self.sections():
            if size % ALIGN:
                raise KernelInputError(
                    f"section {name} is {size} bytes, not {ALIGN}-aligned; use a larger page_size")

    @property
    def fmt(self) -> KVCacheFormat:
        return get_kv_format(self.kv_format)

    def sections(self) -> list[tuple[str, int, int]]:
        """``(name, nbytes, row_bytes)`` per present section, in storage order."""
        f, hs, d = self.fmt, self.num_kv_heads * self.page_size, self.head_dim
        rows = [("k_data", f.k.data_bytes(d)), ("v_data", f.v.data_bytes(d)),
                ("k_scale", f.k.scale_bytes(d)), ("v_scale", f.v.scale_bytes(d))]
        return [(n, hs * r, r) for n, r in rows if r > 0]

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's slice of one page."""
        return sum(size for _, size, _ in self.sections())

    @property
    def page_nbytes(self) -> int:
        """Bytes of one whole page (all layers)."""
        return self.num_layers * self.layer_nbytes

    @property
    def bytes_per_token(self) -> float:
        """KV bytes per token over all layers, codes and scales included."""
        return self.page_nbytes / self.page_size

    def allocate(self, num_pages: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False) -> torch.Tensor:
        """A zeroed pool ``uint8 [num_pages, num_layers, layer_nbytes]``."""
        return torch.zeros((num_pages, self.num_layers, self.layer_nbytes), dtype=torch.uint8,
                           device=device, pin_memory=pin_memory)

    def check_pool(self, pool: torch.Tensor) -> None:
        if pool.dtype != torch.uint8 or pool.dim() != 3 or pool.shape[1:] != (
                self.num_layers, self.layer_nbytes):
            raise KernelInputError(
                f"pool must be uint8 [P, {self.num_layers}, {self.layer_nbytes}], "
                f"got {pool.dtype} {tuple(pool.shape)}")

    def layer_view(self, pool: torch.Tensor, layer: int) -> LayerPages:
        """Typed views of ``layer`` in ``pool`` (no copy)."""
        self.check_pool(pool)
        if not 0 <= layer < self.num_layers:
            raise KernelInputError(f"layer {layer} out of range [0, {self.num_layers})")
        flat = pool[:, layer]
        views: dict[str, torch.Tensor | None] = {"k_scale": None, "v_scale": None}
        offset = 0
        for name, size, row in self.sections():
            views[name] = flat[:, offset:offset + size].unflatten(
                -1, (self.num_kv_heads, self.page_size, row))
            offset += size
        return LayerPages(**views)
