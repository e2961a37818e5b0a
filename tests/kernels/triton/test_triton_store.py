"""Triton quantize-and-store against the torch reference: every pool byte must match.

The pool starts as random bytes (poison): bytes the kernel should write but does
not, or writes where it should not, differ from the reference's pool.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nibble.kernels import KernelInputError, PageLayout, store_kv_ref
from nibble.kernels.triton import store as store_mod
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


F32 = np.float32
# E2M1 decision points and grid values (q = value * fp32 reciprocal of the block denominator).
Q_POINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _x_for(q: np.float32, denom: np.float32) -> np.float32 | None:
    """An fp32 ``x`` with ``fp32(x * fp32(1 / denom)) == q`` (searched near ``q * denom``)."""
    inv = F32(1) / denom
    x = F32(float(q) * float(denom))
    cands = [x]
    for direction in (F32(-np.inf), F32(np.inf)):
        y = x
        for _ in range(4):
            y = np.nextafter(y, direction)
            cands.append(y)
    return next((c for c in cands if F32(c) * inv == q), None)


def _edge_blocks(scale: float, gs: float) -> list[list[float]]:
    """16-value blocks whose amax sets the block scale to ``scale`` (exactly): products with
    the reciprocal at, one ulp under and one ulp over every E2M1 tie and grid value."""
    denom = F32(scale) * F32(gs)
    vals = []
    for point in Q_POINTS:
        q = F32(point)
        for target in (np.nextafter(q, F32(0)), q, np.nextafter(q, F32(np.inf))):
            x = _x_for(target, denom)
            if x is not None and x < F32(6) * denom:
                vals += [float(x), -float(x)]
    vals += [0.0] * (-len(vals) % 15)
    return [[float(F32(6) * denom)] + vals[i:i + 15] for i in range(0, len(vals), 15)]


def _special_blocks() -> list[list[float]]:
    """Saturation, huge, tiny, subnormal and signed-zero values."""
    return [
        [6.0, 7.0, -7.0, 6.5, -6.0, 5.0, 1e-30, -1e-30, 1e-40, -1e-40, 2.0 ** -149, -0.0,
         0.0, -2.0 ** -149, 5.5, -6.25],
        [1e30, 6e29, -1e30, 7e29, 2.6e27, -1e20, 1e-30, -0.0, 1.0, -1.0, 3e38, -3e38,
         0.0, 1e-45, 2.7e27, 9e27],
        [7.5 * 2.0 ** -9, -7 * 2.0 ** -9, 2.0 ** -9, 1e-40, -0.0, 3 * 2.0 ** -10]
        + [0.0] * 10,
        [-0.0] * 16,
        [2.0 ** -140, -2.0 ** -140, 1e-44, 0.0] + [-0.0] * 12,
    ]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 1 / tiny, clamped
@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("gs", [1.0, 5.0, 0.125])
@pytest.mark.parametrize("config", [None, (4, 1, 2), (16, 4, 1), (2, 2, 3)],
                         ids=["store_kv", "rows4_tiles2", "rows16_warps4", "rows2_tiles3"])
def test_store_nvfp4_every_tie_and_edge(config, gs, device):
    """K: products exactly at, and one fp32 ulp either side of, every E2M1 decision point
    and grid value, under exact and inexact block reciprocals (normal and subnormal
    scales), plus saturation (6, 7, 1e30, a 448 scale), tiny and subnormal values and
    -0.0. V: the same scaled by 2**-125 with global scale 2**-125, where small block
    scales overflow the reciprocal (clamped). Every pool byte as the reference, for the
    default launch and for other tile shapes."""
    scales = [1.0, 1.5, 1.375, 1.125, 1.875, 0.75, 240.0, 3 * 2.0 ** -9, 5 * 2.0 ** -9]
    blocks = [b for sc in scales for b in _edge_blocks(sc, gs)]
    k = torch.tensor(blocks + _special_blocks())
    k = torch.cat([k, torch.zeros(-k.shape[0] % 4, 16)]).view(-1, 1, 64)
    v = (k * 2.0 ** -125 / gs).flip(0)
    layout = PageLayout("nvfp4", 1, 1, 64, 16)
    t = k.shape[0]
    pool = layout.allocate(-(-t // 16) + 1).fill_(0xC3)
    expect = pool.clone()
    slots = torch.randperm(pool.shape[0] * 16, generator=torch.Generator().manual_seed(3))[:t]
    store_kv_ref(layout, layout.layer_view(expect, 0), k, v, slots, gs, 2.0 ** -125)
    pool_dev = pool.to(device)
    args = (layout, layout.layer_view(pool_dev, 0), k.to(device), v.to(device),
            slots.to(device), gs, 2.0 ** -125)
    if config is None:
        store_kv(*args)
    else:
        store_mod._launch(*args, *config)
    mismatch = (pool_dev.cpu() != expect).nonzero()
    assert mismatch.numel() == 0, (f"{mismatch.shape[0]} bytes differ, first at "
                                   f"{mismatch[:4].tolist()}")


@pytest.mark.parametrize("device", [CPU, GPU])
def test_store_unaligned_inputs(device):
    """bf16 that cannot be read as 32-bit pairs (odd element offset), fp16, and fp8 off a
    16-byte boundary take the unvectorized reads; all must match the reference."""
    gen = torch.Generator().manual_seed(11)
    base = _inputs(9, 2, 65, torch.float32, gen)
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        x = base.to(dtype)[:, :, 1:]
        _check_store_tensors("nvfp4", x, x.flip(0), device)


def _check_store_tensors(fmt: str, k: torch.Tensor, v: torch.Tensor, device: str) -> None:
    t, h, d = k.shape
    layout = PageLayout(fmt, 1, h, d, 16)
    pool = layout.allocate(2).random_(0, 256, generator=torch.Generator().manual_seed(t))
    expect = pool.clone()
    slots = torch.arange(t) * 3 % 32
    store_kv_ref(layout, layout.layer_view(expect, 0), k, v, slots, 0.75, 1.5)
    pool_dev = pool.to(device)
    store_kv(layout, layout.layer_view(pool_dev, 0), k.to(device), v.to(device),
             slots.to(device), 0.75, 1.5)
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


def test_head_major_views_compile_one_kernel_for_every_token_count(monkeypatch):
    """The K recipe hands the store ``[H, T, D]`` transposed. Its head stride is ``T * D``;
    as a compile-time constant it made the GPU compile a new kernel per prompt length. The
    wrapper copies such a view, so every token count launches with the same constants."""
    layout = PageLayout("nvfp4", 1, 2, 64, 16)
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(
                {n: x for n, x in kw.items() if n.startswith(("SK_", "SV_"))})

    monkeypatch.setattr(store_mod, "_store_kv_kernel", Recorder())
    from nibble.tiering import KVPool
    pool = KVPool(layout, 8)
    for t in (5, 9, 33):
        k = torch.randn(2, t, 64).transpose(0, 1)          # [T, H, D], head stride T * D
        v = torch.randn(t, 2, 64)
        store_kv(layout, pool.layer(0), k, v, torch.arange(t))
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2], seen
