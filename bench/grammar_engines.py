"""xgrammar against llguidance on the default model's tokenizer: why Nibble's grammar backend
is xgrammar (issue 18 asks to measure both).

For the structured-output bench's nested JSON schema, and a forced tool call's structural
tag where the engine has one, each engine:
- compiles the grammar (cold, ms);
- walks a valid output token by token, timing the mask fill before each token (us per
  token, the cost a constrained decode step pays on the host) and checking that every
  token is allowed and the grammar accepts the end.
Both run in the same process, side by side. Writes JSON and a bar chart.

    python -m nibble.bench.grammar_engines --out out/grammar_engines
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from nibble.bench.structured import SCHEMA

DOC = {"city": "Paris", "kind": "capital", "founded_bc": True,
       "landmarks": [{"name": "Eiffel Tower", "tags": ["tall"]},
                     {"name": "Louvre", "tags": ["old", "museum"]}]}


def _tokenizer():
    from nibble.services.models.loader import load_model
    lm = load_model(None, torch.float32, torch.device("cpu"))
    return lm.tokenizer, lm.arch.vocab_size


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tok, vocab):
        from nibble.services.engine.grammar_xgrammar import XGrammarBackend
        self.backend = XGrammarBackend(tok, vocab)

    def compile(self, schema: dict):
        from nibble.services.engine.grammar_spec import GrammarSpec
        spec = GrammarSpec("json_schema", json.dumps(schema), True)
        return lambda: self.backend.matcher(spec), self.backend.new_mask(1)

    @staticmethod
    def fill(matcher, mask):
        matcher.fill_mask(mask, 0)

    @staticmethod
    def allowed(mask, token: int) -> bool:
        return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.accept(token)


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tok, vocab):
        import llguidance
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast
        fast = PreTrainedTokenizerFast(tokenizer_object=tok._tok)
        fast.eos_token = tok.decode([sorted(tok.eos_token_ids)[0]], skip_special_tokens=False)
        self.ll, self.vocab = llguidance, vocab
        self.tok = llguidance.hf.from_tokenizer(fast, n_vocab=vocab)

    def compile(self, schema: dict):
        import llguidance.torch as lt
        # the same JSON layout as xgrammar's any_whitespace=False: ", " and ": " separators
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                          "key_separator": ": "})
        return lambda: self.ll.LLMatcher(self.tok, grammar), lt.allocate_token_bitmask(1, self.vocab)

    @staticmethod
    def fill(matcher, mask):
        import llguidance.torch as lt
        lt.fill_next_token_bitmask(matcher, mask, 0)

    @staticmethod
    def allowed(mask, token: int) -> bool:
        return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.consume_token(token)


def _compile_ms(engine, schema: dict):
    t0 = time.perf_counter()
    new_matcher, mask = engine.compile(schema)
    matcher = new_matcher()
    return (time.perf_counter() - t0) * 1e3, new_matcher, mask, matcher


def walk(engine, schema: dict, tokens: list[int], reps: int) -> dict:
    """Cold compile (the engine's first grammar), then another schema's compile (warm), then
    ``reps`` walks of ``tokens``."""
    cold, *_ = _compile_ms(engine, {**schema, "title": "cold"})
    compile_ms, new_matcher, mask, matcher = _compile_ms(engine, schema)
    times, ok = [], True
    for rep in range(reps):
        matcher = matcher if rep == 0 else new_matcher()
        for t in tokens:
            s = time.perf_counter()
            engine.fill(matcher, mask)
            times.append((time.perf_counter() - s) * 1e6)
            ok &= engine.allowed(mask, t) and bool(engine.accept(matcher, t))
    return {"engine": engine.name, "first_compile_ms": cold, "compile_ms": compile_ms,
            "tokens": len(tokens),
            "mask_us_median": statistics.median(times), "mask_us_mean": statistics.fmean(times),
            "accepts_valid_output": ok}


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    names = [r["engine"] for r in rows]
    axes[0].bar(names, [r["compile_ms"] for r in rows], color=["tab:blue", "tab:orange"])
    axes[0].set_title("compile, nested JSON schema (ms, warm)")
    axes[1].bar(names, [r["mask_us_median"] for r in rows], color=["tab:blue", "tab:orange"])
    axes[1].set_title("mask fill per token, median (us)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="out/grammar_engines")
    args = ap.parse_args(argv)
    tok, vocab = _tokenizer()
    tokens = tok.encode(json.dumps(DOC))
    rows = []
    for cls in (XGrammarEngine, LLGuidanceEngine):
        try:
            engine = cls(tok, vocab)
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})")
            continue
        rows.append(walk(engine, SCHEMA, tokens, args.reps))
        print(json.dumps(rows[-1]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_engines.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "grammar_engines.png")
    print(f"wrote {out}/grammar_engines.json")


if __name__ == "__main__":
    main()
