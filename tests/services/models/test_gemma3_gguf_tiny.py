"""Gemma 3 from GGUF, on a tiny file written here the way llama.cpp's converter lays it out.

The weights of a random ``Gemma3ForCausalLM`` are written with ``gguf.GGUFWriter``
under llama.cpp's names (``ffn_norm`` is the pre-feedforward norm, plus
``post_attention_norm`` / ``post_ffw_norm``), every norm gain stored as ``1 + w``,
Q/K rows unpermuted, a per-layer sliding pattern, a local RoPE base and a
SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``, no merges, byte
pieces, control and user-defined tokens). Nibble must read it back to
transformers' logits and segment text as SentencePiece BPE does.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from nibble.services.models import load_model  # noqa: E402

from .gemma3_util import run_engine  # noqa: E402

ATOL = 1e-4
SPACE = "\u2581"
WINDOW, LOCAL_THETA = 8, 5000.0
SLIDING = [True, False, True, True]
NORMAL = [SPACE, "t", "h", "e", "c", "a", "th", "the", "at", SPACE + "c", SPACE + "cat"]
PIECES = (["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
          + ["\n\n", "  "] + NORMAL)
TYPES = [3] * 4 + [6] * 256 + [4, 4] + [1] * len(NORMAL)
VOCAB = 320
PIECES += [f"<unused{i}>" for i in range(VOCAB - len(PIECES))]
TYPES += [3] * (VOCAB - len(TYPES))
ID = {p: i for i, p in enumerate(PIECES)}

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if name in fixed:
        return fixed[name]
    _, _, i, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_NAMES[module]}.{kind}"


def _write_gguf(path, cfg, state: dict) -> None:
    wr = gguf.GGUFWriter(str(path), "gemma3")
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    wr.add_key_length(cfg.head_dim)
    wr.add_value_length(cfg.head_dim)
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    wr.add_rope_freq_base(1e6)
    wr.add_rope_freq_base_swa(LOCAL_THETA)
    wr.add_sliding_window(WINDOW)
    wr.add_sliding_window_pattern(SLIDING)
    wr.add_final_logit_softcapping(30.0)
    wr.add_tokenizer_model("llama")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(PIECES)
    wr.add_token_scores([-float(i) for i in range(VOCAB)])
    wr.add_token_types(TYPES)
    wr.add_bos_token_id(2)
    wr.add_eos_token_id(1)
    wr.add_unk_token_id(3)
    wr.add_pad_token_id(0)
    wr.add_add_bos_token(True)
    wr.add_add_space_prefix(False)
    for name, t in state.items():
        if name == "lm_head.weight":   # tied: llama.cpp writes no output.weight
            continue
        a = t.numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        wr.add_tensor(_gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, Nibble model loaded from the GGUF written from its weights)."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=len(SLIDING),
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, sliding_window=WINDOW, query_pre_attn_scalar=32,
        final_logit_softcapping=30.0, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        layer_types=["sliding_attention" if s else "full_attention" for s in SLIDING],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    torch.manual_seed(1)
    ref = transformers.Gemma3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_((0.3 if "norm" in name else 0.15) * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp("gemma3-gguf") / "tiny-gemma3.Q8_0.gguf"
    _write_gguf(path, cfg, ref.state_dict())
    return ref, load_model(str(path), torch.float32, torch.device("cpu"))


def test_config_from_gguf(pair):
    _, lm = pair
    a = lm.arch
    assert lm.name == "tiny-gemma3" and a.arch == "gemma3"
    assert a.sliding_windows == tuple(WINDOW if s else None for s in SLIDING)
    assert (a.rope_theta, a.rope_local_theta, a.rope_scaling) == (1e6, LOCAL_THETA, None)
    assert a.sm_scale == 32 ** -0.5 and a.final_logit_softcapping == 30.0
    assert a.tie_word_embeddings and a.qk_norm and a.vocab_size == VOCAB
    assert a.bos_token_id == 2 and a.eos_token_ids == (1,)


def test_logits_match_transformers(pair):
    ref, lm = pair
    ids = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    steps, _ = run_engine(lm, ids, 1)
    ours = lm.model.compute_logits(steps[0].hidden)
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([ids])).logits[0]
    assert theirs.abs().max() > 1.0 and len(ids) > 2 * WINDOW
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_sentencepiece_tokenizer(pair):
    _, lm = pair
    tok = lm.tokenizer
    text = "the cat\n\nsat é  x"
    # "the" and "▁cat" by merges; "\n\n" whole (user-defined); "s", "é", "x" as bytes; "▁▁" whole.
    want = ["<bos>", "the", SPACE + "cat", "\n\n", "<0x73>", "at", SPACE, "<0xC3>", "<0xA9>", "  ",
            "<0x78>"]
    assert tok.encode(text, add_special_tokens=True) == [ID[p] for p in want]
    assert tok.encode("the", add_special_tokens=False) == [ID["the"]]
    assert tok.decode(tok.encode(text, add_special_tokens=True)) == text
    assert tok.encode("<unused3>") == [ID["<unused3>"]]            # control tokens stay whole
    assert tok.decode([ID["<bos>"], ID["the"]], skip_special_tokens=False) == "<bos>the"
    assert tok.eos_token_ids == {1} and tok.bos_token_id == 2
