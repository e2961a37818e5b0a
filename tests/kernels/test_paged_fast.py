"""The vectorized decode-path kernels against the torch references, bit for bit.

Every registered KV format (the experimental recipe variants included): the fast
store writes the reference's bytes; the page and row dequantizers return the
reference's values for the formats they serve and refuse the others.
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import (KernelInputError, NonFiniteInputError, PageLayout, gather_rows_ref,
                            kv_format_names, quantize_nvfp4, store_kv_ref)
from nibble.kernels.nvfp4 import E2M1_VALUES
from nibble.kernels.paged_fast import (FAST_ELEMENTS, dequantize_pages, dequantize_rows,
                                       dequantize_stored, quantize_nvfp4_stacked, split_slots,
                                       store_kv_fast, supports_layout)
from nibble.tiering import KVPool

ALL_FORMATS = kv_format_names(experimental=True)
FAST_FORMATS = [f for f in ALL_FORMATS if supports_layout(PageLayout(f, 1, 1, 16, 16))]
L, H, D, S, P = 3, 2, 32, 4, 12
SCALES = torch.tensor([[0.7, 1.9], [0.05, 0.02], [1.0, 3.0]])


def edge_values(shape, g: torch.Generator) -> torch.Tensor:
    """Random values spanning 16 decades, with exact zeros, negative zeros, every E2M1 tie
    point (midpoints between grid values, scaled so a block's amax is 6) and huge values."""
    x = torch.randn(shape, generator=g) * torch.logspace(-10, 5, shape[-1])[torch.randperm(
        shape[-1], generator=g)]
    flat = x.view(-1, shape[-1])
    grid = torch.tensor(E2M1_VALUES)
    ties = torch.cat([(grid[1:] + grid[:-1]) / 2, grid])              # 15 values, all <= 6
    flat[0, :16] = torch.cat([ties, torch.tensor([6.0])]) * torch.where(
        torch.arange(16) % 2 == 0, 1.0, -1.0)
    flat[1, :16] = 0.0
    flat[2, :16] = -0.0
    flat[3, :16] = 1e-30                                              # scale underflows to 0
    flat[4, :16] = 1e30                                               # saturating scale
    return x


def test_stacked_quantize_is_bit_identical_per_slice():
    g = torch.Generator().manual_seed(0)
    x = edge_values((2, 9, H, 64), g)
    gs = (1.0, 0.013)
    codes, scales = quantize_nvfp4_stacked(x, gs)
    for i in range(2):
        rc, rs = quantize_nvfp4(x[i], gs[i])
        assert torch.equal(codes[i], rc) and torch.equal(scales[i], rs)


def test_stacked_quantize_rejects_bad_input():
    x = torch.randn(2, 3, 16)
    with pytest.raises(NonFiniteInputError):
        quantize_nvfp4_stacked(torch.where(x > 1, float("nan"), x), (1.0, 1.0))
    for bad in ((1.0, 0.0), (1.0, float("inf")), (1.0,)):
        with pytest.raises(KernelInputError):
            quantize_nvfp4_stacked(x, bad)
    with pytest.raises(KernelInputError):
        quantize_nvfp4_stacked(torch.randn(2, 3, 12), (1.0, 1.0))


def filled_pools(kv: str, seed: int = 0) -> tuple[KVPool, KVPool, torch.Tensor]:
    """Two pools of format ``kv`` written with the same edge values, one by the reference and
    one by ``store_kv_fast`` (every slot of every layer), and the slots written."""
    layout = PageLayout(kv, num_layers=L, num_kv_heads=H, head_dim=D, page_size=S)
    g = torch.Generator().manual_seed(seed)
    pools = KVPool(layout, P), KVPool(layout, P)
    slots = torch.randperm(P * S, generator=g)
    for pool in pools:
        pool.set_global_scales(SCALES)
    for layer in range(L):
        k, v = edge_values((P * S, H, D), g), edge_values((P * S, H, D), g)
        store_kv_ref(layout, pools[0].layer(layer), k, v, slots, *pools[0].scales(layer))
        pages = pools[1].layer(layer)
        split = split_slots(layout, pages, slots) if layer % 2 else None   # both call forms
        stored = store_kv_fast(layout, pages, k, v, slots, *pools[1].scales(layer), split)
        if stored is not None:           # plain NVFP4: what the store returns reads back
            got = dequantize_stored(layout, *stored, pools[1].global_scales[layer],
                                    torch.float32)
            want = gather_rows_ref(layout, pages, *split_slots(layout, pages, slots),
                                   *pools[1].scales(layer), torch.float32)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    return pools[0], pools[1], slots


@pytest.mark.parametrize("kv", ALL_FORMATS)
def test_fast_store_writes_the_reference_bytes(kv):
    ref, got, _ = filled_pools(kv)
    assert torch.equal(got.pages, ref.pages)


@pytest.mark.parametrize("kv", ["nvfp4", "bf16", "fp8_e4m3"])
def test_fast_store_rejects_non_finite_before_writing(kv):
    _, pool, _ = filled_pools(kv)
    before = pool.pages.clone()
    k = torch.randn(2, H, D)
    k[1, 0, 3] = float("inf")
    with pytest.raises(NonFiniteInputError):
        store_kv_fast(pool.layout, pool.layer(0), k, torch.randn(2, H, D),
                      torch.tensor([0, 5]), 1.0, 1.0)
    assert torch.equal(pool.pages, before)
    with pytest.raises(KernelInputError):
        store_kv_fast(pool.layout, pool.layer(0), k[:, :1], k[:, :1], torch.tensor([0, 5]),
                      1.0, 1.0)
    with pytest.raises(KernelInputError, match="outside the pool"):
        store_kv_fast(pool.layout, pool.layer(0), k, k, torch.tensor([0, P * S]), 1.0, 1.0)


@pytest.mark.parametrize("kv", FAST_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_dequantize_equals_reference_gather(kv, dtype):
    pool, _, _ = filled_pools(kv, seed=1)
    g = torch.Generator().manual_seed(2)
    page_ids = torch.randint(0, P, (3, 4), generator=g)                # ragged use is masked
    for layers in (range(0, L), range(1, 2)):
        k, v = dequantize_pages(pool.layout, pool.pages, page_ids, layers, pool.global_scales,
                                dtype)
        assert k.shape == v.shape == (len(layers), 3, H, 4 * S, D) and k.dtype == dtype
        pidx = page_ids.repeat_interleave(S, dim=1).flatten()
        oidx = torch.arange(S).repeat(3 * 4)
        for i, layer in enumerate(layers):
            rk, rv = gather_rows_ref(pool.layout, pool.layer(layer), pidx, oidx,
                                     *pool.scales(layer), dtype)
            assert torch.equal(k[i], rk.view(3, 4 * S, H, D).transpose(1, 2))
            assert torch.equal(v[i], rv.view(3, 4 * S, H, D).transpose(1, 2))


@pytest.mark.parametrize("kv", FAST_FORMATS)
def test_row_dequantize_equals_reference_gather(kv):
    pool, _, _ = filled_pools(kv, seed=3)
    pidx, oidx = torch.tensor([0, 7, 7, 11]), torch.tensor([3, 0, 2, 1])
    for layer in range(L):
        got = dequantize_rows(pool.layout, pool.layer(layer), pidx, oidx, *pool.scales(layer),
                              torch.float32)
        want = gather_rows_ref(pool.layout, pool.layer(layer), pidx, oidx, *pool.scales(layer),
                               torch.float32)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_unserved_formats_are_refused():
    slow = [f for f in ALL_FORMATS if f not in FAST_FORMATS]
    assert slow, "the rotated-K formats decode through the reference"
    assert {"bf16", "fp8_e4m3", "nvfp4", "nvfp4_plain"} <= set(FAST_FORMATS)
    pool = KVPool(PageLayout(slow[0], L, H, D, S), P)
    with pytest.raises(KernelInputError, match="no fast dequantize"):
        dequantize_pages(pool.layout, pool.pages, torch.zeros(1, 1, dtype=torch.long),
                         range(0, 1), pool.global_scales, torch.float32)


def test_page_dequantize_checks_its_arguments():
    pool = KVPool(PageLayout("nvfp4", L, H, D, S), P)
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(KernelInputError, match="page_ids"):
        dequantize_pages(pool.layout, pool.pages, ids.int(), range(0, 1), pool.global_scales,
                         torch.float32)
    with pytest.raises(KernelInputError, match="layer range"):
        dequantize_pages(pool.layout, pool.pages, ids, range(0, L + 1), pool.global_scales,
                         torch.float32)
    assert "nvfp4" in FAST_ELEMENTS


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "nvfp4"])
def test_page_dequantize_with_scratch_reuses_memory(kv):
    """Results through a kept scratch dict equal fresh ones while it grows and shrinks, and
    a call the buffers already fit reuses their memory."""
    pool, _, _ = filled_pools(kv, seed=4)
    scratch: dict = {}
    ids = torch.tensor([[3, 1, 4], [1, 5, 9]])
    for page_ids, layers in ((ids[:1, :2], range(0, 1)), (ids, range(0, L)),
                             (ids[:, :1], range(1, 3))):
        want = dequantize_pages(pool.layout, pool.pages, page_ids, layers, pool.global_scales,
                                torch.float32)
        got = dequantize_pages(pool.layout, pool.pages, page_ids, layers, pool.global_scales,
                               torch.float32, scratch)
        assert torch.equal(got, want)
    assert got.data_ptr() == scratch["values"].data_ptr()
