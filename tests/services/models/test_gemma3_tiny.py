"""Gemma 3 vs transformers on a tiny random ``Gemma3ForCausalLM`` (fp32, CPU).

The checkpoint has both layer kinds (window 8, sequences up to 35 tokens),
different RoPE bases for local and global layers (linear scaling on the global
ones), a query scalar other than head_dim, logit soft-capping and tied
embeddings. It is saved with ``save_pretrained`` and loaded by ``load_model``;
every step runs through a real EngineCore with the torch backend and a bf16
paged cache:

* prefill attends over the fresh K/V: compared with plain transformers;
* extend (a chunked prompt) attends over the prefix read back from bf16 pages
  plus the fresh chunk, decode over bf16 pages only. The reference runs
  transformers step by step with its own KV cache, chunked like Nibble's steps,
  through a registered attention function that rounds the cached K/V to bf16
  (and, for a decode step, the new token's too), so the tolerance stays 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTok  # noqa: E402
from tokenizers import models, pre_tokenizers  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from nibble.services.errors import ModelLoadError  # noqa: E402
from nibble.services.models import load_model  # noqa: E402
from nibble.services.models.config import ModelArchConfig  # noqa: E402
from nibble.services.models.gemma3 import Gemma3CausalLM  # noqa: E402

from .gemma3_util import run_engine  # noqa: E402

ATOL = 1e-4
VOCAB, WINDOW = 320, 8
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
HF_CFG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
              rms_norm_eps=1e-6, sliding_window=WINDOW, layer_types=TYPES, query_pre_attn_scalar=24,
              final_logit_softcapping=30.0, bos_token_id=2, eos_token_id=1, pad_token_id=0,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 1e6}})

# transformers attention over K/V as Nibble reads them from a bf16 page: the cached (past) rows
# rounded to bf16, and in a decode step the new token's row too (it is stored, then read back).
DECODE = {"on": False}
BF16KV = "nibble_bf16kv_sdpa"


def _bf16kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    n = key.shape[2] - (0 if DECODE["on"] else query.shape[2])   # key/value [B, H, S, D]
    if n > 0:
        key, value = key.clone(), value.clone()
        key[:, :, :n] = key[:, :, :n].bfloat16().float()
        value[:, :, :n] = value[:, :, :n].bfloat16().float()
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(BF16KV, _bf16kv_sdpa)
AttentionMaskInterface.register(BF16KV, sdpa_mask)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention, RoPE and norm errors show in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.3 * noise if "norm" in name else 0.15 * noise)


def _tokenizer_files(path) -> None:
    tok = HFTok(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w2", "eos_token": "w1"}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, Nibble LoadedModel) of one random checkpoint."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**HF_CFG)
    ref = transformers.Gemma3ForCausalLM(cfg).eval()
    _randomize(ref, seed=11)
    ref.tie_weights()
    path = tmp_path_factory.mktemp("gemma3-tiny")
    ref.save_pretrained(path)
    _tokenizer_files(path)
    return ref, load_model(str(path), torch.float32, torch.device("cpu"))


def _hf_steps(ref, ids: list[int], steps, bf16_kv: bool = True) -> list[torch.Tensor]:
    """transformers' logits ``[n, V]`` per Nibble step, run step by step through its KV cache."""
    ref.config._attn_implementation = BF16KV if bf16_kv else "sdpa"
    cache = transformers.DynamicCache(config=ref.config)
    out = []
    try:
        with torch.no_grad():
            for s in steps:
                DECODE["on"] = s.kind == "decode"
                pos = torch.arange(s.start, s.start + s.n)[None]
                res = ref(input_ids=torch.tensor([ids[s.start:s.start + s.n]]), position_ids=pos,
                          cache=cache, use_cache=True)
                out.append(res.logits[0].float())
    finally:
        DECODE["on"] = False
        ref.config._attn_implementation = "sdpa"
    return out


