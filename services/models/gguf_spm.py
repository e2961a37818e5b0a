"""SentencePiece BPE vocabularies from GGUF (``tokenizer.ggml.model == "llama"``), e.g. Gemma 3.

GGUF stores the pieces (``▁`` for a space), their scores and types, but no
merges. SentencePiece's BPE merges, at every step, the adjacent pair whose
joined piece ranks best; ranking pieces by their position in the vocabulary
(Gemma's scores do not follow its merge order, the positions do), every split
of a piece into two pieces of the vocabulary becomes one merge, and sorting
those by the joined piece's position gives a ``tokenizers`` BPE that segments
the same way. Unknown characters fall back to the ``<0xNN>`` byte pieces.

Gemma files spell pieces made only of spaces with real spaces; they are
respelled with ``▁`` to match the normalized text. Control tokens (type 3)
become special tokens and user-defined ones (type 4, e.g. ``\\n\\n``, ``<table>``)
plain added tokens, so both match whole in text, as in llama.cpp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelLoadError

SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4


def _respell(piece: str) -> str:
    """A piece of only spaces (``"   "``) as the normalized text spells it (``"▁▁▁"``)."""
    return SPACE * len(piece) if piece and not piece.strip(" ") else piece


def spm_merges(pieces: list[str]) -> list[tuple[str, str]]:
    """Every split ``(left, right)`` of a piece into two vocabulary pieces, best first.

    Order: the joined piece's position (lower first), then the longer left part first.
    """
    index = {p: i for i, p in enumerate(pieces)}
    ranked = []
    for i, piece in enumerate(pieces):
        for cut in range(len(piece) - 1, 0, -1):   # longer left part first
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append((left, right))
    return ranked


def spm_from_gguf(tokens: list[str], meta: Mapping[str, Any]) -> HFTokenizer:
    """A ``tokenizers`` BPE with byte fallback equivalent to the file's SentencePiece model.

    Args:
        tokens: ``tokenizer.ggml.tokens`` (id order).
        meta: the GGUF metadata (token types, unknown id, ``add_space_prefix``).
    """
    pieces = [_respell(t) for t in tokens]
    vocab = {p: i for i, p in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise ModelLoadError("GGUF SentencePiece vocabulary has duplicate pieces")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = pieces[unk_id] if unk_id is not None and unk_id < len(pieces) else None
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=spm_merges(pieces), unk_token=unk,
                                         fuse_unk=True, byte_fallback=True))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise ModelLoadError(f"GGUF SentencePiece vocabulary is inconsistent: {e}") from e
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPACE)] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decode)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED and tokens[i] in vocab])
    return backend
