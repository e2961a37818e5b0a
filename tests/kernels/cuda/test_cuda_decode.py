"""CUDA C++ NVFP4 / FP8 decode against the fp32 torch reference (GPU), and its input checks (CPU).

GPU cases need compute capability 9.0 (the extension is built for sm_90a on first
use, about a minute). Outputs are poisoned with NaN; pools start as random bytes,
so slots past a sequence's end hold garbage (NaN scales included) that must be
masked. The MMA operands are fp16, hence the 3e-3 bound (bf16 output adds its own
rounding).
"""

from __future__ import annotations


import pytest
import torch

from nibble.kernels import KernelInputError, PageLayout, decode_attention_ref, store_kv_ref
from nibble.kernels.layout import LayerPages
from nibble.kernels.cuda import FP8_VARIANTS, VARIANTS, decode_attention_cuda, is_built

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
K_SCALE, V_SCALE = 0.37, 2.0


def _case(seq_lens, s=16, h=2, group=4, seed=0, q_dtype=torch.bfloat16, layer=1, fmt="nvfp4"):
    """A 2-layer pool of random bytes with every slot of ``layer`` stored; shuffled tables."""
    layout = PageLayout(fmt, 2, h, 128, s)
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // s) for n in seq_lens)
    pages = len(seq_lens) * width + 1
    pool = layout.allocate(pages).random_(0, 256, generator=gen)
    n = pages * s
    k = torch.randn(n, h, 128, generator=gen) * 2 + torch.randn(1, h, 128, generator=gen)
    v = torch.randn(n, h, 128, generator=gen)
    store_kv_ref(layout, layout.layer_view(pool, layer), k, v, torch.arange(n), K_SCALE, V_SCALE)
    tables = torch.randperm(pages, generator=gen)[:len(seq_lens) * width]
    tables = tables.to(torch.int32).view(len(seq_lens), width)
    q = torch.randn(len(seq_lens), h * group, 128, generator=gen).to(q_dtype)
    return layout, pool, tables, torch.tensor(seq_lens, dtype=torch.int32), q


def _run(layout, pool, tables, lens, q, out_dtype=torch.float32, layer=1, **kw):
    dev = torch.device("cuda")
    view = layout.layer_view(pool.to(dev), layer)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=dev)
    got = decode_attention_cuda(layout, view, q.to(dev), tables.to(dev), lens.to(dev),
                                      128 ** -0.5, K_SCALE, V_SCALE, out=out, **kw)
    assert got is out
    return got.float().cpu()


def _err(layout, pool, tables, lens, q, got, layer=1):
    ref = decode_attention_ref(layout, layout.layer_view(pool, layer), q.float(), tables,
                               lens.long(), 128 ** -0.5, K_SCALE, V_SCALE)
    assert torch.isfinite(got).all(), "unwritten (NaN) outputs"
    return ((got - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("seq_lens,s,h,group,splits", [
    ((5, 64, 33, 1000), 16, 2, 4, None),
    ((5, 64, 33, 1000), 16, 2, 4, 3),
    ((100, 17, 300), 64, 2, 4, 1),
    ((700, 1), 32, 1, 8, 2),
    ((250,), 16, 4, 1, None),
    ((4000, 3), 16, 2, 4, 20),   # many splits: some warps and CTAs get no tile
    ((9000, 3), 16, 2, 4, 70),   # more splits than the reduce kernel has split groups (32)
])
@pytest.mark.parametrize("fmt,variant", [("nvfp4", v) for v in VARIANTS] +
                         [("fp8_e4m3", v) for v in FP8_VARIANTS])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
def test_decode_matches_reference(seq_lens, s, h, group, splits, fmt, variant):
    layout, pool, tables, lens, q = _case(seq_lens, s, h, group, seed=len(seq_lens) + s, fmt=fmt)
    got = _run(layout, pool, tables, lens, q, num_splits=splits, variant=variant)
    assert _err(layout, pool, tables, lens, q, got) < 3e-3


@pytest.mark.parametrize("seq_lens,s,h,group,splits", [
    ((5, 64, 33, 1000), 16, 2, 4, 3),
    ((100, 17, 300), 64, 2, 4, 1),
    ((9000, 3), 16, 2, 4, 16),   # one level, the largest
    ((9000, 3), 16, 2, 4, 17),   # two levels: a group of 16 and a group of one
    ((9000, 3), 16, 2, 4, 70),   # the short sequence: whole groups of empty splits
    ((40000,), 16, 1, 8, 80),    # 80 splits of one head: five groups of 16
    ((60000,), 16, 1, 4, 256),   # the fused combine's capacity: 16 groups of 16
])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
def test_fused_combine_matches_reduce_kernel(seq_lens, s, h, group, splits, fmt):
    """The in-kernel combine against the reduce kernel and the reference, and its counters."""
    from nibble.kernels.cuda import decode as cd
    layout, pool, tables, lens, q = _case(seq_lens, s, h, group, seed=splits, fmt=fmt)
    fused = _run(layout, pool, tables, lens, q, num_splits=splits, combine="fused")
    again = _run(layout, pool, tables, lens, q, num_splits=splits, combine="fused")
    kernel = _run(layout, pool, tables, lens, q, num_splits=splits, combine="kernel")
    assert torch.equal(fused, again)               # the last CTA adds splits in a fixed order
    assert (fused - kernel).abs().max().item() < 1e-5 * max(kernel.abs().max().item(), 1.0)
    assert _err(layout, pool, tables, lens, q, fused) < 3e-3
    assert int(cd._COUNTERS[0].count_nonzero()) == 0   # every launch leaves them at zero


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
def test_first_call_under_capture_takes_reduce_kernel(monkeypatch):
    """No counter buffer yet while capturing: the graph holds the two-kernel form, still right."""
    from nibble.kernels.cuda import decode as cd
    monkeypatch.setattr(cd, "_COUNTERS", {})
    layout, pool, tables, lens, q = _case((3000, 40), 16, 2, 4, seed=12)
    dev = torch.device("cuda")
    view = layout.layer_view(pool.to(dev), 1)
    q_d, t_d, l_d = q.to(dev), tables.to(dev), lens.to(dev)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=dev)
    decode_attention_cuda(layout, view, q_d, t_d, l_d, 128 ** -0.5, K_SCALE, V_SCALE, out=out,
                          combine="kernel", num_splits=5)      # builds; allocates no counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention_cuda(layout, view, q_d, t_d, l_d, 128 ** -0.5, K_SCALE, V_SCALE,
                              out=out, num_splits=5, combine="fused")
    assert cd._COUNTERS == {}
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _err(layout, pool, tables, lens, q, out.cpu()) < 3e-3