def test_config_and_model_class(tiny):
    _, lm = tiny
    a = lm.arch
    assert isinstance(lm.model, Gemma3CausalLM) and a.arch == "gemma3"
    assert a.sliding_windows == (WINDOW, None, WINDOW, WINDOW)
    assert (a.rope_theta, a.rope_local_theta) == (1e6, 10000.0)
    assert a.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert a.sm_scale == 24 ** -0.5 and a.final_logit_softcapping == 30.0
    assert a.tie_word_embeddings and lm.model.lm_head is lm.model.embed


@pytest.mark.parametrize("prompt_len,chunk,gen", [(29, 512, 1), (5, 512, 30), (30, 8, 4)],
                         ids=["prefill", "decode-beyond-window", "chunked-extend"])
def test_engine_logits_match_transformers(tiny, prompt_len, chunk, gen):
    ref, lm = tiny
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g).tolist()
    steps, tokens = run_engine(lm, prompt, gen, chunk=chunk)
    ids = prompt + tokens
    assert len(ids) == prompt_len + gen and steps[-1].start + steps[-1].n == len(ids) - 1
    kinds = {s.kind for s in steps}
    want = {"prefill"} | ({"decode"} if gen > 1 else set())
    assert kinds == want | ({"extend"} if chunk < prompt_len else set())
    for s, theirs in zip(steps, _hf_steps(ref, ids, steps)):
        ours = lm.model.compute_logits(s.hidden)
        assert theirs.abs().max() > 1.0
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0, msg=f"{s.kind} at {s.start}")
    if gen > 1:
        assert max(s.start for s in steps) > 3 * WINDOW


def test_window_and_rounding_are_not_vacuous(tiny):
    """Without the window, or against unrounded K/V, decode beyond the window must differ."""
    ref, lm = tiny
    prompt = list(range(3, 8))
    steps, tokens = run_engine(lm, prompt, 24, windows=())
    last = steps[-1]
    assert last.start > WINDOW
    theirs = _hf_steps(ref, prompt + tokens, steps)[-1]
    assert (lm.model.compute_logits(last.hidden) - theirs).abs().max() > 1e-2
    steps, tokens = run_engine(lm, prompt, 24)
    ours = lm.model.compute_logits(steps[-1].hidden)
    exact = _hf_steps(ref, prompt + tokens, steps, bf16_kv=False)[-1]
    assert (ours - exact).abs().max() > 1e-4       # the bf16 rounding shows ...
    assert (ours - _hf_steps(ref, prompt + tokens, steps)[-1]).abs().max() < ATOL   # ... and is all


def test_bf16_weights_close_to_fp32(tiny, tmp_path):
    ref, lm = tiny
    ref.save_pretrained(tmp_path)
    _tokenizer_files(tmp_path)
    lm16 = load_model(str(tmp_path), torch.bfloat16, torch.device("cpu"))
    ids = list(range(3, 23))
    a = lm.model.compute_logits(run_engine(lm, ids, 1)[0][0].hidden)
    b = lm16.model.compute_logits(run_engine(lm16, ids, 1)[0][0].hidden.bfloat16())
    assert lm16.fingerprint != lm.fingerprint
    assert (a - b).abs().max() < 0.05 * a.abs().max()


HF4 = {  # a transformers 4.x gemma3_text config.json (no layer_types, flat RoPE keys)
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "max_position_embeddings": 32768, "bos_token_id": 2,
    "eos_token_id": [1, 106], "hidden_activation": "gelu_pytorch_tanh",
}


def test_hf4_config_layout():
    a = ModelArchConfig.from_hf_config(HF4)
    assert a.sliding_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (a.rope_theta, a.rope_local_theta) == (1e6, 10000.0)
    assert a.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert a.tie_word_embeddings and a.qk_norm and a.has_sliding_window
    assert a.sm_scale == 256 ** -0.5 and a.eos_token_ids == (1, 106)
    layered = {**HF4, "layer_types": ["full_attention"] * 18}
    assert not ModelArchConfig.from_hf_config(layered).has_sliding_window


@pytest.mark.parametrize("change,match", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma3"}, "multimodal"),
    ({"layer_types": ["sliding_attention"] * 3}, "sliding_windows"),
])
def test_unsupported_configs_fail_clearly(change, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelArchConfig.from_hf_config({**HF4, **change})
