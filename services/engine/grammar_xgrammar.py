"""The xgrammar grammar backend (``--grammar-backend xgrammar``): JSON, JSON schema, regex and
EBNF compiled against the model's tokenizer; masks as xgrammar's packed int32 bitmasks."""

from __future__ import annotations

import json
from typing import Any

import torch

from .grammar import (GRAMMAR_COMPILE_ERROR, GrammarBackend, GrammarError, GrammarSpec,
                      Matcher, register_grammar_backend)

try:
    import xgrammar as xgr
except ImportError as exc:        # the backend is simply not offered
    xgr = None
    IMPORT_ERROR: str | None = str(exc)
else:
    IMPORT_ERROR = None


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: Any, allowed: torch.Tensor | None = None):
        self._m = xgr.GrammarMatcher(compiled)
        self._allowed = allowed       # ANDed into every mask row (JSON grammars)

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(mask, row)
        if self._allowed is not None:
            mask[row] &= self._allowed

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend(GrammarBackend):
    """xgrammar over the engine's tokenizer (its ``tokenizers`` backend: the vocabulary and,
    from its JSON, how tokens encode bytes)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int):
        super().__init__(tokenizer, vocab_size)
        backend = getattr(tokenizer, "_tok", None)
        if backend is None:
            raise GrammarError("the tokenizer exposes no vocabulary for grammars")
        encoded = [""] * vocab_size
        for text, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = text
        # the vocabulary's encoding (byte-level, byte-fallback, raw) from the tokenizer's JSON
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType(meta["vocab_type"]),
                                 vocab_size=vocab_size,
                                 stop_token_ids=sorted(tokenizer.eos_token_ids),
                                 add_prefix_space=bool(meta["add_prefix_space"]))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._json_allowed = self._clean_text_tokens(info, vocab_size)

    @staticmethod
    def _clean_text_tokens(info: Any, vocab_size: int) -> torch.Tensor:
        """Packed int32 ``[ceil(V / 32)]`` bitmask of the tokens whose bytes are whole UTF-8
        without control characters (special tokens, decoding to nothing, stay allowed).
        xgrammar's JSON strings admit raw control characters and byte tokens that leave
        invalid UTF-8, which strict JSON parsers reject; JSON grammars are ANDed with this."""
        words = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
        for i, raw in enumerate(info.decoded_vocab[:vocab_size]):
            try:
                text = bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is None or any(ord(c) < 0x20 for c in text):
                words[i // 32] &= ~(1 << (i % 32)) if i % 32 != 31 else 0x7FFFFFFF
        return words

    def _compile(self, spec: GrammarSpec) -> Any:
        try:
            # JSON without free whitespace: a small model otherwise pads with newlines and
            # tabs until max_tokens (the JSON stays valid and compact)
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}',
                                                          any_whitespace=False)
            if spec.kind == "json_schema":
                json.loads(spec.source)          # a clear message for text that is no JSON
                return self._compiler.compile_json_schema(spec.source, any_whitespace=False,
                                                          strict_mode=spec.strict)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            if spec.kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec.source)
            return self._compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as exc:
            param = {"regex": "regex", "ebnf": "ebnf", "structural_tag": "tools"}.get(
                spec.kind, "response_format")
            raise GrammarError(f"the {spec.kind} grammar does not compile: {exc}",
                               param=param, code=GRAMMAR_COMPILE_ERROR) from exc

    def matcher(self, spec: GrammarSpec) -> Matcher:
        json_kind = spec.kind in ("json_object", "json_schema")
        return XGrammarMatcher(self.compile(spec), self._json_allowed if json_kind else None)

    def new_mask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True))
        return logits


if xgr is not None:
    register_grammar_backend("xgrammar", XGrammarBackend)