@pytest.mark.parametrize("q_dtype,out_dtype,bound", [
    (torch.float16, torch.bfloat16, 8e-3), (torch.float32, torch.float16, 3e-3)])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
def test_decode_dtypes_and_int64_lengths(q_dtype, out_dtype, bound):
    layout, pool, tables, lens, q = _case((77, 512), 16, 2, 4, seed=7, q_dtype=q_dtype, layer=0)
    got = _run(layout, pool, tables, lens.long(), q, out_dtype=out_dtype, layer=0)
    assert _err(layout, pool, tables, lens, q, got, layer=0) < bound


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
def test_fp8_dtypes_and_default_variant():
    layout, pool, tables, lens, q = _case((77, 512), 16, 2, 4, seed=8, q_dtype=torch.float32,
                                          layer=0, fmt="fp8_e4m3")
    got = _run(layout, pool, tables, lens.long(), q, out_dtype=torch.float16, layer=0)
    assert _err(layout, pool, tables, lens, q, got, layer=0) < 3e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
def test_decode_cuda_graph_replay_sees_new_inputs(fmt):
    layout, pool, tables, lens, q = _case((300, 40), 16, 2, 4, seed=11, fmt=fmt)
    dev = torch.device("cuda")
    view = layout.layer_view(pool.to(dev), 1)
    q_d, t_d, l_d = q.to(dev), tables.to(dev), lens.to(dev)
    kgs = torch.tensor([K_SCALE], device=dev)
    vgs = torch.tensor([V_SCALE], device=dev)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=dev)

    def step():
        decode_attention_cuda(layout, view, q_d, t_d, l_d, 128 ** -0.5, kgs, vgs, out=out,
                                    max_seq_len=512)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q2 = torch.randn_like(q)
    lens2 = torch.tensor([17, 299], dtype=torch.int32)
    q_d.copy_(q2.to(dev))
    l_d.copy_(lens2.to(dev))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _err(layout, pool, tables, lens2, q2, out.cpu()) < 3e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3"])
