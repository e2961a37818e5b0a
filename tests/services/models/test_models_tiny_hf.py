"""CausalLM vs transformers on tiny random Llama / Qwen2 / Qwen3 checkpoints (fp32, CPU).

Each case saves a random transformers model with ``save_pretrained`` plus a
small byte-level BPE ``tokenizer.json``, loads it through ``load_model`` and
compares logits. Tolerance: max abs logit difference < 1e-4 (fp32; logits
here have magnitude ~1-10 because weights are re-drawn with a large std).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTok  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from nibble.services.models import load_model  # noqa: E402

ATOL = 1e-4
VOCAB = 320
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": 128})),
    # head_dim 32 != hidden/heads (16), tied embeddings.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
}


def _tokenizer_json(path) -> None:
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                   "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello nibble",
              "tokens and bytes and merges"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT}))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw weights with a std large enough that attention/RoPE errors show in logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (checkpoint dir, transformers model); built once per module."""
    out = {}
    for i, (case, (cfg_cls, model_cls, extra)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
        ref = getattr(transformers, model_cls)(cfg).eval()
        _randomize(ref, seed=100 + i)
        if cfg.tie_word_embeddings:
            ref.tie_weights()
        path = tmp_path_factory.mktemp(case)
        # A small shard size exercises the sharded-index path on one case.
        ref.save_pretrained(path, max_shard_size="200KB" if case == "llama" else "50MB")
        _tokenizer_json(path)
        out[case] = (path, ref)
    return out


def _hf_logits(ref, ids: list[int], start: int = 0) -> torch.Tensor:
    with torch.no_grad():
        pos = torch.arange(start, start + len(ids))[None]
        return ref(input_ids=torch.tensor([ids]), position_ids=pos).logits[0].float()


def _our_logits(lm, ids: list[int], attn, start: int = 0) -> torch.Tensor:
    with torch.no_grad():
        pos = torch.arange(start, start + len(ids))
        hidden = lm.model(torch.tensor(ids), pos, attn)
        return lm.model.compute_logits(hidden)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, checkpoints, varlen_attention):
    path, ref = checkpoints[case]
    lm = load_model(str(path), torch.float32, torch.device("cpu"))
    assert lm.arch.arch == ref.config.model_type
    assert lm.arch.qk_norm == (case == "qwen3")
    assert lm.arch.attention_bias == case.startswith("qwen2")
    ids = torch.randint(3, VOCAB, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    # Start far from 0 so scaled RoPE variants are exercised beyond their original context.
    for start in (0, 300):
        attn = varlen_attention(lm.arch.sm_scale)
        ours, theirs = _our_logits(lm, ids, attn, start), _hf_logits(ref, ids, start)
        assert ours.dtype == torch.float32 and ours.shape == (len(ids), VOCAB)
        assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
        assert attn.calls == list(range(lm.arch.num_layers))


def test_positions_matter(checkpoints, varlen_attention):
    """Guard against a vacuous comparison: changing relative positions must change the logits.

    (A uniform shift of all positions leaves RoPE attention scores unchanged.)
    """
    path, _ = checkpoints["llama"]
    lm = load_model(str(path), torch.float32, torch.device("cpu"))
    ids = list(range(5, 25))
    a = _our_logits(lm, ids, varlen_attention(lm.arch.sm_scale), 0)
    b = _our_logits(lm, ids, varlen_attention(lm.arch.sm_scale), 7)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    with torch.no_grad():
        gap = torch.cat([torch.arange(10), torch.arange(30, 40)])
        c = lm.model.compute_logits(lm.model(torch.tensor(ids), gap, varlen_attention(lm.arch.sm_scale)))
    assert (a[10:] - c[10:]).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_varlen_matches_separate_runs(case, checkpoints, varlen_attention):
    path, _ = checkpoints[case]
    lm = load_model(str(path), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (11, 5, 17)]
    starts = [0, 40, 3]  # a continuing chunk: positions need not start at 0
    sep = [_our_logits(lm, s.tolist(), varlen_attention(lm.arch.sm_scale), st)
           for s, st in zip(seqs, starts)]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(st, st + len(s)) for s, st in zip(seqs, starts)])
    attn = varlen_attention(lm.arch.sm_scale, [len(s) for s in seqs])
    with torch.no_grad():
        packed = lm.model.compute_logits(lm.model(ids, pos, attn))
    torch.testing.assert_close(packed, torch.cat(sep), atol=ATOL, rtol=0)


def test_bf16_close_to_fp32(checkpoints, varlen_attention):
    path, _ = checkpoints["qwen2"]
    lm32 = load_model(str(path), torch.float32, torch.device("cpu"))
    lm16 = load_model(str(path), torch.bfloat16, torch.device("cpu"))
    assert lm16.model.layers[0].qkv_weight.dtype == torch.bfloat16
    assert lm16.fingerprint != lm32.fingerprint
    ids = list(range(3, 30))
    a = _our_logits(lm32, ids, varlen_attention(lm32.arch.sm_scale))
    b = _our_logits(lm16, ids, varlen_attention(lm16.arch.sm_scale))
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_hf_dir_tokenizer_and_metadata(checkpoints):
    path, _ = checkpoints["qwen3"]
    lm = load_model(str(path), torch.float32, torch.device("cpu"))
    tok = lm.tokenizer
    assert lm.name == path.name
    assert lm.arch.tie_word_embeddings and lm.model.lm_head is lm.model.embed
    assert tok.eos_token_ids == {2}
    text = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids
    assert tok.decode(ids) == "user\nhello world\nassistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == text
    again = load_model(str(path), torch.float32, torch.device("cpu"))
    assert again.fingerprint == lm.fingerprint
    assert len(lm.fingerprint) == 64
