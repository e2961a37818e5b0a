"""The calibrated K recipe through the attention backends (services/attention).

With BF16 elements a recipe changes nothing but rounding (softmax ignores the
per-query constant q . shift), so an engine on a recipe format must produce the
logits of plain BF16 through prefill, chunked extend, prefix-cache extend and
decode: a path that missed the transform (fresh K uncentered, q not mapped)
would move them by far more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KV_CACHE_FORMATS, KVCacheFormat, register_kv_format
from nibble.kernels.formats import BF16, KRecipe
from nibble.services.attention import TritonAttentionBackend
from nibble.services.attention.calibration import (CALIBRATION_TEXT, MAP_RUN_TOKENS,
                                                   SHIFT_CONTEXT, calibrate_pool,
                                                   calibration_ids, calibration_starts,
                                                   capture_qkv)

from .conftest import make_engine_with, mixed_arrivals, run_scenario, tiny_arch, tiny_model

BF16_RECIPE = "test_bf16_kcb_vc"
if BF16_RECIPE not in KV_CACHE_FORMATS:
    # experimental, so the CLI never offers it to a later test that lists the choices
    register_kv_format(KVCacheFormat(BF16_RECIPE, BF16, BF16, KRecipe("sink", "balanced", True),
                                     experimental=True))


class TextTokenizer:
    """Characters -> ids below the tiny vocabulary (enough to calibrate on real text)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + ord(c) % 95 for c in text]


@pytest.fixture(scope="module")
def model64():
    return tiny_model(tiny_arch("qwen3", head_dim=64), torch.float32)


def _calibrated_engine(model, backend: str, kv: str):
    eng = make_engine_with(model, backend, kv=kv, chunked_prefill_size=16)
    params = calibrate_pool(model, TextTokenizer(), eng.pool, model.arch)
    assert params is not None and eng.pool.recipe_digest == params.digest
    return eng


def test_recipe_with_bf16_elements_matches_plain_bf16_on_every_path(model64):
    ref, ref_tok, ref_paths = run_scenario(
        make_engine_with(model64, "torch", kv="bf16", chunked_prefill_size=16), mixed_arrivals())
    got, got_tok, paths = run_scenario(_calibrated_engine(model64, "torch", BF16_RECIPE),
                                       mixed_arrivals())
    assert paths == ref_paths == {"prefill", "extend", "decode", "mixed"}
    assert got_tok == ref_tok
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    # Measured 0.0098 (BF16 rounding of the transformed K/V; logits up to 4.1). Decode with
    # an untransformed q moves them by 4.9, FP8 K/V by 0.15.
    assert worst < 0.03, worst


def test_uncalibrated_pool_stores_plain_k(model64):
    """Without parameters the recipe is the identity (the digest says so)."""
    eng = make_engine_with(model64, "torch", kv=BF16_RECIPE)
    assert eng.pool.recipe_params is None and eng.pool.recipe_digest == ""


def test_calibration_is_deterministic_and_follows_the_weights(model64):
    digests = [_calibrated_engine(model64, "torch", "nvfp4").pool.recipe_digest for _ in range(2)]
    other = tiny_model(tiny_arch("qwen3", head_dim=64), torch.float32, seed=1)
    assert digests[0] == digests[1]
    assert _calibrated_engine(other, "torch", "nvfp4").pool.recipe_digest != digests[0]


def test_calibration_text_and_fallback_ids():
    ids = calibration_ids(TextTokenizer(), 96, 300)
    assert len(ids) == 300 and len(set(ids)) > 30
    assert len(CALIBRATION_TEXT.split()) > 400

    class OneWord:                                       # numeric tokenizer of dummy models
        def encode(self, text, add_special_tokens=False):
            return [0] * len(text.split())
    ids = calibration_ids(OneWord(), 1000, 200)
    assert len(ids) == 200 and len(set(ids)) == 200 and max(ids) < 1000


