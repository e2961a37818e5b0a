"""A tiny random-weight model for end-to-end tests that check the server, not the model.

``write_tiny_model(dir)`` writes a 2-layer Qwen3-shaped ``config.json`` (served with
``--load-format dummy --device cpu``, which starts in seconds) plus a byte-level
tokenizer and a chat template, so both OpenAI routes work and every non-empty
text encodes to at least one token.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
CONFIG = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": 257, "max_position_embeddings": 256,
          "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "eos_token_id": 256}


def _byte_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte (ids 0..255) and the EOS token (256)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


def write_tiny_model(directory: Path) -> Path:
    """The model directory (created), ready for ``--model-path``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    _byte_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "chat_template": CHAT_TEMPLATE}))
    return directory


def tiny_server_args(directory: Path) -> list[str]:
    """``nibble serve`` flags for the tiny model on CPU."""
    return ["--model-path", str(write_tiny_model(directory)), "--load-format", "dummy",
            "--device", "cpu", "--max-total-tokens", "1024"]
