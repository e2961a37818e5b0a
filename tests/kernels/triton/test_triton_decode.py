"""Triton split-K paged decode against the fp32 torch reference, outputs poisoned with NaN.

Under the CPU interpreter the dots run in fp32 (the interpreter's bf16 dot is
wrong), so the error bound is fp32-tight; on a GPU the operands are fp16/bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

from nibble.kernels import KernelInputError, PageLayout, decode_attention_ref, store_kv_ref
from nibble.kernels.triton import decode_attention, default_num_splits

HAS_CUDA = torch.cuda.is_available()
CPU = pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA,
                                                  reason="interpreter only without CUDA"))
GPU = pytest.param("cuda", marks=pytest.mark.gpu)
FORMATS = ["nvfp4", "fp8_e4m3", "bf16"]


def _tolerance(device: str, fmt: str) -> float:
    if device == "cpu":
        return 1e-5
    return 2e-2 if fmt == "bf16" else 5e-3


def _case(fmt, d, s, seq_lens, hq, h, seed):
    """A random pool (random bytes, then every slot stored), shuffled tables and q."""
    layout = PageLayout(fmt, 2, h, d, s)
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // s) for n in seq_lens)
    pages = len(seq_lens) * width
    pool = layout.allocate(pages).random_(0, 256, generator=gen)
    n = pages * s
    k = torch.randn(n, h, d, generator=gen) * 2 + torch.randn(1, h, d, generator=gen)
    v = torch.randn(n, h, d, generator=gen)
    store_kv_ref(layout, layout.layer_view(pool, 0), k, v, torch.arange(n), 0.37, 2.0)
    tables = torch.randperm(pages, generator=gen).to(torch.int32).view(len(seq_lens), width)
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    return layout, pool, tables, torch.tensor(seq_lens), q


def _check_decode(fmt, device, d=64, s=16, seq_lens=(5, 64, 33), hq=8, h=2, splits=3,
                  q_dtype=torch.float32, out_dtype=torch.float32, **knobs):
    layout, pool, tables, lens, q = _case(fmt, d, s, seq_lens, hq, h, seed=d + s + (splits or 0))
    sm_scale = 1 / math.sqrt(d)
    ref = decode_attention_ref(layout, layout.layer_view(pool, 0), q, tables, lens, sm_scale,
                               0.37, 2.0)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=device)
    pool_dev = pool.to(device)
    got = decode_attention(layout, layout.layer_view(pool_dev, 0), q.to(device, q_dtype),
                           tables.to(device), lens.to(device), sm_scale, 0.37, 2.0, out=out,
                           num_splits=splits, **knobs)
    assert got is out
    got = got.float().cpu()
    assert torch.isfinite(got).all(), "unwritten (NaN) outputs"
    err = ((got - ref).norm() / ref.norm()).item()
    tol = _tolerance(device, fmt) if q_dtype == torch.float32 else 2e-2
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_matches_reference(fmt, splits, device):
    _check_decode(fmt, device, splits=splits, block_n=16)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_head_dim_128_page_64(fmt, device):
    _check_decode(fmt, device, d=128, s=64, seq_lens=(100, 7), hq=4, h=1, splits=2, block_n=32)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("scale_mode", [0, 1])
def test_decode_nvfp4_scale_modes_and_empty_splits(scale_mode, device):
    """More splits than tiles (empty splits), tiles spanning pages, both scale paths."""
    _check_decode("nvfp4", device, seq_lens=(70, 1), hq=2, h=1, splits=6, block_n=32,
                  scale_mode=scale_mode)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_parts(fmt, parts, device):
    """Both head-dim splits of the dots (2 halves, or 4 parts from words of 4 codes)."""
    _check_decode(fmt, device, seq_lens=(37, 20), hq=4, h=2, splits=2, block_n=16, parts=parts)


@pytest.mark.parametrize("device", [CPU, GPU])
def test_decode_half_precision_io(device):
    _check_decode("nvfp4", device, seq_lens=(40,), hq=16, h=2, splits=2, block_n=16,
                  q_dtype=torch.float16, out_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d,s", [(64, 16), (128, 16), (128, 64)])
def test_decode_gpu_long(fmt, d, s):
    """Longer random lengths on the GPU with the default tuning and split count."""
    lens = tuple(torch.randint(1, 3000, (5,)).tolist())
    _check_decode(fmt, "cuda", d=d, s=s, seq_lens=lens, hq=32, h=8, splits=None)


def test_default_num_splits_depends_on_shapes_only():
    cpu = torch.device("cpu")
    assert default_num_splits(1, 8, 131072, cpu) > default_num_splits(64, 8, 131072, cpu) >= 1
    assert default_num_splits(1, 1, 10, cpu) == 1


def test_decode_rejects_bad_arguments():
    layout, pool, tables, lens, q = _case("nvfp4", 64, 16, (5, 9), 4, 2, seed=0)
    pages = layout.layer_view(pool, 0)
    with pytest.raises(KernelInputError, match="q must be"):
        decode_attention(layout, pages, q[:, :3], tables, lens, 1.0)
    with pytest.raises(KernelInputError, match="q must be"):
        decode_attention(layout, pages, q.to(torch.int32), tables, lens, 1.0)
    with pytest.raises(KernelInputError, match="block_tables has"):
        decode_attention(layout, pages, q[:1], tables, lens, 1.0)
    with pytest.raises(KernelInputError, match="out must be"):
        decode_attention(layout, pages, q, tables, lens, 1.0, out=torch.empty(2, 4, 16))
    small, pool32, tables32, lens32, q32 = _case("bf16", 32, 16, (5,), 2, 1, seed=0)
    with pytest.raises(KernelInputError, match="head_dim"):
        decode_attention(small, small.layer_view(pool32, 0), q32, tables32, lens32, 1.0)
    with pytest.raises(KernelInputError, match="block_n"):
        decode_attention(layout, pages, q, tables, lens, 1.0, block_n=24)


@pytest.mark.gpu
@pytest.mark.parametrize("ptx", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
def test_decode_gpu_dequant_paths(fmt, ptx):
    """The portable code expansion and the inline-PTX one, on the same data."""
    _check_decode(fmt, "cuda", d=128, s=16, seq_lens=(1000, 17, 300), hq=32, h=8, splits=3,
                  block_n=64, ptx=ptx)