def test_calibration_runs_cover_the_context():
    """Post-RoPE K drifts with position: the runs reach the end of the engine's context."""
    shift, spread = calibration_starts(713, 8192)
    assert shift == [0, SHIFT_CONTEXT - 713]
    assert spread[0] == SHIFT_CONTEXT and spread[-1] + MAP_RUN_TOKENS == 8192 and len(spread) == 6
    assert calibration_starts(713, 1032) == ([0, 319], [])
    assert calibration_starts(300, 300) == ([0], [])


def test_capture_covers_every_layer(model64):
    caps = capture_qkv(model64, list(range(1, 41)), model64.arch.sm_scale)
    a = model64.arch
    assert len(caps) == a.num_layers
    q, k, v = caps[0]
    assert q.shape == (40, a.num_heads, 64) and k.shape == v.shape == (40, a.num_kv_heads, 64)
    # The same text later: same values (RoPE is relative), keys rotated by the offset.
    later = capture_qkv(model64, list(range(1, 41)), model64.arch.sm_scale, start=100)
    torch.testing.assert_close(later[0][2], v, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(later[0][1], k, atol=1e-2)


@pytest.mark.skipif(TritonAttentionBackend is None, reason="Triton is not importable")
def test_triton_backend_applies_the_same_recipe(model64):
    """Same pages, same transform: Triton (interpreter on CPU) matches torch tightly."""
    runs = {}
    for name in ("torch", "triton"):
        runs[name] = run_scenario(_calibrated_engine(model64, name, "nvfp4_kcb_vc"),
                                  mixed_arrivals())
    (ref, ref_tok, _), (got, got_tok, _) = runs["torch"], runs["triton"]
    assert got_tok == ref_tok
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    assert worst <= 1e-4, worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_on_gpu_with_cuda_graphs_matches_torch(model64):
    """Decode replayed from CUDA graphs captured *before* calibration still applies the
    recipe: the hook updates its device tensors in place."""
    model = tiny_model(tiny_arch("qwen3", head_dim=64), torch.float32).cuda()
    runs = {}
    for name, graphs in (("torch", None), ("triton", 8)):
        eng = make_engine_with(model, name, kv="nvfp4_kcb_vc", device="cuda",
                               chunked_prefill_size=16, graph_max_bs=graphs,
                               use_graphs=graphs is not None)
        calibrate_pool(model, TextTokenizer(), eng.pool, model.arch)
        runs[name] = run_scenario(eng, mixed_arrivals())
    (ref, ref_tok, _), (got, got_tok, _) = runs["torch"], runs["triton"]
    assert got_tok == ref_tok
    assert len(got) == len(ref)        # every step, CUDA-graph replays included
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    assert worst <= 5e-3, worst         # the Triton decode's fp32 tl.dot runs as TF32 on the GPU


def _build(tmp_path, kv: str):
    import json

    from nibble.services.cli import build_parser
    from nibble.services.config import config_from_args
    from nibble.services.engine.builder import build_parts

    from ..models.test_dummy import TINY
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    args = build_parser().parse_args(["serve", "--model-path", str(tmp_path), "--load-format",
                                      "dummy", "--max-total-tokens", "256", "--device", "cpu",
                                      "--kv-cache-dtype", kv, "--enable-experimental-kv-formats"])
    return build_parts(config_from_args(args))


def test_engine_start_calibrates_the_default_format_deterministically(tmp_path):
    """Two workers with the same weights compute the same parameters (disaggregated
    workers and stored pages rely on it); the plain format has none."""
    a, b = _build(tmp_path, "nvfp4"), _build(tmp_path, "nvfp4")
    assert a.core.pool.layout.kv_format == "nvfp4"
    assert a.core.pool.recipe_digest != "" and a.core.pool.recipe_digest == b.core.pool.recipe_digest
    assert _build(tmp_path, "nvfp4_plain").core.pool.recipe_digest == ""