def test_pdl_after_the_qkv_kernel_reads_its_writes(fmt):
    """qkv_rope_store writes q and each sequence's newest token; the decode kernel launched
    as its programmatic dependent (eagerly and from a CUDA graph) must see both: the same
    bytes as the plain launch. Every other slot holds older K/V, so a last tile read before
    the QKV kernel finished would change the output. Lengths cover a last tile that is the
    only tile of a warp's range, a full last tile, and many splits."""
    from nibble.kernels.triton import qkv_rope_store
    seq_lens = (1, 16, 33, 1000, 4000)
    layout, pool, tables, lens, _ = _case(seq_lens, 16, 2, 4, seed=21, fmt=fmt)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(len(seq_lens), (8 + 2 * 2) * 128, generator=gen) * 2).to(dev, torch.bfloat16)
    cos = torch.ones(len(seq_lens), 128, device=dev)
    sin = torch.zeros(len(seq_lens), 128, device=dev)
    last = lens.long() - 1
    slots = (tables[torch.arange(len(seq_lens)), last // 16].long() * 16 + last % 16).to(dev)
    t_d, l_d = tables.to(dev), lens.to(dev)
    kgs = torch.tensor([K_SCALE], device=dev)
    vgs = torch.tensor([V_SCALE], device=dev)

    def step(pdl, view, out):
        q = qkv_rope_store(layout, view, qkv, 8, cos, sin, slots, kgs, vgs, pdl_trigger=pdl)
        decode_attention_cuda(layout, view, q, t_d, l_d, 128 ** -0.5, kgs, vgs, out=out,
                              num_splits=6, pdl=pdl)

    outs = []
    for pdl, graphed in ((False, False), (True, False), (True, True)):
        view = layout.layer_view(pool.to(dev), 1)
        out = torch.full((len(seq_lens), 8, 128), float("nan"), device=dev)
        if graphed:
            step(False, layout.layer_view(pool.to(dev), 1), out)     # warm-up off the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(pdl, view, out)
            out.fill_(float("nan"))
            graph.replay()
        else:
            step(pdl, view, out)
        torch.cuda.synchronize()
        outs.append(out.cpu())
    stale = layout.layer_view(pool.to(dev), 1)        # the decode alone, before any store
    q0 = qkv_rope_store(layout, layout.layer_view(pool.to(dev), 1), qkv, 8, cos, sin,
                        torch.full_like(slots, -1), kgs, vgs)
    before = decode_attention_cuda(layout, stale, q0, t_d, l_d, 128 ** -0.5, kgs, vgs,
                                   num_splits=6, out=torch.empty_like(outs[0], device=dev))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    assert not torch.equal(before.cpu(), outs[0])      # the new token matters to the output


# ---------------------------------------------------------------- CPU: checks, no build

def _cpu_args(fmt="nvfp4", d=128, s=16, h=2, hq=8, q_dtype=torch.bfloat16):
    layout = PageLayout(fmt, 1, h, d, s)
    pool = layout.allocate(4)
    q = torch.zeros(2, hq, d, dtype=q_dtype)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    return layout, layout.layer_view(pool, 0), q, tables, lens


@pytest.mark.parametrize("kwargs,message", [
    (dict(fmt="bf16"), "NVFP4 or FP8 E4M3"),
    (dict(fmt="fp8k_nvfp4v"), "NVFP4 or FP8 E4M3"),
    (dict(d=64), "head_dim"),
    (dict(s=48), "page_size"),
    (dict(hq=32), "query heads per KV head"),
    (dict(hq=7), "multiple"),
    (dict(q_dtype=torch.int32), "bf16/fp16/fp32"),
    (dict(), "CUDA device"),
])
def test_rejects_bad_inputs_without_building(kwargs, message):
    layout, view, q, tables, lens = _cpu_args(**kwargs)
    with pytest.raises(KernelInputError, match=message):
        decode_attention_cuda(layout, view, q, tables, lens, 0.1)
    assert not is_built() or HAS_SM90


def test_import_builds_nothing():
    import nibble.kernels.cuda as mod
    assert callable(mod.decode_attention_cuda)
    if not torch.cuda.is_available():
        assert not is_built()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("kwargs,message", [
    (dict(out=torch.empty(2, 8, 64)), "out must be"),
    (dict(variant=5), "variant"),
    (dict(combine="atomic"), "combine must be one of"),
    (dict(combine="fused", num_splits=257), "takes up to 256 splits"),
    (dict(num_splits=0), "num_splits"),
    (dict(fmt="fp8_e4m3", variant=VARIANTS[0]), "variant must be one of"),
    (dict(variant=FP8_VARIANTS[0]), "variant must be one of"),
])
def test_rejects_bad_options_on_gpu(kwargs, message):
    layout, view, q, tables, lens = _cpu_args(fmt=kwargs.pop("fmt", "nvfp4"))
    pool = layout.allocate(4, "cuda")
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(KernelInputError, match=message):
        decode_attention_cuda(layout, layout.layer_view(pool, 0), q.cuda(), tables.cuda(),
                              lens.cuda(), 0.1, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90 GPU")
def test_rejects_page_stride_of_4_gib():
    layout, _, q, tables, lens = _cpu_args()
    view = layout.layer_view(layout.allocate(1, "cuda"), 0)   # one page: any page stride is valid
    huge = LayerPages(*(v.as_strided(v.shape, (1 << 32,) + v.stride()[1:]) for v in view))
    with pytest.raises(KernelInputError, match="page stride"):
        decode_attention_cuda(layout, huge, q.cuda(), tables[:, :1].cuda(), lens.cuda(), 0.1)
