"""Triton dequant-gather against the torch reference: bit-exact, poisoned workspaces."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError, PageLayout, gather_kv_ref, store_kv_ref
from nibble.kernels.triton import gather_kv

HAS_CUDA = torch.cuda.is_available()
CPU = pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA,
                                                  reason="interpreter only without CUDA"))
GPU = pytest.param("cuda", marks=pytest.mark.gpu)
FORMATS = ["nvfp4", "fp8_e4m3", "bf16"]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _filled(layout: PageLayout, pages: int, seed: int):
    """A pool (layer 1 of 2) whose every slot holds stored random K/V; layer 0 random bytes."""
    gen = torch.Generator().manual_seed(seed)
    pool = layout.allocate(pages).random_(0, 256, generator=gen)
    n = pages * layout.page_size
    shape = (n, layout.num_kv_heads, layout.head_dim)
    k = torch.randn(shape, generator=gen) * 3
    v = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen))
    store_kv_ref(layout, layout.layer_view(pool, 1), k, v, torch.arange(n), 0.37, 2.0)
    return pool, gen


def _poisoned(n: int, layout: PageLayout, dtype: torch.dtype, device: str) -> torch.Tensor:
    out = torch.full((n, layout.num_kv_heads, layout.head_dim), float("nan"), device=device)
    return out.to(dtype)


def _check_gather(fmt, dtype, device, d=64, s=16, seq_lens=(5, 64, 0, 33)):
    layout = PageLayout(fmt, 2, 2, d, s)
    width = max(-(-n // s) for n in seq_lens) + 1
    pool, gen = _filled(layout, len(seq_lens) * width, seed=len(fmt) + d)
    tables = torch.randperm(len(seq_lens) * width, generator=gen).to(torch.int32)
    tables = tables.view(len(seq_lens), width)
    lens = torch.tensor(seq_lens)
    ref_k, ref_v = gather_kv_ref(layout, layout.layer_view(pool, 1), tables, lens, 0.37, 2.0,
                                 dtype)
    total = sum(seq_lens)
    out = (_poisoned(total, layout, dtype, device), _poisoned(total, layout, dtype, device))
    pool_dev = pool.to(device)
    k, v = gather_kv(layout, layout.layer_view(pool_dev, 1), tables.to(device), lens.to(device),
                     0.37, 2.0, dtype, out=out)
    for got, ref in ((k, ref_k), (v, ref_v)):
        assert got.data_ptr() in (out[0].data_ptr(), out[1].data_ptr())
        same = got.cpu().view(torch.uint8) == ref.view(torch.uint8)
        assert same.all(), f"{(~same).sum().item()} bytes differ"


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_matches_reference(fmt, dtype, device):
    _check_gather(fmt, dtype, device)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_head_dim_128_page_64(fmt, device):
    _check_gather(fmt, torch.bfloat16, device, d=128, s=64, seq_lens=(70, 3))


@pytest.mark.parametrize("device", [CPU, GPU])
def test_gather_allocates_and_computes_offsets(device):
    layout = PageLayout("nvfp4", 1, 1, 32, 16)
    pool, _ = _filled(PageLayout("nvfp4", 2, 1, 32, 16), 4, seed=3)
    pool = pool[:, 1:].contiguous()
    tables = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    lens = torch.tensor([20, 9])
    ref = gather_kv_ref(layout, layout.layer_view(pool, 0), tables, lens, 0.37, 2.0, torch.float32)
    got = gather_kv(layout, layout.layer_view(pool.to(device), 0), tables.to(device),
                    lens.to(device), 0.37, 2.0, torch.float32)
    assert got[0].shape == (29, 1, 32)
    assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])


def test_gather_rejects_bad_arguments():
    layout = PageLayout("fp8_e4m3", 1, 2, 32, 16)
    pages = layout.layer_view(layout.allocate(4), 0)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([3, 4])
    with pytest.raises(KernelInputError, match="block_tables"):
        gather_kv(layout, pages, tables.long(), lens)
    with pytest.raises(KernelInputError, match="seq_lens"):
        gather_kv(layout, pages, tables, lens[:1])
    with pytest.raises(KernelInputError, match="workspace dtype"):
        gather_kv(layout, pages, tables, lens, dtype=torch.int8)
    with pytest.raises(KernelInputError, match="out"):
        gather_kv(layout, pages, tables, lens, dtype=torch.float16,
                  out=(torch.empty(7, 2, 32), torch.empty(7, 2, 32)))


@pytest.mark.gpu
def test_a_new_block_table_width_compiles_nothing():
    """The block table's width changes every serving step; a width that is not a multiple
    of 16 must reuse the compiled kernel (each new class compiled a variant, 1.3-1.8 s,
    inside a serving step)."""
    from nibble.kernels.triton import gather as tg

    layout = PageLayout("nvfp4", 2, 2, 64, 16)

    def run(width):
        pool, _ = _filled(layout, 2 * width, seed=width)
        tables = torch.arange(2 * width, dtype=torch.int32).view(2, width).cuda()
        gather_kv(layout, layout.layer_view(pool.cuda(), 1), tables,
                  torch.tensor([16 * width - 3, 7], device="cuda"), 0.37, 2.0, torch.bfloat16)
        torch.cuda.synchronize()
        return len(tg._gather_kv_kernel.device_caches[torch.cuda.current_device()][0])

    first = run(32)
    assert [run(w) for w in (33, 1, 47, 48)] == [first] * 4, "a table width compiled a variant"
