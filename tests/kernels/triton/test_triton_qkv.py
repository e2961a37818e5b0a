"""The fused QK-norm + RoPE + K recipe + K/V store kernel against its torch reference.

The pool starts as random bytes (poison): outside the slots written, every byte
must be unchanged. Inside them the kernel and the reference quantize values that
agree to float32 rounding (bf16 MMA operands on a GPU), so a code may flip where a
value sits on a rounding boundary: the dequantized rows must agree closely and
almost every byte must match.
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError, PageLayout
from nibble.kernels.fused_ref import qkv_store_ref, qkv_transform_ref
from nibble.kernels.triton.qkv import qkv_rope_store

HAS_CUDA = torch.cuda.is_available()
CPU = pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA,
                                                  reason="interpreter only without CUDA"))
GPU = pytest.param("cuda", marks=pytest.mark.gpu)


def _rope_tables(pos: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    f = torch.outer(pos.float(), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


def _recipe(h: int, d: int, gen: torch.Generator):
    """A shift and an invertible map (orthogonal times a diagonal), q_map = k_map^-T."""
    qr = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0]
    k_map = qr * torch.exp(torch.randn(h, 1, d, generator=gen, dtype=torch.float64) * 0.3)
    q_map = torch.linalg.inv(k_map).mT
    shift = torch.randn(h, d, generator=gen) * 0.5
    return shift, k_map.float().contiguous(), q_map.float().contiguous()


def _read(layout: PageLayout, pages, slots: torch.Tensor, gs: float, side: str) -> torch.Tensor:
    """Dequantized rows ``[n, H, D]`` float32 of the slots, from the K or V side."""
    s = layout.page_size
    page, off = slots // s, slots % s
    data = getattr(pages, f"{side}_data")[page, :, off]
    scales = getattr(pages, f"{side}_scale")
    scales = None if scales is None else scales[page, :, off]
    return getattr(layout.fmt, side).dequantize(data, scales, gs, torch.float32)


def _blank(layout: PageLayout, pages, slots: torch.Tensor) -> None:
    s = layout.page_size
    for view in pages:
        if view is not None:
            view[slots // s, :, slots % s] = 0


def _run(device, fmt="nvfp4", hq=4, h=2, d=64, t=19, page=16, recipe=True, qk_norm=True,
         v_shift=False, dtype=torch.float32, seed=0, bt=None, split=None, pdl_trigger=False):
    gen = torch.Generator().manual_seed(seed)
    layout = PageLayout(fmt, 2, h, d, page)
    npages = -(-t // page) + 2
    pool = layout.allocate(npages)
    pool.random_(0, 256, generator=gen)
    expect = pool.clone()
    qkv = (torch.randn(t, (hq + 2 * h) * d, generator=gen) * 2).to(dtype)
    cos, sin = _rope_tables(torch.randint(0, 4000, (t,), generator=gen), d)
    slots = torch.randperm(npages * page, generator=gen)[:t]
    slots[t // 2] = -1                                       # padding row: not stored
    norms = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5) \
        if qk_norm else (None, None)
    shift, k_map, q_map = _recipe(h, d, gen) if recipe else (None, None, None)
    vs = torch.randn(h, d, generator=gen) if v_shift else None
    kw = dict(q_norm=norms[0], k_norm=norms[1], eps=1e-6, k_shift=shift, k_map=k_map,
              q_map=q_map, v_shift=vs)
    q_ref = qkv_store_ref(layout, layout.layer_view(expect, 1), qkv, hq, cos, sin, slots,
                          0.5, 2.0, **kw)
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    pool_dev = pool.to(device)
    q = qkv_rope_store(layout, layout.layer_view(pool_dev, 1), qkv.to(device), hq,
                       cos.to(device), sin.to(device), slots.to(device), 0.5, 2.0,
                       **{k: dev(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
                       tokens_per_program=bt, split_halves=split, pdl_trigger=pdl_trigger)
    return layout, pool_dev.cpu(), expect, slots, q.cpu(), q_ref


def _check(run, q_tol, kv_tol, flip_share):
    layout, got, expect, slots, q, q_ref = run
    assert q.dtype == q_ref.dtype
    assert float((q.double() - q_ref.double()).norm() / q_ref.double().norm()) < q_tol
    live = slots[slots >= 0]
    pg, pe = layout.layer_view(got, 1), layout.layer_view(expect, 1)
    for side, gs in (("k", 0.5), ("v", 2.0)):
        a, b = _read(layout, pg, live, gs, side), _read(layout, pe, live, gs, side)
        assert torch.isfinite(a).all()
        assert float((a - b).norm() / b.norm()) < kv_tol, side
    flips = sum(int((x != y).sum()) for x, y in zip(pg, pe) if x is not None)
    total = sum(x[live // layout.page_size].numel() // layout.page_size for x in pg
                if x is not None)
    assert flips <= flip_share * total, f"{flips} of {total} bytes differ"
    _blank(layout, pg, live)
    _blank(layout, pe, live)
    assert torch.equal(got, expect), "bytes outside the written slots changed"


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("recipe", [True, False])
def test_qkv_matches_reference_interpreted(device, fmt, recipe):
    _check(_run(device, fmt, recipe=recipe), 1e-5, 1e-3, 0.002)


@pytest.mark.parametrize("device", [CPU])
def test_qkv_no_qk_norm_group_one_head_dim_32_v_shift(device):
    _check(_run(device, hq=2, h=2, d=32, t=5, qk_norm=False, v_shift=True), 1e-5, 1e-3, 0.01)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("bt", [32, 64])
def test_qkv_long_input_tiles(device, bt):
    """The prefill tiles (more tokens per program), a partial last tile included."""
    _check(_run(device, t=bt + 19, bt=bt, v_shift=True), 1e-5, 1e-3, 0.002)


@pytest.mark.parametrize("device", [CPU, GPU])
def test_pdl_trigger_changes_no_byte(device):
    """The trigger only lets a programmatic dependent start early: q' and the pages are the
    bytes of the plain launch (interpreted it is ignored; on a GPU it is compiled in)."""
    kw = dict(t=16, seed=9) if device == "cpu" else dict(t=16, seed=9, hq=32, h=8, d=128,
                                                         dtype=torch.bfloat16)
    plain, trig = _run(device, **kw), _run(device, pdl_trigger=True, **kw)
    assert torch.equal(plain[4], trig[4]) and torch.equal(plain[1], trig[1])


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("bt", [16, 64])
def test_split_halves_write_the_same_bytes(device, fmt, bt):
    """One program per output half (decode's default) against one per head. Interpreted:
    the same q' and page bytes (each half is its own quantization blocks; the map's sums run
    in one order). On a GPU the two programs' MMAs may accumulate in another order, so fp32
    results differ in the last bits and a bf16 rounding can flip: both are checked against
    the reference, and against each other within that rounding."""
    kw = dict(fmt=fmt, t=bt + 3, bt=bt, v_shift=True, seed=5)
    if device == "cuda":
        kw.update(hq=32, h=8, d=128, dtype=torch.bfloat16)
    one = _run(device, split=False, **kw)
    two = _run(device, split=True, **kw)
    if device == "cpu":
        assert torch.equal(one[4], two[4])
        assert torch.equal(one[1], two[1])
        _check(two, 1e-5, 1e-3, 0.002)
        return
    q1, q2 = one[4].float(), two[4].float()
    assert float((q1 - q2).norm() / q1.norm()) < 4e-3      # one bf16 ulp is 2^-8 relative
    for run in (one, two):   # bf16 pages: the operands' ~3e-3 error flips many low bytes
        _check(run, 1.5e-2, 0.06 if fmt == "nvfp4" else 0.02, 0.5 if fmt == "bf16" else 0.12)


@pytest.mark.parametrize("device", [CPU])
def test_qkv_bf16_input_page_64(device):
    _check(_run(device, dtype=torch.bfloat16, page=64, t=17), 1e-2, 1e-3, 0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
@pytest.mark.parametrize("t", [16, 61, 300, 2100])
@pytest.mark.parametrize("recipe", [True, False])
def test_qkv_matches_reference_gpu(fmt, t, recipe):
    """Qwen3-8B's attention shape (32 query / 8 KV heads, head_dim 128), bf16 input."""
    run = _run("cuda", fmt, hq=32, h=8, d=128, t=t, page=64, recipe=recipe,
               dtype=torch.bfloat16, seed=t)
    # bf16 MMA operands: q' and K' carry ~3e-3 relative error before quantization.
    _check(run, 1.5e-2, 0.06 if fmt == "nvfp4" else 0.02, 0.12)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("v_shift", [True, False])
