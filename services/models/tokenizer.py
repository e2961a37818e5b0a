"""Text <-> token ids and chat formatting, on top of the ``tokenizers`` library.

Built from a HF directory (``tokenizer.json`` + ``tokenizer_config.json`` /
``chat_template.jinja``) or from GGUF metadata (byte-level BPE rebuilt from
``tokenizer.ggml.*``). Special tokens written in text (``<|im_start|>``)
encode to their single id; ``decode`` skips them by default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelLoadError
from .files import read_json
from .chat_template import ChatTemplate, pick_template
from .gguf_spm import spm_from_gguf

log = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4
# Texts at least this long are encoded without holding the GIL (``encode`` holds it).
RELEASE_GIL_CHARS = 4096

# Split patterns of the pre-tokenizers GGUF names in tokenizer.ggml.pre.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}


class Tokenizer:
    """Tokenizer of one model.

    Attributes:
        eos_token_ids: ids that end generation.
        bos_token_id: beginning-of-sequence id, or None.
        vocab_size: number of ids the tokenizer can produce (added tokens included).
    """

    def __init__(self, backend: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: Iterable[int], chat_template: str | None):
        self._tok = backend
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        eos = set(eos_token_ids)
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos.add(backend.token_to_id(eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = ChatTemplate(chat_template, {"bos_token": bos_token,
                                                          "eos_token": eos_token})

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the model's BOS/EOS framing if any.

        Long texts go through ``encode_batch``, which releases the GIL while it runs, so
        other threads (the server's event loop) keep running during a big prompt."""
        if len(text) >= RELEASE_GIL_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes of an incomplete UTF-8 sequence decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Prompt text for chat ``messages`` (and ``tools``, for templates that render them);
        raises ``InvalidRequestError`` on template faults."""
        return self.chat_template.render(messages, add_generation_prompt, tools)

    # ------------------------------------------------------------ builders

    @classmethod
    def from_hf_dir(cls, path: str, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Load ``tokenizer.json`` plus ``tokenizer_config.json`` / ``chat_template.jinja``."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ModelLoadError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = HFTokenizer.from_file(tj)
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"cannot parse {tj}: {e}") from e
        cfg = read_json(os.path.join(path, "tokenizer_config.json"))
        template = pick_template(cfg.get("chat_template"))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(backend, bos_token=_token_str(cfg.get("bos_token")),
                   eos_token=_token_str(cfg.get("eos_token")),
                   eos_token_ids=extra_eos_ids, chat_template=template)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Rebuild the tokenizer from ``tokenizer.ggml.*`` metadata: byte-level BPE
        (``gpt2``) or SentencePiece BPE (``llama``, see :mod:`.gguf_spm`)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported "
                                 "(only 'gpt2' BPE and 'llama' SentencePiece)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        backend = _gguf_bpe(tokens, meta) if kind == "gpt2" else spm_from_gguf(tokens, meta)
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None
        eos = tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None
        if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        eos_ids = {meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if meta.get(k) is not None}
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids | set(extra_eos_ids),
                   chat_template=meta.get("tokenizer.chat_template"))


def _gguf_bpe(tokens: list[str], meta: Mapping[str, Any]) -> HFTokenizer:
    """Byte-level BPE with the pre-tokenizer ``tokenizer.ggml.pre`` names and special tokens added."""
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                         ignore_merges=pre in _LLAMA3_PRE))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise ModelLoadError(f"GGUF vocabulary/merges are inconsistent: {e}") from e
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == _CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == _USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in ("gpt-2", "gpt2", "default"):
        log.warning("unknown GGUF pre-tokenizer %r; using GPT-2 splitting", pre)
    return byte_level


def _token_str(v: Any) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (AddedToken dict) -> ``"<s>"``."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None
