"""Structured outputs: do N requests with a nested JSON schema all validate, and what does the
grammar cost? (``nibble bench structured``)

In-process engine (the server's builder). Phase 1 runs ``--num-requests`` sampled requests
(temperature 0.8, one seed each) under a nested schema at ``--validate-concurrency`` and
validates every output with ``jsonschema``. Phase 2 decodes at each ``--concurrency``
with and without the schema (same prompts and lengths: the unconstrained run is held to
the constrained run's token counts) and reports decode tok/s, their ratio, and the time the
sampler spends building and applying masks per token. Writes JSON and a bar chart.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch
from tqdm import tqdm

from nibble.services.config import (CacheConfig, DeviceConfig, ModelConfig, NibbleConfig,
                                    SchedulerConfig)
from nibble.services.engine.builder import build_parts
from nibble.services.engine.grammar_spec import GrammarSpec
from nibble.services.engine.types import GenerateRequest, SamplingParams

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["city", "kind", "founded_bc", "landmarks"],
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["capital", "town", "village"]},
        "founded_bc": {"type": "boolean"},
        "landmarks": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "tags"],
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "tags": {"type": "array", "maxItems": 2,
                                    "items": {"enum": ["old", "tall", "museum"]}}}}},
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--kv-cache-dtype", default="nvfp4")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--validate-concurrency", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--out", default="out/structured")
    return ap.parse_args(argv)


class MaskTimer:
    """Wraps the runner's mask step; seconds spent and rows masked."""

    def __init__(self, runner):
        self.seconds, self.rows = 0.0, 0
        orig = runner._grammar_mask

        def timed(picked, logits):
            t0 = time.perf_counter()
            out = orig(picked, logits)
            if out is not logits:
                if out.is_cuda:
                    torch.cuda.synchronize(out.device)
                self.seconds += time.perf_counter() - t0
                self.rows += sum(s.sampling.grammar is not None for s in picked)
            return out
        runner._grammar_mask = timed


def run_wave(core, reqs) -> tuple[dict[str, list[int]], float]:
    """All of ``reqs`` at once; their tokens and the wall time."""
    for r in reqs:
        core.add_request(r)
    toks = {r.request_id: [] for r in reqs}
    t0 = time.perf_counter()
    while core.has_unfinished():
        for o in core.step():
            toks[o.request_id] += o.new_token_ids
    return toks, time.perf_counter() - t0


def validate(core, tok, prompt, args) -> dict:
    import jsonschema
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA), True)
    ok, bad, c = 0, [], args.validate_concurrency
    for start in tqdm(range(0, args.num_requests, c), desc="validate", unit="wave"):
        reqs = [GenerateRequest(f"v{i}", prompt, SamplingParams(
            max_tokens=args.max_tokens, temperature=0.8, seed=i, grammar=spec))
            for i in range(start, min(start + c, args.num_requests))]
        toks, _ = run_wave(core, reqs)
        for rid, ids in toks.items():
            text = tok.decode(ids)
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                ok += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                bad.append({"id": rid, "text": text[:200], "error": str(exc)[:200]})
    return {"requests": args.num_requests, "valid": ok, "invalid": bad}


def cost(core, prompt, args, timer: MaskTimer) -> list[dict]:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA), True)
    rows = []
    for c in args.concurrency:
        timer.seconds, timer.rows = 0.0, 0
        con, t_con = run_wave(core, [GenerateRequest(f"c{c}-{i}", prompt, SamplingParams(
            max_tokens=args.max_tokens, temperature=0.8, seed=i, grammar=spec))
            for i in range(c)])
        lengths = [max(1, len(v)) for v in con.values()]
        free, t_free = run_wave(core, [GenerateRequest(f"f{c}-{i}", prompt, SamplingParams(
            max_tokens=n, temperature=0.8, seed=i, ignore_eos=True))
            for i, n in enumerate(lengths)])
        n_con, n_free = sum(len(v) for v in con.values()), sum(len(v) for v in free.values())
        rows.append({"concurrency": c, "tokens": n_con,
                     "tok_s_schema": n_con / t_con, "tok_s_free": n_free / t_free,
                     "ratio": (n_con / t_con) / (n_free / t_free),
                     "mask_ms_per_token": 1e3 * timer.seconds / max(1, timer.rows)})
        print(json.dumps(rows[-1]))
    return rows


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["tok_s_free"] for r in rows], 0.4, label="no schema")
    ax.bar([x + 0.2 for x in xs], [r["tok_s_schema"] for r in rows], 0.4, label="JSON schema")
    for x, r in zip(xs, rows):
        ax.annotate(f"{r['ratio']:.2f}x", (x + 0.2, r["tok_s_schema"]), ha="center",
                    va="bottom")
    ax.set_xticks(list(xs), [f"{r['concurrency']} concurrent" for r in rows])
    ax.set_ylabel("decode tok/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def prompt_text(tok) -> str:
    """The chat-templated question, or the bare question for a tokenizer without a template
    (a dummy-weight model with a real tokenizer file)."""
    from nibble.services.errors import InvalidRequestError
    question = "Describe Paris as JSON."
    try:
        return tok.apply_chat_template([{"role": "user", "content": question}],
                                       add_generation_prompt=True)
    except InvalidRequestError:
        return question + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = NibbleConfig(model=ModelConfig(model_path=args.model_path, load_format=args.load_format),
                       cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype),
                       scheduler=SchedulerConfig(max_running_requests=max(
                           [args.validate_concurrency, *args.concurrency])),
                       device=DeviceConfig())
    parts = build_parts(cfg)
    core, tok = parts.core, parts.tokenizer
    timer = MaskTimer(core.runner)
    prompt = tok.encode(prompt_text(tok))
    result = {"model": parts.model_name, "device": str(core.pool.device),
              "validation": validate(core, tok, prompt, args),
              "cost": cost(core, prompt, args, timer)}
    (out / "structured.json").write_text(json.dumps(result, indent=1))
    plot(result["cost"], out / "structured.png",
         f"{parts.model_name} on {result['device']}: grammar cost")
    v = result["validation"]
    print(f"valid {v['valid']}/{v['requests']}; wrote {out / 'structured.json'}")


if __name__ == "__main__":
    main()
