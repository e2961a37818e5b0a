"""Fused decoder layers (kernels/triton/layer_ops.py, qkv.py) through a real EngineCore.

The same model runs with fused kernels off (torch ops) and on (Triton; on CPU under
the interpreter): every step's logits must agree and greedy tokens must match,
through prefill, extend and decode; every step must take the fused QKV path
(one launch for QK-norm, RoPE, the K recipe and the store, which also hands
prefill and extend rows their transformed fresh K/V).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from nibble.services.attention import TritonAttentionBackend
from nibble.services.attention.calibration import calibrate_pool
from nibble.services.config import DeviceConfig

from .conftest import make_engine_with, mixed_arrivals, run_scenario, tiny_arch, tiny_model
from .test_k_recipe_backends import BF16_RECIPE, TextTokenizer

pytestmark = pytest.mark.skipif(TritonAttentionBackend is None,
                                reason="Triton is not importable")


@contextlib.contextmanager
def fused(model, on: bool):
    model.set_fused_kernels(on)
    try:
        yield
    finally:
        model.set_fused_kernels(False)


def _engine(model, kv, device="cpu", calibrate=True, **kw):
    eng = make_engine_with(model, "triton", kv=kv, device=device, chunked_prefill_size=16, **kw)
    if calibrate:
        calibrate_pool(model, TextTokenizer(), eng.pool, model.arch)
    return eng


@contextlib.contextmanager
def count_fused():
    """Counts ``TritonAttentionBackend.forward_fused`` calls as [fused, declined], graph
    captures included (a replayed step calls nothing in Python)."""
    counts = [0, 0]
    orig = TritonAttentionBackend.forward_fused

    def spy(self, layer, inp, meta):
        out = orig(self, layer, inp, meta)
        counts[out is None] += 1
        return out
    TritonAttentionBackend.forward_fused = spy
    try:
        yield counts
    finally:
        TritonAttentionBackend.forward_fused = orig


def _compare(model, kv, tol, device="cpu", near_ties=False, **kw):
    """Runs the scenario unfused and fused; every sampled step's logits agree within ``tol``.

    ``near_ties``: a greedy token may differ only at a step where the reference's top-2
    logit margin is below ``2 * tol`` (a near tie that rounding may flip: bf16 rounding
    before an NVFP4 store can flip a code, about 1/6 of a block's range); the sequences
    diverge after it, so the comparison stops there. Without it tokens must be identical.
    """
    ref = run_scenario(_engine(model, kv, device, disable_fused_kernels=True, **kw),
                       mixed_arrivals())
    with count_fused() as counts:          # from the build on: it captures the CUDA graphs
        eng = _engine(model, kv, device, disable_fused_kernels=False, **kw)  # fused on CUDA
        with fused(model, True):
            got = run_scenario(eng, mixed_arrivals())
    assert got[2] == ref[2] == {"prefill", "extend", "decode", "mixed"}
    assert counts[0] > 0 and counts[1] == 0, counts    # every step fused, prefill ones too
    worst, flipped = 0.0, False
    for g, r in zip(got[0], ref[0]):
        assert g.shape == r.shape
        worst = max(worst, float((g - r).abs().max()))
        assert worst <= tol, worst
        differs = g.argmax(-1) != r.argmax(-1)
        if differs.any():
            assert near_ties, "greedy token flipped"
            top2 = r[differs].topk(2, dim=-1).values
            margin = float((top2[:, 0] - top2[:, 1]).max())
            assert margin <= 2 * tol, f"token flipped at a margin of {margin}"
            flipped = True
            break
    if not flipped:
        assert got[1] == ref[1]
    return worst


@pytest.fixture(scope="module")
def model64():
    return tiny_model(tiny_arch("qwen3", head_dim=64), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (CPU only)")
def test_fused_matches_unfused_bf16_recipe(model64):
    """BF16 elements with the calibrated recipe: only float32 rounding differs."""
    _compare(model64, BF16_RECIPE, 1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (CPU only)")
def test_fused_matches_unfused_nvfp4(model64):
    """The default NVFP4 recipe: a K code may flip where fp32 rounding moves a value across
    a boundary; measured identical here."""
    _compare(model64, "nvfp4", 2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (CPU only)")
def test_fused_on_the_static_graph_path(model64):
    """The decode graphs' static buffers (run eagerly on CPU): padded rows, slot -1."""
    _compare(model64, "nvfp4", 2e-2, graph_max_bs=4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run (CPU only)")
def test_fused_declines_fp8_fresh_kv(model64):
    eng = _engine(model64, "fp8_e4m3", calibrate=False, prefill_kv_dtype="fp8_e4m3",
                  disable_fused_kernels=False)
    with fused(model64, True), count_fused() as counts:
        run_scenario(eng, {0: mixed_arrivals()[0]})
    assert counts[0] == 0 and counts[1] > 0


def test_flag_turns_the_backend_path_off(model64):
    eng = make_engine_with(model64, "triton", kv="bf16", disable_fused_kernels=False)
    backend = eng.runner.backend
    assert backend.fused
    off = TritonAttentionBackend(eng.pool, model64.arch.sm_scale,
                                 device_cfg=DeviceConfig(disable_fused_kernels=True))
    assert not off.fused


def test_gemma_keeps_its_torch_layers():
    from nibble.services.models.gemma3 import Gemma3CausalLM
    model = Gemma3CausalLM(tiny_arch("gemma3", qk_norm=True))
    model.set_fused_kernels(True)
    assert not model.fused_kernels


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_matches_unfused_on_gpu_with_graphs(head_dim):
    """bf16 model, decode replayed from CUDA graphs captured after calibration (their recipe
    parameters must already be on the device); head_dim 128 decodes with the CUDA kernel,
    64 with Triton's."""
    model = tiny_model(tiny_arch("qwen3", head_dim=head_dim, num_heads=8, num_kv_heads=2),
                       torch.bfloat16).cuda()
    for kv in ("nvfp4", "fp8_e4m3"):
        # fused QKV rounds K once (fp32 -> code), unfused rounds to bf16 first: near a code
        # boundary that flips an NVFP4 code (a step of ~1/6 of the block's range) or an E4M3
        # one (1/8 of the value), so logits move by up to ~0.3 (NVFP4 measured 0.28 at a
        # logit scale of ~4; FP8 0.05 with decode steps fused, 0.11-0.18 since prompt rows
        # are fused too: a flipped code in a prompt's K is read by every later step)
        _compare(model, kv, 0.35, device="cuda", near_ties=True, graph_max_bs=8, use_graphs=True)


@pytest.mark.gpu
def test_pdl_decode_gives_the_same_logits_on_gpu():
    """The CUDA decode kernel launched as the QKV kernel's programmatic dependent (the
    default) against the plain launch (--disable-pdl): it only changes when the decode's
    CTAs start, so every step's logits are bit-identical, CUDA graphs included."""
    model = tiny_model(tiny_arch("qwen3", head_dim=128, num_heads=8, num_kv_heads=2),
                       torch.bfloat16).cuda()
    for kv in ("nvfp4", "fp8_e4m3"):
        runs = []
        for off in (True, False):
            eng = _engine(model, kv, "cuda", disable_fused_kernels=False, graph_max_bs=8,
                          use_graphs=True, disable_pdl=off)
            backend = eng.runner.backend
            assert backend.decode_impl == "cuda-sm90" and backend.pdl is not off
            with fused(model, True):
                runs.append(run_scenario(eng, mixed_arrivals()))
        assert runs[0][1] == runs[1][1]
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
