"""CUDA C++ NVFP4 quantize-and-store against the torch reference: every pool byte must match.

GPU cases need compute capability 9.0. Pools start as random bytes (poison), so bytes
written where they should not be, or not written, differ from the reference's pool.
FP8 input is checked exhaustively: every E4M3 value, in blocks whose amax makes
normal, subnormal, saturated and zero scales. Every GPU case runs each store variant
(variant 1 takes FP8 input; with bf16 it runs variant 0).
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError, PageLayout, store_kv_ref
from nibble.kernels.cuda import is_built, store_kv_nvfp4_cuda
from nibble.kernels.cuda.store import STORE_VARIANTS, unsupported_reason

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")


def _random(t: int, h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Values over many magnitudes, with zero, negative-zero and tiny blocks."""
    x = torch.randn(t, h, d, generator=gen) * torch.exp(torch.randn(t, h, d, generator=gen) * 2)
    x = x.clamp(-440, 440)
    x[0, 0, :16] = 0.0
    x[-1, -1, :16] = -0.0
    x[min(1, t - 1), 0, 16:32] = 1e-30
    return x


def _every_e4m3(h: int, d: int) -> torch.Tensor:
    """All 256 E4M3 bit patterns but NaN, in 16-value blocks led by different amaxes."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)]
    rows = []
    for lead in (448.0, 1.0, 0.015625, 2.0 ** -9, 0.0):
        small = values[values.abs() <= lead]
        for i in range(0, small.numel(), 15):
            chunk = small[i:i + 15]
            rows.append(torch.cat([torch.tensor([lead]), chunk, torch.zeros(15 - chunk.numel())]))
    x = torch.stack(rows)
    x = torch.cat([x, torch.zeros(-x.shape[0] % (h * d // 16), 16)])
    return x.view(-1, h, d)


def _check(k: torch.Tensor, v: torch.Tensor, s: int = 16, k_scale=0.37, v_scale=2.0,
           slot_dtype=torch.int64, skip_every: int = 0, variant: int = 0) -> None:
    t, h, d = k.shape
    layout = PageLayout("nvfp4", 2, h, d, s)
    gen = torch.Generator().manual_seed(t)
    pages = -(-t // s) + 2
    pool = layout.allocate(pages).random_(0, 256, generator=gen)
    slots = torch.randperm(pages * s, generator=gen)[:t]
    if skip_every:
        slots[::skip_every] = -1
    expect = pool.clone()
    keep = slots >= 0
    store_kv_ref(layout, layout.layer_view(expect, 1), k[keep].cpu(), v[keep].cpu(),
                 slots[keep], k_scale, v_scale)
    dev = torch.device("cuda")
    pool_d = pool.to(dev)
    v_gs = torch.tensor([v_scale], device=dev)         # K as a float, V as a device tensor
    store_kv_nvfp4_cuda(layout, layout.layer_view(pool_d, 1), k.to(dev), v.to(dev),
                        slots.to(slot_dtype).to(dev), k_scale, v_gs, variant=variant)
    bad = (pool_d.cpu() != expect).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("variant", STORE_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("h,d,s,t", [(8, 128, 16, 300), (2, 64, 64, 77), (1, 16, 16, 5),
                                     (3, 32, 16, 41), (4, 80, 16, 33)])
@pytest.mark.parametrize("gs", [0.37, 2.0 ** -20, 3e3])
def test_store_matches_reference(dtype, h, d, s, t, gs, variant):
    gen = torch.Generator().manual_seed(h * d + t)
    k = (_random(t, h, d, gen) * (gs if dtype == torch.bfloat16 else 1.0)).to(dtype)
    v = _random(t, h, d, gen).to(dtype)
    _check(k, v, s, k_scale=gs, slot_dtype=torch.int32 if t % 2 else torch.int64, skip_every=7,
           variant=variant)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("variant", STORE_VARIANTS)
@pytest.mark.parametrize("gs", [1.0, 0.37, 1e-3, 2.0 ** -125, 3e3, 1e30])
def test_every_e4m3_input_value(gs, variant):
    x = _every_e4m3(2, 64).to(torch.float8_e4m3fn)
    _check(x, x.flip(0), k_scale=gs, v_scale=1.0, variant=variant)


@pytest.mark.gpu
@needs_sm90
def test_variant1_many_items_per_thread():
    """More rows than one wave of resident CTAs: each thread loops (grid-stride) and every CTA
    builds its tables once; D 128 takes 4 blocks per thread."""
    gen = torch.Generator().manual_seed(11)
    t = 12000
    k = _random(t, 8, 128, gen).to(torch.float8_e4m3fn)
    v = _random(t, 8, 128, gen).to(torch.float8_e4m3fn)
    _check(k, v, 32, k_scale=0.05, v_scale=7.0, variant=1)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("variant", STORE_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_strided_rows_and_graph_replay(dtype, variant):
    """Rows taken out of a wider qkv buffer (token stride > H * D), then a CUDA graph."""
    gen = torch.Generator().manual_seed(5)
    qkv = _random(40, 12, 128, gen).to(dtype)
    k, v = qkv[:, 4:8], qkv[:, 8:12]
    _check(k, v, variant=variant)
    dev = torch.device("cuda")
    layout = PageLayout("nvfp4", 1, 4, 128, 16)
    pool = layout.allocate(4, dev)
    view = layout.layer_view(pool, 0)
    kd, vd, slots = k.to(dev), v.to(dev), torch.arange(40, device=dev)
    one = torch.ones(1, device=dev)
    store_kv_nvfp4_cuda(layout, view, kd, vd, slots, one, one, variant=variant)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv_nvfp4_cuda(layout, view, kd, vd, slots, one, one, variant=variant)
    kd.copy_((-kd.float()).to(dtype))
    pool.zero_()
    graph.replay()
    expect = layout.allocate(4)
    store_kv_ref(layout, layout.layer_view(expect, 0), (-k.float()).to(dtype), v,
                 torch.arange(40), 1.0, 1.0)
    assert torch.equal(pool.cpu(), expect)


def _cpu_case(fmt="nvfp4", dtype=torch.bfloat16, d=64, shape_v=None):
    layout = PageLayout(fmt, 1, 2, 64, 16)
    k = torch.zeros(3, 2, d, dtype=dtype)
    v = torch.zeros(shape_v or (3, 2, d), dtype=dtype)
    return layout, k, v


@pytest.mark.parametrize("case,message", [
    (dict(fmt="fp8_e4m3"), "writes NVFP4 pages"),
    (dict(dtype=torch.float32), "bf16 or float8_e4m3fn"),
    (dict(d=32), r"must be \[T, 2, 64\]"),
    (dict(shape_v=(4, 2, 64)), r"v must be \[T, 2, 64\]"),
    (dict(), "CUDA device"),
    (dict(variant=2), "store variant must be one of"),
])
def test_rejects_inputs_without_building(case, message):
    case = dict(case)
    variant = case.pop("variant", 0)
    layout, k, v = _cpu_case(**case)
    assert message and unsupported_reason(layout, k, v) is not None
    with pytest.raises(KernelInputError, match=message):
        store_kv_nvfp4_cuda(layout, layout.layer_view(layout.allocate(1), 0), k, v,
                            torch.zeros(3, dtype=torch.int64), variant=variant)
    assert not is_built() or HAS_SM90


def test_rejects_unaligned_rows():
    layout = PageLayout("nvfp4", 1, 2, 64, 16)
    x = torch.zeros(3, 2, 65, dtype=torch.bfloat16)[:, :, 1:]
    assert "16-byte aligned" in unsupported_reason(layout, x, x)
    wide = torch.zeros(3, 2, 72, dtype=torch.bfloat16)[:, :, :64]     # row stride 144 bytes
    assert "16-byte aligned" not in unsupported_reason(layout, wide, wide)
    odd = torch.zeros(3, 2, 68, dtype=torch.bfloat16)[:, :, :64]      # row stride 136 bytes
    assert "16-byte aligned" in unsupported_reason(layout, odd, odd)
