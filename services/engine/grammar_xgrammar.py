"""The xgrammar grammar backend (``--grammar-backend xgrammar``): JSON, JSON schema, regex and
EBNF compiled against the model's tokenizer; masks as xgrammar's packed int32 bitmasks."""

from __future__ import annotations

import json
from typing import Any

import torch

from .grammar import (GrammarBackend, GrammarError, GrammarSpec, Matcher,
                      register_grammar_backend)

try:
    import xgrammar as xgr
except ImportError as exc:        # the backend is simply not offered
    xgr = None
    IMPORT_ERROR: str | None = str(exc)
else:
    IMPORT_ERROR = None


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: Any):
        self._m = xgr.GrammarMatcher(compiled)

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(mask, row)

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
            return self._compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:
            param = {"regex": "regex", "ebnf": "ebnf"}.get(spec.kind, "response_format")
            raise GrammarError(f"the {spec.kind} grammar does not compile: {exc}",
                               param=param) from exc

    def matcher(self, spec: GrammarSpec) -> Matcher:
        return XGrammarMatcher(self.compile(spec))

    def new_mask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True))
        return logits


if xgr is not None:
    register_grammar_backend("xgrammar", XGrammarBackend)
