"""Tests for nibble.services.engine.detokenizer, against real `tokenizers` models."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nibble.services.engine.detokenizer import IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "Streaming text one token at a time is what servers do.",
    "A café serves crème brûlée; naïve façade.",
] * 4

TEXTS = [
    "Hello 🌍 world 👩‍👩‍👧!",
    "日本語のテキストを少し。中文也可以。",
    "café crème brûlée naïve Ωμέγα",
    "mixed: ok 🚀🚀 東京 ñ done",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A byte-level BPE trained on mostly-ASCII text: emoji and CJK stay split into byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _stream(tok, prompt: list[int], ids: list[int], chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_stream_without_replacement_char(bpe: Tokenizer, text: str) -> None:
    ids = bpe.encode(text).ids
    # the test is only meaningful if some character really is split across tokens
    assert any("\ufffd" in bpe.decode(ids[:n]) for n in range(1, len(ids)))
    deltas = _stream(bpe, [], ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == bpe.decode(ids) == text


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_multi_token_pushes(bpe: Tokenizer, chunk: int) -> None:
    ids = bpe.encode(" ".join(TEXTS)).ids
    deltas = _stream(bpe, [], ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == bpe.decode(ids)


def test_with_prompt_context(bpe: Tokenizer) -> None:
    prompt = bpe.encode("<|im_start|>user: say hi to the 🌍").ids
    ids = bpe.encode(" Hello 🌍, 東京!").ids
    deltas = _stream(bpe, prompt, ids)
    assert "".join(deltas) == bpe.decode(ids) == " Hello 🌍, 東京!"
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped(bpe: Tokenizer) -> None:
    eos, start = (bpe.token_to_id(s) for s in SPECIALS)
    ids = [start] + bpe.encode("hi 🚀").ids + [eos] + bpe.encode(" more").ids + [eos, eos]
    deltas = _stream(bpe, [start], ids)
    text = "".join(deltas)
    assert text == bpe.decode(ids, skip_special_tokens=True) == "hi 🚀 more"
    assert "<|" not in text


def test_text_is_emitted_as_soon_as_final(bpe: Tokenizer) -> None:
    ids = bpe.encode("ab🌍").ids
    detok = IncrementalDetokenizer(bpe, [])
    emitted = [detok.push([i]) for i in ids]
    # everything before the emoji is out before the emoji's bytes complete
    assert "".join(emitted[:-1]) == "ab"
    assert emitted[-1] == "🌍"
    assert detok.flush() == ""


def test_incomplete_character_released_by_flush(bpe: Tokenizer) -> None:
    ids = bpe.encode("a🌍").ids[:-1]  # stop mid-emoji
    detok = IncrementalDetokenizer(bpe, [])
    pushed = "".join(detok.push([i]) for i in ids)
    assert pushed == "a"
    tail = detok.flush()
    assert tail and set(tail) == {"\ufffd"}
    assert pushed + tail == bpe.decode(ids)


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, inner: Tokenizer):
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_is_bounded(bpe: Tokenizer) -> None:
    counting = _CountingTokenizer(bpe)
    ids = bpe.encode(" ".join(TEXTS) * 20).ids
    prompt = bpe.encode(CORPUS[0] * 10).ids
    deltas = _stream(counting, prompt, ids)
    assert len(ids) > 1000
    assert max(counting.sizes) <= 12  # the window, never the sequence
    assert "".join(deltas) == bpe.decode(ids)


def test_leading_space_tokenizer_keeps_spaces() -> None:
    # Metaspace decoding strips the space of the first token of each decode call,
    # so decoding token by token would glue words together
    vocab = {"▁Hello": 0, "▁world": 1, "▁foo": 2, "[UNK]": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert tok.decode([1]) == "world"
    deltas = _stream(tok, [0], [1, 2, 1])
    assert deltas[:3] == [" world", " foo", " world"]
    assert "".join(deltas) == " world foo world"
