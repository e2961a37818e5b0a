"""PageLayout: byte accounting, section offsets, alignment, aliasing views, format registry.

Reference geometry (hand-computed): H = 2 KV heads, D = 128, S = 16 tokens.

* nvfp4 layer slice: K data 2*16*64 = 2048, V data 2048, K scales 2*16*8 = 256,
  V scales 256 -> 4608 bytes; 288 bytes per token per layer (2*H*(D/2 + D/16)).
* fp8 layer slice: 2 * 2*16*128 = 8192 bytes; 512 bytes per token per layer (2*H*D).
* bf16 layer slice: 16384 bytes; 1024 bytes per token per layer.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from nibble.kernels import KernelInputError, KVCacheFormat, PageLayout
from nibble.kernels import formats
from nibble.kernels.formats import BF16, FP8_E4M3, NVFP4

H, D, S = 2, 128, 16


def _layout(fmt: str, layers: int = 3) -> PageLayout:
    return PageLayout(fmt, num_layers=layers, num_kv_heads=H, head_dim=D, page_size=S)


@pytest.mark.parametrize("fmt,sections,layer,per_token_layer", [
    ("nvfp4", [("k_data", 2048, 64), ("v_data", 2048, 64), ("k_scale", 256, 8),
               ("v_scale", 256, 8)], 4608, 288),
    ("fp8_e4m3", [("k_data", 4096, 128), ("v_data", 4096, 128)], 8192, 512),
    ("bf16", [("k_data", 8192, 256), ("v_data", 8192, 256)], 16384, 1024),
])
def test_sections_and_sizes(fmt, sections, layer, per_token_layer):
    lay = _layout(fmt)
    assert lay.sections() == sections
    assert lay.layer_nbytes == layer
    assert lay.page_nbytes == 3 * layer
    assert lay.bytes_per_token == 3 * per_token_layer
    assert lay.fmt.bytes_per_token_per_layer(H, D) == per_token_layer
    assert PageLayout.VERSION == 1


@pytest.mark.parametrize("h,d", [(1, 16), (2, 64), (8, 128), (4, 256)])
def test_nvfp4_holds_16_9_the_tokens_of_fp8(h, d):
    nv = PageLayout("nvfp4", 2, h, d, 16)
    f8 = PageLayout("fp8_e4m3", 2, h, d, 16)
    bf = PageLayout("bf16", 2, h, d, 16)
    assert f8.fmt.bytes_per_token_per_layer(h, d) == 2 * h * d
    assert nv.fmt.bytes_per_token_per_layer(h, d) == 2 * h * (d // 2 + d // 16)
    assert Fraction(f8.page_nbytes, nv.page_nbytes) == Fraction(16, 9)
    assert Fraction(bf.page_nbytes, nv.page_nbytes) == Fraction(32, 9)
    # Same pool bytes: 16 nvfp4 pages == 9 fp8 pages, holding 256 vs 144 tokens.
    nv_pool, f8_pool = nv.allocate(16), f8.allocate(9)
    assert nv_pool.numel() == f8_pool.numel()
    assert Fraction(nv_pool.shape[0] * nv.page_size, f8_pool.shape[0] * f8.page_size) == \
        Fraction(16, 9)


@pytest.mark.parametrize("fmt,h,d,s,msg", [
    ("nvfp4", 1, 128, 1, "k_scale"),     # scale section 1*1*8 = 8 bytes
    ("nvfp4", 1, 16, 2, "k_scale"),      # scale section 1*2*1 = 2 bytes
    ("nvfp4", 1, 16, 1, "k_data"),       # data section 1*1*8 = 8 bytes
    ("nvfp4", 1, 40, 16, "multiple of 16"),
    ("fp8_e4m3", 2, 24, 16, "multiple of 16"),
    ("int4", 2, 128, 16, "unknown KV cache format"),
])
def test_invalid_geometry_rejected(fmt, h, d, s, msg):
    with pytest.raises(KernelInputError, match=msg):
        PageLayout(fmt, 1, h, d, s)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
def test_non_positive_fields_rejected(field):
    args = dict(kv_format="nvfp4", num_layers=1, num_kv_heads=2, head_dim=128, page_size=16)
    args[field] = 0
    with pytest.raises(KernelInputError, match=field):
        PageLayout(**args)


@pytest.mark.parametrize("fmt,h,d,s", [("nvfp4", 1, 128, 2), ("nvfp4", 2, 16, 8),
                                       ("fp8_e4m3", 1, 16, 1), ("bf16", 1, 16, 1)])
def test_smallest_aligned_geometries_accepted(fmt, h, d, s):
    lay = PageLayout(fmt, 1, h, d, s)
    assert all(size % 16 == 0 for _, size, _ in lay.sections())


def test_allocate_and_check_pool():
    lay = _layout("nvfp4")
    pool = lay.allocate(4)
    assert pool.shape == (4, 3, 4608) and pool.dtype == torch.uint8
    assert pool.is_contiguous() and not pool.any()
    lay.check_pool(pool)
    for bad in (pool.view(torch.int8), pool[:, :2], pool[..., :-16], pool.flatten(1)):
        with pytest.raises(KernelInputError, match="pool must be uint8"):
            lay.check_pool(bad)
        with pytest.raises(KernelInputError):
            lay.layer_view(bad, 0)
    for layer in (-1, 3):
        with pytest.raises(KernelInputError, match="out of range"):
            lay.layer_view(pool, layer)


def test_layer_view_shapes_offsets_and_strides():
    lay = _layout("nvfp4")
    pool = lay.allocate(5)
    base = pool.data_ptr()
    v = lay.layer_view(pool, 1)
    assert v.k_data.shape == v.v_data.shape == (5, H, S, 64)
    assert v.k_scale.shape == v.v_scale.shape == (5, H, S, 8)
    assert all(t.dtype == torch.uint8 for t in v)
    # layer 1 starts at 4608; sections at +0, +2048, +4096, +4352
    assert [t.data_ptr() - base for t in v] == [4608, 6656, 8704, 8960]
    assert v.k_data.stride() == (13824, 1024, 64, 1)
    assert v.v_scale.stride() == (13824, 128, 8, 1)
    for fmt, row in (("fp8_e4m3", 128), ("bf16", 256)):
        w = _layout(fmt).layer_view(_layout(fmt).allocate(2), 2)
        assert w.k_data.shape == w.v_data.shape == (2, H, S, row)
        assert w.k_scale is None and w.v_scale is None


def test_views_alias_the_pool_exactly():
    lay = _layout("nvfp4")
    pool = lay.allocate(3)
    flat = pool.view(-1)
    v2 = lay.layer_view(pool, 2)
    v2.v_scale[1, 1, 3] = 0xAB
    # page 1 (13824) + layer 2 (9216) + V scales (4352) + (head 1 * 16 + slot 3) * 8
    assert flat.nonzero().flatten().tolist() == list(range(27544, 27552))
    assert (flat[27544:27552] == 0xAB).all()
    flat.zero_()
    v2.k_data[0, 1, 15, 63] = 7       # 9216 + (16 + 15) * 64 + 63
    lay.layer_view(pool, 0).v_data[2, 0, 0, 0] = 9    # 2 * 13824 + 2048
    assert flat.nonzero().flatten().tolist() == [11263, 29696]
    # and reading through a view sees writes to the pool
    flat[13824 + 4608 + 4096 + 5] = 42   # page 1, layer 1, K scales, head 0, slot 0, byte 5
    assert lay.layer_view(pool, 1).k_scale[1, 0, 0, 5].item() == 42


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "bf16"])
def test_page_is_one_contiguous_run(fmt):
    lay = _layout(fmt)
    pool = lay.allocate(4)
    for layer in range(lay.num_layers):
        for t in lay.layer_view(pool, layer):
            if t is not None:
                t[2].fill_(0xFF)
    idx = pool.view(-1).nonzero().flatten()
    assert idx.tolist() == list(range(2 * lay.page_nbytes, 3 * lay.page_nbytes))
    assert pool[2].is_contiguous() and pool[2].numel() == lay.page_nbytes


def test_mixed_format_registration(monkeypatch):
    monkeypatch.setattr(formats, "KV_CACHE_FORMATS", dict(formats.KV_CACHE_FORMATS))
    mixed = formats.register_kv_format(KVCacheFormat("test_k_fp8_v_nvfp4", FP8_E4M3, NVFP4))
    assert formats.get_kv_format("test_k_fp8_v_nvfp4") is mixed
    assert mixed.bytes_per_token_per_layer(H, D) == H * (128 + 64 + 8)
    lay = PageLayout("test_k_fp8_v_nvfp4", 2, H, D, S)
    assert lay.sections() == [("k_data", 4096, 128), ("v_data", 2048, 64), ("v_scale", 256, 8)]
    assert lay.layer_nbytes == 6400
    pool = lay.allocate(2)
    v = lay.layer_view(pool, 1)
    assert v.k_scale is None and v.v_scale.shape == (2, H, S, 8)
    assert v.v_scale.data_ptr() - pool.data_ptr() == 6400 + 6144
    with pytest.raises(KernelInputError, match="already registered"):
        formats.register_kv_format(KVCacheFormat("test_k_fp8_v_nvfp4", BF16, BF16))
    monkeypatch.undo()
    assert "test_k_fp8_v_nvfp4" not in formats.KV_CACHE_FORMATS
    with pytest.raises(KernelInputError, match="unknown KV cache format"):
        PageLayout("test_k_fp8_v_nvfp4", 2, H, D, S)


def test_duplicate_builtin_name_rejected_and_registry_unchanged():
    before = dict(formats.KV_CACHE_FORMATS)
    with pytest.raises(KernelInputError, match="already registered"):
        formats.register_kv_format(KVCacheFormat("nvfp4", BF16, BF16))
    assert formats.KV_CACHE_FORMATS == before
    assert formats.get_kv_format("nvfp4").k is NVFP4
    assert {"bf16", "fp8_e4m3", "nvfp4"} <= set(formats.KV_CACHE_FORMATS)
