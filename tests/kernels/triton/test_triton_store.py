"""Triton quantize-and-store against the torch reference: every pool byte must match.

The pool starts as random bytes (poison): bytes the kernel should write but does
not, or writes where it should not, differ from the reference's pool.
"""

from __future__ import annotations

import math

import pytest
import torch

from nibble.kernels import KernelInputError, PageLayout, store_kv_ref
from nibble.kernels.triton import store_kv

HAS_CUDA = torch.cuda.is_available()
CPU = pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA,
                                                  reason="interpreter only without CUDA"))
GPU = pytest.param("cuda", marks=pytest.mark.gpu)
FORMATS = ["nvfp4", "fp8_e4m3", "bf16"]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _inputs(t: int, h: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values over many magnitudes with zero, negative-zero, tiny and saturating blocks."""
    x = torch.randn(t, h, d, generator=gen) * torch.exp(torch.randn(t, h, d, generator=gen) * 2)
    x = x.clamp(-440, 440)
    x[0, 0, :16] = 0.0
    x[-1, -1, :16] = -0.0
    if t > 2:
        x[1, 0, 16:32] = 1e-30
        x[2, -1, :16] = -3e-6
    return x.to(dtype)


def _check_store(fmt, dtype, device, d=64, s=16, h=2, t=19, pages=6, k_scale=0.37, v_scale=2.0):
    layout = PageLayout(fmt, 2, h, d, s)
    gen = torch.Generator().manual_seed(sum(map(ord, f"{fmt}{dtype}{d}{s}")))
    pool = layout.allocate(pages)
    pool.random_(0, 256, generator=gen)
    expect = pool.clone()
    k = _inputs(t, h, d, dtype, gen)
    v = _inputs(t, h, d, dtype, gen)
    slots = torch.randperm(pages * s, generator=gen)[:t]
    store_kv_ref(layout, layout.layer_view(expect, 1), k, v, slots, k_scale, v_scale)
    pool_dev = pool.to(device)
    store_kv(layout, layout.layer_view(pool_dev, 1), k.to(device), v.to(device),
             slots.to(device), k_scale, v_scale)
    mismatch = (pool_dev.cpu() != expect).nonzero()
    assert mismatch.numel() == 0, (f"{mismatch.shape[0]} bytes differ, first at "
                                   f"{mismatch[:4].tolist()}")


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_matches_reference(fmt, dtype, device):
    _check_store(fmt, dtype, device)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_head_dim_128_page_64(fmt, device):
    _check_store(fmt, torch.bfloat16, device, d=128, s=64, h=1, t=9, pages=2, k_scale=1.0)


@pytest.mark.parametrize("device", [CPU, GPU])
def test_store_nvfp4_ties_and_saturation(device):
    """Exact E2M1 ties (scale 1 and 1.5) and a block whose scale saturates at 448."""
    layout = PageLayout("nvfp4", 1, 1, 32, 16)
    ties = [6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -6, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5]
    k = torch.tensor([ties + [9, .375, 1.125, 1.875, 2.625, 3.75, 5.25, 7.5,
                              .75, 1.5, 2.25, 3, 4.5, 6, 0, -9]], dtype=torch.float32)
    v = torch.tensor([[1e6] * 8 + [-3e5] * 8 + [2.0 ** -12] * 16], dtype=torch.float32)
    pool = layout.allocate(1).fill_(0xA5)
    expect = pool.clone()
    slots = torch.tensor([3])
    store_kv_ref(layout, layout.layer_view(expect, 0), k[:, None], v[:, None], slots, 1.0, 1.0)
    pool_dev = pool.to(device)
    store_kv(layout, layout.layer_view(pool_dev, 0), k[:, None].to(device), v[:, None].to(device),
             slots.to(device), 1.0, 1.0)
    assert torch.equal(pool_dev.cpu(), expect)
    view = layout.layer_view(expect, 0)
    assert view.k_data[0, 0, 3, :8].tolist() == [0x07, 0x22, 0x44, 0x66, 0x8F, 0xAA, 0xCC, 0xEE]
    assert view.v_scale[0, 0, 3, 0].item() == 0x7E  # 448


@pytest.mark.parametrize("device", [CPU, GPU])
def test_store_nvfp4_rounding_sweep(device):
    """Every block has amax 6 (scale 1.0): its other 15 values sweep [0, 7] on a fine grid
    and one fp32 step either side of each E2M1 decision point."""
    points = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1.0, 0.5]
    near = [math.nextafter(p, d) for p in points for d in (0.0, 10.0)] + points
    values = torch.tensor([i / 64 for i in range(449)] + near, dtype=torch.float32)
    values = torch.cat([values, -values])
    blocks = -(-values.numel() // 60) * 4  # 4 blocks per 64-wide row
    values = torch.cat([values, torch.zeros(blocks * 15 - values.numel())]).view(blocks, 15)
    x = torch.cat([torch.full((blocks, 1), 6.0), values], 1).view(-1, 1, 64)
    layout = PageLayout("nvfp4", 1, 1, 64, 16)
    pool = layout.allocate(-(-x.shape[0] // 16)).fill_(0x5A)
    expect = pool.clone()
    slots = torch.arange(x.shape[0])
    store_kv_ref(layout, layout.layer_view(expect, 0), x, x, slots, 1.0, 1.0)
    pool_dev = pool.to(device)
    store_kv(layout, layout.layer_view(pool_dev, 0), x.to(device), x.to(device),
             slots.to(device), 1.0, 1.0)
    assert torch.equal(pool_dev.cpu(), expect)


@pytest.mark.parametrize("device", [CPU, GPU])
def test_store_strided_input_and_skipped_slots(device):
    """Non-contiguous k/v and a negative slot (padding) that must not be written."""
    layout = PageLayout("nvfp4", 1, 2, 32, 16)
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(5, 4, 32, generator=gen)
    k, v = base[:, ::2], base[:, 1::2]
    slots = torch.tensor([4, -1, 17, 0, 30])
    pool = layout.allocate(2).random_(0, 256, generator=gen)
    expect = pool.clone()
    keep = slots >= 0
    store_kv_ref(layout, layout.layer_view(expect, 0), k[keep], v[keep], slots[keep], 1.5, 0.5)
    pool_dev = pool.to(device)
    store_kv(layout, layout.layer_view(pool_dev, 0), k.to(device), v.to(device),
             slots.to(device), 1.5, 0.5)
    assert torch.equal(pool_dev.cpu(), expect)


def test_store_rejects_bad_arguments():
    layout = PageLayout("nvfp4", 1, 2, 32, 16)
    pool = layout.allocate(2)
    pages = layout.layer_view(pool, 0)
    k = torch.zeros(3, 2, 32)
    slots = torch.arange(3)
    with pytest.raises(KernelInputError, match="k must be"):
        store_kv(layout, pages, torch.zeros(3, 3, 32), k, slots)
    with pytest.raises(KernelInputError, match="bf16/fp16/fp32"):
        store_kv(layout, pages, k.to(torch.int32), k, slots)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        store_kv(layout, pages, k, k, slots[:2])
    with pytest.raises(KernelInputError, match="slot_mapping"):
        store_kv(layout, pages, k, k, slots.float())
    with pytest.raises(KernelInputError, match="contiguous within a page"):
        store_kv(layout, pages._replace(k_data=pages.k_data.transpose(1, 2).contiguous()
                                        .transpose(1, 2)), k, k, slots)
    with pytest.raises(KernelInputError, match="k_scale"):
        store_kv(layout, pages, k, k, slots, k_scale=0.0)
    with pytest.raises(KernelInputError, match="pages.k_data must be"):
        store_kv(PageLayout("bf16", 1, 2, 32, 16), pages, k, k, slots)
