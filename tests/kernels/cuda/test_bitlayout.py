"""Layout-v2 code bytes (``kernels/cuda/bitlayout.py``) and the decode variants that read them.

CPU: v1 -> v2 -> v1 is the identity on random bytes; the emulated kernel expansion of v2
words (``expand_v2``) equals the reference E2M1 decoding of the v1 codes for every byte value,
for K words and for V's token-pair words, and its registers equal an emulation of DQ 2 (the
default variant's expansion) on the v1 words bit for bit. GPU: 10434 / 10444 on a converted
pool match the fp32 reference and give 10424's output on the v1 pool exactly (same fp16
operands, same MMA order); the wrapper refuses v1 pages for v2 variants and the reverse.
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError
from nibble.kernels.cuda import bitlayout as bl
from nibble.kernels.cuda import decode as cd
from nibble.kernels.nvfp4 import e2m1_decode, unpack_nibbles

from .test_cuda_decode import HAS_SM90, _case, _err, _run


def _rand(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def _ref_fp16(codes: torch.Tensor) -> torch.Tensor:
    """int16 bits of the fp16 value * 2^-14 of every nibble (v1 order), ``[..., 2n]``."""
    return (e2m1_decode(unpack_nibbles(codes)) * 2.0 ** -14).to(torch.float16).view(torch.int16)


def _all_byte_words(seed=1) -> torch.Tensor:
    """uint8 [4 * 256, 4]: each byte position takes every value, the other bytes random."""
    x = _rand((4, 256, 4), seed)
    for pos in range(4):
        x[pos, :, pos] = torch.arange(256, dtype=torch.uint8)
    return x.flatten(0, 1)


def _dq2_v1(words: torch.Tensor) -> torch.Tensor:
    """csrc/tile.cuh dq8<2> on v1 words (int64 [...]) -> int64 [..., 4] registers."""
    w = words & 0xFFFFFFFF
    s8 = w & 0x88888888
    sel = lambda a, b: ((b & 0x0E0E0E0E) | (a & ~0x0E0E0E0E)) & 0xFFFFFFFF  # noqa: E731
    lo, hi = sel(s8 << 4, w << 1), sel(s8, w >> 3)
    out = []
    for x in (lo, hi):
        for pair in ((0, 1), (2, 3)):        # __byte_perm(x, 0, 0x1404 / 0x3424)
            out.append((((x >> (8 * pair[0])) & 0xFF) << 8) | (((x >> (8 * pair[1])) & 0xFF) << 24))
    return torch.stack([out[0], out[1], out[2], out[3]], dim=-1)


def _v_pair_words(v1: torch.Tensor) -> torch.Tensor:
    """v1 V rows [..., S, n] -> the kernel's token-pair words as uint8 [..., S, n]: row 2i + zs,
    word q = __byte_perm(A.word q, B.word q, zs ? 0x7362 : 0x5140), A / B = rows 2i / 2i+1."""
    a = v1[..., 0::2, :].unflatten(-1, (-1, 4))
    b = v1[..., 1::2, :].unflatten(-1, (-1, 4))
    even = torch.stack((a[..., 0], b[..., 0], a[..., 1], b[..., 1]), dim=-1).flatten(-2)
    odd = torch.stack((a[..., 2], b[..., 2], a[..., 3], b[..., 3]), dim=-1).flatten(-2)
    return torch.stack((even, odd), dim=-2).flatten(-3, -2)


# ---------------------------------------------------------------- CPU

@pytest.mark.parametrize("kind", bl.KINDS)
def test_round_trip_is_bit_exact(kind):
    layout_pool = _rand((5, 2, 3 * 32 * 64), seed=2)            # strided views, as a pool gives
    for view in (layout_pool[:, 1].unflatten(-1, (3, 32, 64)), _rand((2, 16, 64), seed=3)):
        v2 = bl.to_v2(view, kind)
        assert v2.shape == view.shape and v2.dtype == torch.uint8
        assert not torch.equal(v2, view)
        assert torch.equal(bl.from_v2(v2, kind), view)


def test_byte_format_is_a_permutation_with_the_documented_bits():
    assert sorted(bl._TO_V2.tolist()) == list(range(256))
    for x, s_x, y, s_y in ((5, 1, 3, 0), (7, 0, 1, 1), (0, 1, 0, 1)):
        v1 = torch.tensor([[x | s_x << 3 | y << 4 | s_y << 7, 0, 0, 0]], dtype=torch.uint8)
        assert bl.to_v2(v1, "k")[0, 0].item() == x << 1 | s_x << 7 | y << 4 | s_y


def test_k_expansion_matches_reference_for_every_byte_value():
    v1 = torch.cat((_all_byte_words(), _rand((64, 64), seed=4).view(-1, 4)))
    got = bl.expand_v2(bl.words_of(bl.to_v2(v1, "k"))).view(torch.int16)   # [N, 1, 8]
    assert torch.equal(got.flatten(-2), _ref_fp16(v1))


def test_k_registers_equal_the_default_variants_expansion():
    v1 = torch.cat((_all_byte_words(seed=5), _rand((256, 4), seed=6)))
    assert torch.equal(bl.expand_v2_regs(bl.words_of(bl.to_v2(v1, "k"))),
                       _dq2_v1(bl.words_of(v1)))


def test_v_expansion_matches_reference_token_pairs():
    rows = torch.cat((_all_byte_words(seed=7).view(-1, 64), _rand((2, 3, 16, 64), seed=8)
                      .view(-1, 64)))                            # 16 + 96 rows, S even
    pair = _v_pair_words(rows)
    got = bl.expand_v2(bl.words_of(bl.to_v2(rows, "v")))
    assert torch.equal(got.view(torch.int16).flatten(-2), _ref_fp16(pair))
    assert torch.equal(bl.expand_v2_regs(bl.words_of(bl.to_v2(rows, "v"))),
                       _dq2_v1(bl.words_of(pair)))
    # what the kernel reads for tokens A, B at head dim d: nibble d of row A and of row B
    vals = got.float().view(rows.shape[0] // 2, 2, 16, 8)         # [pair, zs, word, code]
    a_ref = e2m1_decode(unpack_nibbles(rows[0::2])) * 2.0 ** -14   # [pair, 128]
    assert torch.equal(vals[:, 0, :, 0], a_ref[:, 0::8])         # c0 of word q = dim 8q


def test_convert_pages_in_place_and_back():
    from nibble.kernels import PageLayout
    layout = PageLayout("nvfp4", 2, 2, 128, 16)
    pool = _rand((3, 2, layout.layer_nbytes), seed=9)
    before = pool.clone()
    view = layout.layer_view(pool, 1)
    bl.convert_pages_(view, 2)
    assert torch.equal(view.k_data, bl.to_v2(layout.layer_view(before, 1).k_data, "k"))
    assert torch.equal(view.v_scale, layout.layer_view(before, 1).v_scale)
    assert torch.equal(pool[:, 0], before[:, 0])                 # the other layer untouched
    bl.convert_pages_(view, 1)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("codes,kind,match", [
    (torch.zeros(4, 64, dtype=torch.int32), "k", "uint8"),
    (torch.zeros(4, 62, dtype=torch.uint8), "k", "n % 4"),
    (torch.zeros(3, 64, dtype=torch.uint8), "v", "S must be even"),
    (torch.zeros(64, dtype=torch.uint8), "v", r"\[\.\.\., S, n\]"),
    (torch.zeros(2, 64, dtype=torch.uint8), "q", "kind"),
])
def test_rejects_bad_inputs(codes, kind, match):
    for fn in (bl.to_v2, bl.from_v2):
        with pytest.raises(KernelInputError, match=match):
            fn(codes, kind)


def test_v2_variants_are_registered_and_never_default():
    assert set(bl.KINDS) == {"k", "v"}
    assert all(cd.code_layout_of(v) == 2 for v in cd.V2_VARIANTS)
    assert all(cd.code_layout_of(v) == 1 for v in cd.VARIANTS + cd.FP8_VARIANTS)
    assert set(cd.V2_VARIANTS) <= set(cd.DIAG_VARIANTS) and cd.DEFAULT_VARIANT not in cd.V2_VARIANTS


# ---------------------------------------------------------------- GPU

@pytest.mark.parametrize("seq_lens,s,h,group,splits", [
    ((5, 64, 33, 1000), 16, 2, 4, None),
    ((100, 17, 300), 64, 2, 4, 1),
    ((700, 1), 32, 1, 8, 2),
    ((4000, 3), 16, 2, 4, 20),
])
@pytest.mark.parametrize("variant", cd.V2_VARIANTS)
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
def test_v2_variant_matches_reference_and_default(seq_lens, s, h, group, splits, variant):
    layout, pool, tables, lens, q = _case(seq_lens, s, h, group, seed=len(seq_lens) + s)
    base = _run(layout, pool, tables, lens, q, num_splits=splits, variant=cd.DEFAULT_VARIANT)
    v2 = pool.clone()
    for layer in range(layout.num_layers):
        bl.convert_pages_(layout.layer_view(v2, layer), 2)
    got = _run(layout, v2, tables, lens, q, num_splits=splits, variant=variant, code_layout=2)
    assert _err(layout, pool, tables, lens, q, got) < 3e-3
    assert torch.equal(got, base)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("variant,code_layout", [
    (cd.V2_VARIANTS[0], 1), (cd.DEFAULT_VARIANT, 2), (cd.DEFAULT_FP8_VARIANT, 2)])
def test_refuses_mixed_layouts(variant, code_layout):
    fmt = "fp8_e4m3" if variant in cd.FP8_VARIANTS else "nvfp4"
    layout, pool, tables, lens, q = _case((40,), 16, 2, 4, seed=3, fmt=fmt)
    with pytest.raises(KernelInputError, match="code layout"):
        _run(layout, pool, tables, lens, q, variant=variant, code_layout=code_layout)