def test_kv_out_holds_the_transformed_rows(device, v_shift):
    """k_out / v_out get K' = (rope(norm(k)) - c) @ M and v - v_shift in their dtype (strided
    views of a bigger buffer), and the pages get the same bytes as without them."""
    gen = torch.Generator().manual_seed(11)
    hq, h, d, t = (32, 8, 128, 70) if device == "cuda" else (4, 2, 64, 19)
    layout = PageLayout("nvfp4", 2, h, d, 16)
    npages = -(-t // 16) + 1
    qkv = (torch.randn(t, (hq + 2 * h) * d, generator=gen) * 2).to(torch.bfloat16)
    cos, sin = _rope_tables(torch.randint(0, 4000, (t,), generator=gen), d)
    shift, k_map, q_map = _recipe(h, d, gen)
    kw = dict(q_norm=torch.rand(d, generator=gen) + 0.5, k_norm=torch.rand(d, generator=gen) + 0.5,
              eps=1e-6, k_shift=shift, k_map=k_map, q_map=q_map,
              v_shift=torch.randn(h, d, generator=gen) if v_shift else None)
    _, k_ref, v_ref = qkv_transform_ref(qkv, hq, h, cos, sin, **kw)
    slots = torch.randperm(npages * 16, generator=gen)[:t].to(device)
    dev = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    args = (qkv.to(device), hq, cos.to(device), sin.to(device), slots, 0.5, 2.0)
    pools = [layout.allocate(npages, device).zero_() for _ in range(2)]
    kv = torch.full((t, 2 * h + 3, d), float("nan"), dtype=torch.bfloat16, device=device)
    k_out, v_out = kv[:, :h], kv[:, h + 3:]
    q1 = qkv_rope_store(layout, layout.layer_view(pools[0], 1), *args, **dev, k_out=k_out,
                        v_out=v_out)
    q0 = qkv_rope_store(layout, layout.layer_view(pools[1], 1), *args, **dev)
    assert torch.equal(q0, q1) and torch.equal(pools[0], pools[1])
    assert torch.isnan(kv[:, h:h + 3]).all()                 # the gap between the views
    tol = 1.5e-2 if device == "cuda" else 1e-2               # bf16 outputs (and MMA operands)
    for got, ref in ((k_out, k_ref), (v_out, v_ref)):
        assert float((got.double().cpu() - ref.double()).norm() / ref.double().norm()) < tol


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("split", [False, True])
def test_unmapped_k_out_and_the_attention_over_it(device, split):
    """``unmapped_kv_out``: k_out gets rope(norm(k)) - c (K before the map), v_out v - v_shift,
    the pages the same bytes as with K' out, q (q_map None) rope(norm(q)); and attending with
    those gives the recipe's attention over q', K'."""
    gen = torch.Generator().manual_seed(12)
    hq, h, d, t = (32, 8, 128, 70) if device == "cuda" else (4, 2, 64, 19)
    layout = PageLayout("nvfp4", 2, h, d, 16)
    npages = -(-t // 16) + 1
    qkv = (torch.randn(t, (hq + 2 * h) * d, generator=gen) * 2).to(torch.bfloat16)
    cos, sin = _rope_tables(torch.arange(t) + 40, d)
    shift, k_map, q_map = _recipe(h, d, gen)
    norms = dict(q_norm=torch.rand(d, generator=gen) + 0.5,
                 k_norm=torch.rand(d, generator=gen) + 0.5, eps=1e-6)
    recipe = dict(k_shift=shift, k_map=k_map, q_map=q_map, v_shift=torch.randn(h, d, generator=gen))
    q_raw, k_shifted, _ = qkv_transform_ref(qkv, hq, h, cos, sin, **norms, k_shift=shift)
    q_rec, k_rec, v_rec = qkv_transform_ref(qkv, hq, h, cos, sin, **norms, **recipe)
    slots = torch.randperm(npages * 16, generator=gen)[:t].to(device)
    dev = lambda kw: {k: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
                      for k, v in kw.items()}
    args = (qkv.to(device), hq, cos.to(device), sin.to(device), slots, 0.5, 2.0)
    pools = [layout.allocate(npages, device).zero_() for _ in range(2)]
    outs = [torch.empty(t, h, d, dtype=torch.bfloat16, device=device) for _ in range(4)]
    qkv_rope_store(layout, layout.layer_view(pools[0], 1), *args, **dev(norms), **dev(recipe),
                   k_out=outs[0], v_out=outs[1], split_halves=split)
    q = qkv_rope_store(layout, layout.layer_view(pools[1], 1), *args, **dev(norms),
                       **dev({**recipe, "q_map": None}), k_out=outs[2], v_out=outs[3],
                       unmapped_kv_out=True, split_halves=split)
    assert torch.equal(pools[0], pools[1]) and torch.equal(outs[1], outs[3])
    tol = 1.5e-2 if device == "cuda" else 1e-2                # bf16 outputs
    for got, ref in ((q, q_raw), (outs[2], k_shifted), (outs[3], v_rec)):
        assert float((got.double().cpu() - ref.double()).norm() / ref.double().norm()) < tol

    def attend(q, k, v):
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(hq // h, 1))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double().repeat_interleave(hq // h, 1))
    torch.testing.assert_close(attend(q_raw, k_shifted, v_rec), attend(q_rec, k_rec, v_rec),
                               rtol=1e-4, atol=1e-4)          # the maps in fp32
    with pytest.raises(KernelInputError, match="unmapped_kv_out needs"):
        qkv_rope_store(layout, layout.layer_view(pools[1], 1), *args, unmapped_kv_out=True)


def test_reference_recipe_keeps_scores_up_to_a_constant_per_query():
    """q'.k' = q.k - q.c for every key: softmax sees the same attention."""
    gen = torch.Generator().manual_seed(3)
    h, d, hq, t = 2, 16, 4, 6
    qkv = torch.randn(t, (hq + 2 * h) * d, generator=gen)
    cos, sin = _rope_tables(torch.arange(t), d)
    shift, k_map, q_map = _recipe(h, d, gen)
    q0, k0, _ = qkv_transform_ref(qkv, hq, h, cos, sin, None, None, 1e-6)
    q1, k1, _ = qkv_transform_ref(qkv, hq, h, cos, sin, None, None, 1e-6, 0.0, shift, k_map,
                                  q_map)
    kk0, kk1 = k0.repeat_interleave(hq // h, 1), k1.repeat_interleave(hq // h, 1)
    s0 = torch.einsum("qhd,khd->hqk", q0, kk0)
    s1 = torch.einsum("qhd,khd->hqk", q1, kk1)
    diff = s0 - s1
    torch.testing.assert_close(diff, diff[..., :1].expand_as(diff), atol=1e-4, rtol=1e-4)


def test_checks():
    layout = PageLayout("nvfp4", 1, 2, 64, 16)
    pages = layout.layer_view(layout.allocate(2), 0)
    qkv = torch.randn(3, 8 * 64)
    cos = sin = torch.ones(3, 64)
    slots = torch.arange(3)
    with pytest.raises(KernelInputError, match="qkv must be"):
        qkv_rope_store(layout, pages, torch.randn(3, 7 * 64), 4, cos, sin, slots)
    with pytest.raises(KernelInputError, match="multiple of the 2 KV heads"):
        qkv_rope_store(layout, pages, torch.randn(3, 7 * 64), 3, cos, sin, slots)
    with pytest.raises(KernelInputError, match="tokens_per_program"):
        qkv_rope_store(layout, pages, qkv, 4, cos, sin, slots, tokens_per_program=8)
    with pytest.raises(KernelInputError, match="both or neither"):
        qkv_rope_store(layout, pages, qkv, 4, cos, sin, slots, k_out=torch.empty(3, 2, 64))
    with pytest.raises(KernelInputError, match="v_out must be"):
        qkv_rope_store(layout, pages, qkv, 4, cos, sin, slots, k_out=torch.empty(3, 2, 64),
                       v_out=torch.empty(3, 4, 64))
    with pytest.raises(KernelInputError, match="cos must be"):
        qkv_rope_store(layout, pages, qkv, 4, torch.ones(3, 32), sin, slots)
    with pytest.raises(KernelInputError, match="k_map must be"):
        qkv_rope_store(layout, pages, qkv, 4, cos, sin, slots, k_map=torch.ones(2, 64, 32))
    with pytest.raises(KernelInputError, match="slot_mapping"):
        qkv_rope_store(layout, pages, qkv, 4, cos, sin, slots[:2])
    with pytest.raises(KernelInputError, match="head_dim"):
        lay = PageLayout("nvfp4", 1, 2, 48, 16)
        qkv_rope_store(lay, lay.layer_view(lay.allocate(1), 0), torch.randn(3, 8 * 48), 4,
                       torch.ones(3, 48), torch.ones(3, 48), slots)


@pytest.mark.gpu
def test_warm_long_inputs_compiles_what_prompts_launch():
    """After ``warm_long_inputs``, a long fresh prompt (no query map, K out before the map)
    and a long chunk beside decode rows (the whole recipe) compile nothing new: a Triton
    compile would otherwise land in a served step."""
    from nibble.kernels.triton.qkv import LONG_INPUT, _qkv_kernel, warm_long_inputs
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    hq, h, d, t = 32, 8, 128, LONG_INPUT + 300
    layout = PageLayout("nvfp4", 2, h, d, 64)
    pool = layout.allocate(-(-t // 64) + 1, dev)
    pages = layout.layer_view(pool, 1)
    shift, k_map, q_map = _recipe(h, d, gen)
    params = dict(k_shift=shift.to(dev), k_map=k_map.to(dev, torch.bfloat16),
                  q_map=q_map.to(dev, torch.bfloat16), v_shift=None)
    scales = torch.ones(4, device=dev)           # as the backend's [L, 2] global scales
    norm = torch.ones(d, dtype=torch.bfloat16, device=dev)
    assert warm_long_inputs(layout, pages, hq, torch.bfloat16, True, params, scales[0:1],
                            scales[1:2], dev) == 2

    def compiled() -> int:
        return sum(len(c[0]) for c in _qkv_kernel.device_caches.values())
    before = compiled()
    qkv = torch.randn(t, (hq + 2 * h) * d, device=dev, dtype=torch.bfloat16)
    rope = torch.rand(t, 1, d, device=dev, dtype=torch.bfloat16)
    slots = torch.arange(t, device=dev)
    kv = {n: torch.empty(t, h, d, dtype=torch.bfloat16, device=dev) for n in ("k_out", "v_out")}
    for p, unmapped in ((params, False), ({**params, "q_map": None}, True)):
        for layer in (0, 1):                    # scale addresses 16-byte aligned, then not
            ks, vs = scales[2 * layer:2 * layer + 1], scales[2 * layer + 1:2 * layer + 2]
            qkv_rope_store(layout, pages, qkv, hq, rope, rope, slots, ks, vs, norm, norm, 1e-6,
                           **p, **kv, unmapped_kv_out=unmapped)
    torch.cuda.synchronize()
    assert compiled() == before
