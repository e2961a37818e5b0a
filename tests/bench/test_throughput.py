"""bench/throughput's reading of llama-bench's JSON (the side-by-side llama.cpp figure)."""

from __future__ import annotations

import json

import pytest

from nibble.bench.throughput import parse_llama_bench


def _row(n_prompt: int, n_gen: int, avg_ts: float) -> dict:
    return {"model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": n_prompt,
            "n_gen": n_gen, "avg_ts": avg_ts, "stddev_ts": 0.5}


def test_takes_the_generation_row():
    text = json.dumps([_row(512, 0, 222.0), _row(0, 64, 95.5)])
    got = parse_llama_bench(text)
    assert got == {"output_tokens": 64, "tokens_per_s": 95.5, "threads": 2,
                   "model_type": "llama ?B Q4_1"}


@pytest.mark.parametrize("rows", [[], [_row(512, 0, 222.0)], [_row(0, 64, 1.0), _row(0, 32, 2.0)]])
def test_refuses_output_without_exactly_one_generation_row(rows):
    with pytest.raises(ValueError, match="generation-only row"):
        parse_llama_bench(json.dumps(rows))
