"""Incremental detokenization for streaming.

Decoding the whole sequence on every token is O(n) per token and, for
byte-level BPE, momentarily shows U+FFFD while a multi-byte UTF-8 character is
split across tokens. ``IncrementalDetokenizer`` instead keeps two offsets into
the token list:

* ``prefix`` .. ``read``: tokens whose text was already emitted; they are
  decoded again only as context, so tokenizers that add or strip a leading
  space per decode call still produce the right spacing;
* ``read`` .. end: tokens whose text is not final yet.

Each new token decodes the window ``[prefix:]`` and emits what it adds beyond
the text of ``[prefix:read]``; then the window slides forward. Text that ends
in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token
completes it, or until ``flush``.
"""

from __future__ import annotations

from typing import Protocol

# prompt tokens decoded as context for the first generated token, so its
# leading space (if the tokenizer strips one at the start of a decode) survives
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of final text.

    The concatenation of every ``push`` and the final ``flush`` equals
    ``decode(ctx + generated)[len(decode(ctx)):]`` with ``ctx`` the last few
    prompt tokens; for byte-level BPE that is exactly ``decode(generated)``.
    Work per token is O(window), the window being a few tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]):
        self._tok = tokenizer
        ctx = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        if self._decode(ctx).endswith(_REPLACEMENT):
            # the prompt ends mid-character: its text would not be a prefix of
            # the window's text, so start without context
            ctx = []
        self._ids: list[int] = ctx  # tokens from the prefix offset on
        self._read = len(ctx)       # index into _ids of the first unemitted token
        self._prefix_text = self._decode(ctx)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True) if ids else ""

    def push(self, token_ids: list[int]) -> str:
        """Add generated tokens; returns the text they finalized (maybe "")."""
        out = []
        for tid in token_ids:
            self._ids.append(tid)
            text = self._decode(self._ids)
            if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
                continue  # no text yet (special token) or an incomplete character
            out.append(text[len(self._prefix_text):])
            # slide: the newly emitted tokens become the next window's context
            del self._ids[: self._read]
            self._read = len(self._ids)
            self._prefix_text = self._decode(self._ids)
        return "".join(out)

    def flush(self) -> str:
        """Release held-back text (e.g. a dangling incomplete character) at the end."""
        text = self._decode(self._ids)
        delta = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta
