"""The device KV pool (tier L1): one page tensor, global scales, an allocator.

The pool's bytes are written by the attention backends (new K/V), the tier
manager (loads from L2, write-back) and KV transports; everything else holds
page ids. Allocation and freeing go through ``KVCacheManager`` once one owns
the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nibble.kernels import KernelInputError, LayerPages, PageLayout
from nibble.kernels.recipes import RecipeParams

from .allocator import PageAllocator, PageId
from .errors import CacheStateError


@dataclass(frozen=True)
class PoolCapacity:
    """What the pool holds, for logs and /get_server_info."""

    kv_format: str
    page_size: int
    num_pages: int
    max_tokens: int
    bytes_per_token: float
    pool_bytes: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def pages_for_budget(layout: PageLayout, budget_bytes: int) -> int:
    """How many whole pages fit in ``budget_bytes``."""
    return max(0, int(budget_bytes) // layout.page_nbytes)


class KVPool:
    """Pages of every layer for one model, with their per-layer global scales.

    ``pages``: uint8 ``[num_pages, num_layers, layer_nbytes]`` (see kernels.layout).
    ``global_scales``: float32 ``[num_layers, 2]`` (K, V); ``scale_version``
    increases whenever they change, and travels with every stored page.
    ``recipe_params``: the calibrated K-recipe parameters of a format that has a
    recipe (``kernels.recipes.RecipeParams``), or None (stored K is not
    transformed); their ``recipe_digest`` travels with every stored page and
    namespaces the content keys, like the format itself.
    """

    def __init__(self, layout: PageLayout, num_pages: int, device: torch.device | str = "cpu"):
        self.layout = layout
        self.device = torch.device(device)
        self.pages = layout.allocate(num_pages, self.device)
        self.global_scales = torch.ones((layout.num_layers, 2), dtype=torch.float32)
        self.scale_version = 0
        self.recipe_params: RecipeParams | None = None
        self.allocator = PageAllocator(num_pages)
        self._views = [layout.layer_view(self.pages, i) for i in range(layout.num_layers)]
        self._before_reuse: Callable[[list[PageId]], None] | None = None

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def layer(self, layer: int) -> LayerPages:
        return self._views[layer]

    def scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of ``layer`` as Python floats."""
        k, v = self.global_scales[layer].tolist()
        return k, v

    def set_global_scales(self, scales: torch.Tensor) -> None:
        """Replace the per-layer scales (only valid while no page is in use)."""
        if self.allocator.num_used:
            raise CacheStateError("global scales can only change while the pool is empty")
        self.global_scales = scales.to(torch.float32).clone()
        self.scale_version += 1

    @property
    def recipe_digest(self) -> str:
        """The K-recipe parameters' digest, or "" (none: plain formats, or not calibrated)."""
        return "" if self.recipe_params is None else self.recipe_params.digest

    def set_recipe_params(self, params: RecipeParams) -> None:
        """Install calibrated K-recipe parameters (only valid while no page is in use).

        Raises:
            KernelInputError: the format has no recipe, or another one, or the
                parameters do not fit the layout.
        """
        if self.allocator.num_used:
            raise CacheStateError("K recipe parameters can only change while the pool is empty")
        lay = self.layout
        if lay.fmt.k_recipe is None or params.recipe != lay.fmt.k_recipe:
            raise KernelInputError(f"parameters of recipe {params.recipe} do not belong to KV "
                                   f"format {lay.kv_format!r} (recipe {lay.fmt.k_recipe})")
        if params.shape != (lay.num_layers, lay.num_kv_heads, lay.head_dim):
            raise KernelInputError(f"K recipe parameters {params.shape} do not fit the layout "
                                   f"{(lay.num_layers, lay.num_kv_heads, lay.head_dim)}")
        self.recipe_params = params

    def capacity(self) -> PoolCapacity:
        lay = self.layout
        return PoolCapacity(lay.kv_format, lay.page_size, self.num_pages,
                            self.num_pages * lay.page_size, lay.bytes_per_token,
                            self.num_pages * lay.page_nbytes)

    def set_reuse_hook(self, fn: Callable[[list[PageId]], None] | None) -> None:
        """Call ``fn(pages)`` with every list of pages ``allocate`` hands out, before the
        caller writes them: the one place cached pages are evicted as they are reused.

        One owner, not a chain: a bare ``RadixCache`` over the pool sets its lazy
        eviction here; a ``KVCacheManager`` takes the slot over (its ``_before_reuse``
        drops the pages from the tree, then has the tier manager write back what its
        policy keeps, in that explicit order).
        """
        self._before_reuse = fn

    def allocate(self, n: int) -> list[PageId]:
        pages = self.allocator.allocate(n)
        if self._before_reuse is not None:
            self._before_reuse(pages)
        return pages

    def allocate_runs(self, n: int, slack: float = 1.0) -> list[PageId]:
        """``allocate`` as few ascending runs of page ids (``PageAllocator.allocate_runs``)."""
        pages = self.allocator.allocate_runs(n, slack)
        if self._before_reuse is not None:
            self._before_reuse(pages)
        return pages

    def free(self, pages: list[PageId]) -> None:
        self.allocator.free(pages)
