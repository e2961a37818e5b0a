"""GGUF path vs safetensors path on tiny random checkpoints written by this test.

The same random HF-named weights are saved twice: as a HF directory
(config.json + model.safetensors + tokenizer.json) and as a GGUF file written
with ``gguf.GGUFWriter`` the way llama.cpp's converter lays it out (Q/K rows
permuted for llama). Both must load to the same config, tokenizer behaviour
and (bitwise, since the weights are F32 in both) the same logits.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from nibble.services.models import load_model
from nibble.services.models.gguf_file import GGUFFile, unpermute_rows

H, I, L, HEADS, KV, VOCAB = 64, 96, 2, 4, 2, 300
CHAT = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
ARCHS = {"llama": 16, "qwen2": 16, "qwen3": 32}  # arch -> head_dim
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's Q/K row order (its documented reshape/swapaxes formula)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(arch: str, d: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    r = lambda *s: 0.15 * torch.randn(*s, generator=g)  # noqa: E731
    w = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": 1 + r(H),
         "lm_head.weight": r(VOCAB, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(H), p + "post_attention_layernorm.weight": 1 + r(H),
              p + "self_attn.q_proj.weight": r(HEADS * d, H), p + "self_attn.k_proj.weight": r(KV * d, H),
              p + "self_attn.v_proj.weight": r(KV * d, H), p + "self_attn.o_proj.weight": r(H, HEADS * d),
              p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
              p + "mlp.down_proj.weight": r(H, I)}
        if arch == "qwen2":
            w |= {p + "self_attn.q_proj.bias": r(HEADS * d), p + "self_attn.k_proj.bias": r(KV * d),
                  p + "self_attn.v_proj.bias": r(KV * d)}
        if arch == "qwen3":
            w |= {p + "self_attn.q_norm.weight": 1 + r(d), p + "self_attn.k_norm.weight": 1 + r(d)}
    return w


def _tokenizer(path) -> HFTok:
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                     "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "héllo wörld"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT}))
    return tok


def _write_hf(path, arch: str, d: int, w: dict) -> HFTok:
    cfg = {"model_type": arch, "vocab_size": VOCAB, "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": L, "num_attention_heads": HEADS, "num_key_value_heads": KV,
           "head_dim": d, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
           # Old-style (transformers 4.x) key; "type" instead of "rope_type".
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
           if arch == "qwen2" else None}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    return _tokenizer(path)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, i, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_GGUF_NAMES[module]}.{kind}"


def _write_gguf(file, arch: str, d: int, w: dict, tok: HFTok) -> None:
    wr = gguf.GGUFWriter(str(file), arch)
    wr.add_block_count(L)
    wr.add_context_length(512)
    wr.add_embedding_length(H)
    wr.add_feed_forward_length(I)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV)
    wr.add_key_length(d)
    wr.add_value_length(d)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen2":
        wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        wr.add_rope_scaling_factor(4.0)
        wr.add_rope_scaling_orig_ctx_len(128)
    spec = json.loads(tok.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("gpt-2")
    wr.add_token_list([t for t, _ in vocab])
    wr.add_token_types([3 if i in specials else 1 for _, i in vocab])
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHAT)
    for name, t in w.items():
        a = t.numpy()
        if arch == "llama" and ".q_proj." in name:
            a = llamacpp_permute(a, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            a = llamacpp_permute(a, KV)
        wr.add_tensor(_gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    arch, d = request.param, ARCHS[request.param]
    w = _weights(arch, d, torch.Generator().manual_seed(len(arch)))
    hf_dir = tmp_path_factory.mktemp(f"{arch}-hf")
    tok = _write_hf(hf_dir, arch, d, w)
    gguf_path = tmp_path_factory.mktemp(f"{arch}-gguf") / f"tiny-{arch}.Q8_0.gguf"
    _write_gguf(gguf_path, arch, d, w, tok)
    cpu = torch.device("cpu")
    return arch, gguf_path, load_model(str(hf_dir), torch.float32, cpu), load_model(str(gguf_path),
                                                                                     torch.float32, cpu)


def test_same_config(pair):
    arch, _, from_hf, from_gguf = pair
    assert from_gguf.arch == from_hf.arch
    assert from_gguf.arch.rope_scaling == (YARN if arch == "qwen2" else None)
    assert from_gguf.name == f"tiny-{arch}"


def test_same_logits(pair, varlen_attention):
    _, _, from_hf, from_gguf = pair
    ids = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(150, 173)  # beyond the yarn original context
    with torch.no_grad():
        outs = [m.model.compute_logits(m.model(ids, pos, varlen_attention(m.arch.sm_scale)))
                for m in (from_hf, from_gguf)]
    assert torch.equal(outs[0], outs[1])
    assert from_gguf.fingerprint == from_hf.fingerprint  # same arch + same weights + same dtype


def test_same_tokenizer(pair):
    _, _, from_hf, from_gguf = pair
    a, b = from_hf.tokenizer, from_gguf.tokenizer
    for text in ["the quick brown fox", "héllo wörld 日本 😀", "<|im_start|>fox<|im_end|>", " two  spaces\n"]:
        assert a.encode(text) == b.encode(text)
        assert b.decode(b.encode(text), skip_special_tokens=False) == text
    assert b.encode("<|im_start|>")[0] == 1 and b.decode([1, 2]) == ""
    assert a.eos_token_ids == b.eos_token_ids == {2}
    assert a.bos_token_id == b.bos_token_id == 1
    assert a.vocab_size == b.vocab_size == VOCAB
    msgs = [{"role": "user", "content": "fox"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs) == "<|im_start|>fox<|im_end|>"


def test_parser_matches_gguf_reader(pair):
    _, path, _, _ = pair
    ours, ref = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    theirs = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == theirs.keys()
    for k, v in theirs.items():  # our float32 scalars are the shortest decimal of the same float32
        if isinstance(v, float):
            assert np.float32(ours.metadata[k]) == np.float32(v)
        else:
            assert ours.metadata[k] == v
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        ref_arr = gguf.quants.dequantize(b.data, b.tensor_type)
        np.testing.assert_array_equal(ours.dequantize(a).numpy(), ref_arr)


def test_unpermute_inverts_llamacpp_permute():
    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    back = unpermute_rows(torch.from_numpy(llamacpp_permute(w, 6)), 6)
    np.testing.assert_array_equal(back.numpy(), w)
    bias = np.arange(24, dtype=np.float32)
    back = unpermute_rows(torch.from_numpy(llamacpp_permute(bias, 3)), 3)
    np.testing.assert_array_equal(back.numpy(), bias)
