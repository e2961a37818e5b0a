"""Tokenizer.encode of a long text lets other threads run (the server's event loop)."""

from __future__ import annotations

import threading
import time

from nibble.services.models.dummy import numeric_tokenizer
from nibble.services.models.tokenizer import RELEASE_GIL_CHARS

MIN_STEPS = 20     # ~0.5 s of encoding gives hundreds of 1 ms steps when the GIL is free


def test_long_and_short_paths_agree():
    tok = numeric_tokenizer(300, [2])
    text = " ".join(f"t{i % 300}" for i in range(RELEASE_GIL_CHARS))
    assert len(text) >= RELEASE_GIL_CHARS
    assert tok.encode(text) == tok._tok.encode(text).ids
    assert tok.encode("t5 t7") == [5, 7]


def test_long_encode_releases_the_gil():
    """While one thread encodes, another keeps counting. Holding the GIL, encode would let
    it count at most a step or two (before the call and as it returns)."""
    tok = numeric_tokenizer(300, [2])
    text = " ".join(f"t{i % 300}" for i in range(300_000))
    count, seen_at_return = [0], []
    started, finished = threading.Event(), threading.Event()

    def encode() -> None:
        started.set()
        tok.encode(text)
        seen_at_return.append(count[0])
        finished.set()

    worker = threading.Thread(target=encode)
    worker.start()
    started.wait()
    while not finished.is_set():
        count[0] += 1
        time.sleep(0.001)
    worker.join()
    assert seen_at_return[0] >= MIN_STEPS, seen_at_return
