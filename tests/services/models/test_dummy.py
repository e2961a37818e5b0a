"""``--load-format dummy``: random weights from a config.json, numeric tokenizer, bench shapes."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.services.cli import build_parser
from nibble.services.config import config_from_args
from nibble.services.engine.builder import build_parts
from nibble.services.engine.types import GenerateRequest, SamplingParams
from nibble.services.errors import ConfigError, ModelLoadError
from nibble.services.models.config import ModelArchConfig
from nibble.services.models.loader import load_model, load_tokenizer

BENCH_MODELS = pathlib.Path(__file__).resolve().parents[3] / "bench" / "models"
TINY = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "eos_token_id": 2}


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def test_same_weights_and_fingerprint_every_load(tiny_dir):
    a = load_model(str(tiny_dir), torch.float32, torch.device("cpu"), "dummy")
    b = load_model(str(tiny_dir), torch.float32, torch.device("cpu"), "dummy")
    assert a.fingerprint == b.fingerprint
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    norm = a.model.layers[0].input_norm
    assert torch.equal(norm, torch.ones_like(norm))
    std = float(a.model.layers[1].qkv_weight.std())
    assert 0.015 < std < 0.025, std
    assert a.arch.arch == "qwen3" and a.arch.qk_norm


def test_numeric_tokenizer(tiny_dir):
    tok = load_tokenizer(str(tiny_dir), "dummy")
    assert tok.vocab_size == 300 and 2 in tok.eos_token_ids
    assert tok.encode("t5 t299 t7") == [5, 299, 7]
    assert tok.decode([5, 299, 7]) == "t5 t299 t7"


def test_dummy_needs_a_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), "dummy")
    args = build_parser().parse_args(["serve", "--load-format", "dummy"])
    with pytest.raises(ConfigError, match="--model-path"):
        config_from_args(args)


def test_engine_generates_from_dummy_weights(tiny_dir):
    args = build_parser().parse_args(["serve", "--model-path", str(tiny_dir), "--load-format",
                                      "dummy", "--max-total-tokens", "256", "--device", "cpu"])
    parts = build_parts(config_from_args(args))
    core = parts.core
    core.add_request(GenerateRequest("r", list(range(10, 40)),
                                     SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    out = []
    while core.has_unfinished():
        out += [t for o in core.step() for t in o.new_token_ids]
    assert len(out) == 5 and all(0 <= t < 300 for t in out)


def test_bench_qwen3_8b_shape():
    cfg = json.loads((BENCH_MODELS / "qwen3-8b" / "config.json").read_text())
    arch = ModelArchConfig.from_hf_config(cfg)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (36, 32, 8, 128)
    fp8 = PageLayout("fp8_e4m3", 36, 8, 128, 16).bytes_per_token
    nv = PageLayout("nvfp4", 36, 8, 128, 16).bytes_per_token
    assert nv == 36 * 8 * 128 * 2 * 0.5625
    assert fp8 / nv > 1.77
