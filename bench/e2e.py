"""End-to-end engine benchmark: KV formats at equal concurrency and at equal memory.

For each ``--kv-formats`` entry the engine is built from the usual engine flags
(same weights, same ``--mem-fraction-static`` or ``--max-total-tokens`` bytes
of KV), then it runs ``C`` requests of ``--input-len`` random token ids and
``--output-len`` generated tokens (EOS ignored), all arriving at once:

* **iso-concurrency**: the same ``C`` for every format (default: the largest
  that every format's pool holds, i.e. the FP8 capacity);
* **iso-capacity**: each format at its own capacity, ``C = pages // pages per
  request``: NVFP4's pool holds 1.78x FP8's tokens in the same bytes.

A TTFT probe first runs ``--ttft-probes`` single requests alone (prefill only).
Reported per run: capacity, TTFT (probe median, and mean/p99 under the burst),
decode throughput over the steps where every request decodes (the steady
state), overall output throughput, the largest decode batch reached, and the
engine's decode path (CUDA graphs or eager). Writes ``e2e.json`` and
``e2e.png`` to ``--out``; on a GPU use ``--load-format dummy`` with
``bench/models/qwen3-8b``:

    python -m nibble.bench.e2e --model-path bench/models/qwen3-8b --load-format dummy \\
        --input-len 32768 --output-len 1024 --mem-fraction-static 0.4 \\
        --chunked-prefill-size 32768 --max-prefill-tokens 32768 --out out/e2e
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import pathlib
import statistics
import time

import torch
from tqdm import tqdm

from nibble.kernels import PageLayout
from nibble.services.config import add_engine_args, config_from_args
from nibble.services.engine.builder import build_parts
from nibble.services.engine.types import GenerateRequest, SamplingParams
from nibble.tiering import pages_for_budget

from ._step_profile import H200_READ_TBS, FloorMeter, profile_steps, weight_read_bytes

MODES = ("iso-concurrency", "iso-capacity")
PROFILE_WARMUP = 4        # steady steps (after a phase starts) before its profiler pass


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; 0.0 for an empty list."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def random_prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    """``n`` token ids in [10, vocab - 10) (clear of the special ids at either end)."""
    return torch.randint(10, max(11, vocab - 10), (n,), generator=gen).tolist()


def capacity(core, input_len: int, output_len: int) -> int:
    """Requests of ``input_len + output_len`` tokens that the pool holds at once."""
    ps = core.pool.layout.page_size
    return core.pool.num_pages // -(-(input_len + output_len) // ps)


def capacity_as(core, fmt: str, args) -> int:
    """:func:`capacity` had the pool held ``fmt`` pages: the same bytes (``--mem-fraction-static``)
    or the same tokens (``--max-total-tokens``)."""
    lay = core.pool.layout
    other = PageLayout(fmt, lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.page_size)
    pages = (core.pool.num_pages if args.max_total_tokens is not None
             else pages_for_budget(other, core.pool.capacity().pool_bytes))
    return pages // -(-(args.input_len + args.output_len) // lay.page_size)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ttft_probe(core, args, vocab: int, gen: torch.Generator) -> tuple[float, list[float]]:
    """Seconds to the first token for single requests run alone (prefill of input_len):
    ``(cold, warm)``: the first probe (first-call costs of the long shapes: allocator
    growth, kernel autotuning) is reported apart and left out of the median."""
    out = []
    for i in range(args.ttft_probes + 1):
        req = GenerateRequest(f"probe{i}", random_prompt(gen, args.input_len, vocab),
                              SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        core.add_request(req)
        while core.has_unfinished():
            core.step()
        out.append(time.perf_counter() - t0)
    return out[0], out[1:]


def unfuse(core) -> None:
    """Switch the engine to the unfused torch layer ops (and recapture its decode graphs)."""
    core.runner.model.set_fused_kernels(False)
    if hasattr(core.runner.backend, "fused"):
        core.runner.backend.fused = False
    _recapture(core)


def set_recipe(core, recipe) -> None:
    """Timing only: run the step with the K recipe ``recipe`` (None: plain NVFP4, the code
    path of ``nvfp4_plain``). Keys stored meanwhile do not match the pool's parameters, so
    the tokens are wrong; the bytes, shapes and kernels are those of the other format."""
    hook = core.runner.backend._recipe
    hook.recipe = recipe
    if recipe is None:
        hook._dev = None
    _recapture(core)


def _recapture(core) -> None:
    if core.runner.graphs is not None:
        core.runner.graphs.recapture()


def set_overlap(core, on: bool) -> list:
    """Overlap scheduling on or off between two steps; the outputs of the step that was in
    flight when it goes off (the caller records them)."""
    from nibble.services.engine.overlap import OverlapStepper
    if on and core.overlap is None:
        core.overlap = OverlapStepper(core)
        return []
    if not on and core.overlap is not None:
        outs = core.overlap.drain()
        core.overlap = None
        return outs
    return []


def _phase_plan(core, args) -> list[tuple[str, object]]:
    """``[(phase name, switch to it or None)]`` of a burst's steady steps, in order. Each
    switch returns the outputs it landed (a drained overlapped step)."""
    fused = getattr(core.runner.model, "fused_kernels", False)
    overlap = core.overlap is not None
    main = "fused" if fused else "unfused"
    plan = [(main, None)]
    recipe = getattr(getattr(core.runner.backend, "_recipe", None), "recipe", None)
    if args.compare_no_overlap and overlap:
        plan.append((main + "_no_overlap", lambda: set_overlap(core, False)))
    if args.compare_plain_recipe and recipe is not None:
        def plain():
            outs = set_overlap(core, overlap)
            set_recipe(core, None)
            return outs
        plan.append((main + "_plain_k", plain))
    if args.compare_unfused and fused:
        def unfused():      # the engine before both: recipe on, unfused, not overlapped
            outs = set_overlap(core, False)
            set_recipe(core, recipe)
            unfuse(core)
            return outs
        plan.append(("unfused", unfused))
    return plan


class _Burst:
    """Bookkeeping of one burst: first/last token times, tokens per request, step meters."""

    def __init__(self, core, args, c: int):
        self.core, self.args, self.c = core, args, c
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.generated: collections.Counter = collections.Counter()
        self.max_batch = 0
        self.meters: dict[str, FloorMeter] = {}
        self.profiles: dict[str, dict] = {}
        self.t0 = time.perf_counter()

    def step(self, meter: FloorMeter | None = None) -> int:
        """One engine step; a steady one (every request decoding) is added to ``meter``."""
        steady = len(self.first) == self.c
        context = sum(self.generated.values()) + self.c * self.args.input_len
        s0 = time.perf_counter()
        outs = self.core.step()
        now = time.perf_counter()
        n = self.record(outs, now)
        self.max_batch = max(self.max_batch, n)
        if meter is not None and steady and n == self.c:
            meter.add(now - s0, n, context)
        return n

    def record(self, outs, now: float) -> int:
        """Note the tokens of ``outs`` (landed at ``now``); returns how many."""
        n = sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            if o.new_token_ids:
                self.first.setdefault(o.request_id, now - self.t0)
                self.last[o.request_id] = now - self.t0
                self.generated[o.request_id] += len(o.new_token_ids)
        return n


def _profile_pair(step, steps: int, device) -> dict:
    """A profiler pass of GPU activity only (the figures), then one tracing host ops too,
    whose idle share and step time are kept beside them (``host_traced``) for comparison.
    Both passes lengthen the step (see ``_step_profile``); the caller also sets the busy
    time against the unprofiled steps (``gpu_idle_share_of_unprofiled_step``)."""
    prof = profile_steps(step, steps, device)
    traced = profile_steps(step, steps, device, host_ops=True)
    prof["host_traced"] = {k: traced[k] for k in ("step_ms", "gpu_busy_ms_per_step",
                                                    "gpu_idle_share")}
    return prof


def run_burst(core, args, c: int, vocab: int, gen: torch.Generator, label: str) -> dict:
    """``c`` requests at once; per-request TTFT/ITL and per-step decode throughput.

    Steady steps (every request decoding) are timed against the memory floor, per phase:
    ``fused`` (or ``unfused``, as the engine runs), then with ``--compare-plain-recipe``
    ``fused_plain_k`` (the K recipe off) and with ``--compare-unfused`` ``unfused``, each
    on an equal share of the steady steps (graphs recaptured at each switch). Each phase
    gets a profiler pass over ``--profile-steps`` steps (CUDA; left out of the timing).
    """
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = [random_prompt(gen, args.input_len, vocab) for _ in range(c)]
    b = _Burst(core, args, c)
    for i, p in enumerate(prompts):
        core.add_request(GenerateRequest(f"{label}-{i}", p, sp))
    weights, bpt = weight_read_bytes(core.runner.model), core.pool.layout.bytes_per_token
    device = core.pool.device
    plan = _phase_plan(core, args)
    split = max(2 * PROFILE_WARMUP + 3 * args.profile_steps, (args.output_len - c) // len(plan))
    (phase, _), since, at = plan[0], 0, 0
    with tqdm(total=c * args.output_len, desc=label, unit="tok", leave=False) as bar:
        while core.has_unfinished():
            steady = len(b.first) == c
            if phase not in b.meters:
                b.meters[phase] = FloorMeter(weights, bpt, args.read_ceiling_tbs)
            meter = b.meters[phase]
            if (steady and since == PROFILE_WARMUP and args.profile_steps
                    and device.type == "cuda" and phase not in b.profiles):
                b.profiles[phase] = _profile_pair(lambda: bar.update(b.step()),
                                                  args.profile_steps, device)
                since += 1
                continue
            bar.update(b.step(meter))
            since += steady
            if at + 1 < len(plan) and meter.steps >= split:
                at += 1
                phase, switch = plan[at]
                bar.update(b.record(switch(), time.perf_counter()))
                since = 0
    wall = time.perf_counter() - b.t0
    ttfts = list(b.first.values())
    itl = [(b.last[k] - b.first[k]) / max(1, args.output_len - 1) for k in b.first]
    phases = {k: {**m.summary(), **({"profile": b.profiles[k]} if k in b.profiles else {})}
              for k, m in b.meters.items() if m.steps}
    for ph in phases.values():      # the profiled busy time against the unprofiled step
        if "profile" in ph and ph["step_ms"]:
            ph["profile"]["gpu_idle_share_of_unprofiled_step"] = max(
                0.0, 1 - ph["profile"]["gpu_busy_ms_per_step"] / ph["step_ms"])
    main = next(iter(phases.values()), {})
    return {"concurrency": c, "requests": c, "wall_s": wall,
            "output_tok_s": c * args.output_len / wall,
            "decode_tok_s": main.get("decode_tok_s", 0.0),
            "decode_steps": main.get("steps", 0), "max_decode_batch": b.max_batch,
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_p99_s": pct(ttfts, 0.99),
            "itl_median_s": pct(itl, 0.5), "phases": phases}


def bench_format(fmt: str, args, base_ns: argparse.Namespace, conc: dict[str, int | None]) -> dict:
    """Build the engine for ``fmt``, probe TTFT, run the bursts this format needs."""
    # admission is limited by KV pages, not by a request count
    ns = argparse.Namespace(**{**vars(base_ns), "kv_cache_dtype": fmt,
                               "max_running_requests": max(base_ns.max_running_requests, 4096)})
    parts = build_parts(config_from_args(ns))
    core = parts.core
    cap = core.pool.capacity()
    c_max = capacity(core, args.input_len, args.output_len)
    if "iso-concurrency" in args.modes and conc.get("iso-concurrency") is None:
        conc["iso-concurrency"] = min(capacity_as(core, f, args) for f in args.kv_formats)
    vocab = parts.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    device = core.pool.device
    graphs = core.runner.graphs
    res = {"format": fmt, "pool_tokens": cap.max_tokens, "pool_bytes": cap.pool_bytes,
           "bytes_per_token": cap.bytes_per_token, "capacity_requests": c_max,
           "decode_path": "cuda-graphs" if graphs is not None else "eager",
           "attention_backend": parts.backend_name,
           "decode_impl": getattr(core.runner.backend, "decode_impl", None), "runs": {}}
    warm = GenerateRequest("warmup", random_prompt(gen, min(args.input_len, 512), vocab),
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    core.add_request(warm)      # JIT compiles and first-call costs stay out of the figures
    while core.has_unfinished():
        core.step()
    res["ttft_cold_s"], res["ttft_probe_s"] = ttft_probe(core, args, vocab, gen)
    _sync(device)
    todo = {}
    for mode in args.modes:
        c = c_max if mode == "iso-capacity" else conc["iso-concurrency"]
        if c and c > c_max:
            raise SystemExit(f"{fmt}: --concurrency {c} exceeds the pool's capacity {c_max}")
        if c:
            todo.setdefault(c, []).append(mode)
    for c, modes in sorted(todo.items()):
        run = run_burst(core, args, c, vocab, gen, f"{fmt} x{c}")
        run["modes"] = modes
        res["runs"][str(c)] = run
        print(f"{fmt:<9} C={c:<3} ({'+'.join(modes)}) TTFT mean {run['ttft_mean_s']:.2f}s "
              f"decode {run['decode_tok_s']:.0f} tok/s, output {run['output_tok_s']:.0f} tok/s, "
              f"max batch {run['max_decode_batch']}")
        for name, ph in run["phases"].items():
            prof = ph.get("profile", {})
            print(f"  {name:<8} step {ph['step_ms']:.2f} ms, floor {ph['floor_ms']:.2f} ms "
                  f"({100 * ph['floor_share']:.0f}% reached), {ph['decode_tok_s']:.0f} tok/s"
                  + (f"; {prof['kernels_per_step']:.0f} kernels/step "
                     f"({prof['kernels_per_step'] / core.runner.model.arch.num_layers:.1f}/layer),"
                     f" GPU idle {100 * prof['gpu_idle_share_of_unprofiled_step']:.1f}% of the"
                     f" unprofiled step ({100 * prof['gpu_idle_share']:.1f}% inside the"
                     f" profiled pass, {100 * prof['host_traced']['gpu_idle_share']:.1f}%"
                     " tracing host ops)" if prof else ""))
    res["graph_replays"] = graphs.replays if graphs is not None else 0
    del parts, core, graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def summarize(results: list[dict], conc: int | None) -> dict:
    """Ratios of the last format against the first (nvfp4 against fp8_e4m3 by default)."""
    if len(results) < 2:
        return {}
    a, b = results[0], results[-1]

    def run(r, c):
        return r["runs"].get(str(c), {})

    cap_a, cap_b = a["capacity_requests"], b["capacity_requests"]
    out = {"baseline": a["format"], "candidate": b["format"],
           "capacity_token_ratio": b["pool_tokens"] / a["pool_tokens"],
           "ttft_probe_change": statistics.median(b["ttft_probe_s"]) /
           statistics.median(a["ttft_probe_s"]) - 1}
    if conc and run(a, conc) and run(b, conc):
        out["iso_concurrency"] = conc
        out["iso_concurrency_decode_ratio"] = run(b, conc)["decode_tok_s"] / max(
            run(a, conc)["decode_tok_s"], 1e-9)
        out["iso_concurrency_output_ratio"] = run(b, conc)["output_tok_s"] / run(a, conc)["output_tok_s"]
        out["iso_concurrency_ttft_change"] = run(b, conc)["ttft_mean_s"] / run(a, conc)["ttft_mean_s"] - 1
    if run(a, cap_a) and run(b, cap_b):
        out["iso_capacity_concurrency"] = [cap_a, cap_b]
        out["iso_capacity_decode_ratio"] = run(b, cap_b)["decode_tok_s"] / max(
            run(a, cap_a)["decode_tok_s"], 1e-9)
        out["iso_capacity_output_ratio"] = run(b, cap_b)["output_tok_s"] / run(a, cap_a)["output_tok_s"]
    return out


def plot(results: list[dict], summary: dict, path: pathlib.Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = [r["format"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    axes[0].bar(fmts, [r["pool_tokens"] / 1e3 for r in results], color="tab:gray")
    axes[0].set_ylabel("KV pool capacity (k tokens, same bytes)")
    conc = summary.get("iso_concurrency")
    for ax, key, label in ((axes[1], "decode_tok_s", "decode tok/s (all requests decoding)"),
                           (axes[2], "output_tok_s", "output tok/s (whole burst)")):
        xs, width = range(len(fmts)), 0.38
        iso = [r["runs"].get(str(conc), {}).get(key, 0) for r in results]
        capv = [r["runs"].get(str(r["capacity_requests"]), {}).get(key, 0) for r in results]
        ax.bar([x - width / 2 for x in xs], iso, width, label=f"iso-concurrency (C={conc})")
        ax.bar([x + width / 2 for x in xs], capv, width,
               label="iso-capacity (C=" + "/".join(str(r["capacity_requests"]) for r in results) + ")")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(fmts)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap)
    b = ap.add_argument_group("benchmark")
    b.add_argument("--kv-formats", nargs="+", default=["fp8_e4m3", "nvfp4"])
    b.add_argument("--input-len", type=int, default=32768)
    b.add_argument("--output-len", type=int, default=1024)
    b.add_argument("--concurrency", type=int, default=None,
                   help="iso-concurrency C (default: the smallest capacity among the formats)")
    b.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    b.add_argument("--ttft-probes", type=int, default=2,
                   help="warm TTFT probes (one cold probe runs first and is reported apart)")
    b.add_argument("--read-ceiling-tbs", type=float, default=H200_READ_TBS,
                   help="device read bandwidth (TB/s) for the memory floor of a step")
    b.add_argument("--profile-steps", type=int, default=5,
                   help="steady steps per phase under the torch profiler (CUDA; 0: none)")
    b.add_argument("--compare-unfused", action="store_true",
                   help="end the steady steps on the unfused layer ops (a phase of its own)")
    b.add_argument("--compare-no-overlap", action="store_true",
                   help="a phase with overlap scheduling off (--disable-overlap-schedule)")
    b.add_argument("--compare-plain-recipe", action="store_true",
                   help="a recipe format also times a phase with its K recipe off (plain "
                        "NVFP4's code path; timing only, tokens are wrong meanwhile)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="out/e2e")
    ns = ap.parse_args(argv)
    ns.disable_radix_cache = True        # random prompts share nothing; keep the pool for them
    return ns


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    conc = {"iso-concurrency": args.concurrency}   # None: set from the first engine's pool
    results = [bench_format(f, args, args, conc) for f in args.kv_formats]
    summary = summarize(results, conc["iso-concurrency"])
    meta = {"input_len": args.input_len, "output_len": args.output_len,
            "model_path": args.model_path, "load_format": args.load_format,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "mem_fraction_static": args.mem_fraction_static,
            "max_total_tokens": args.max_total_tokens}
    (out / "e2e.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                              "results": results}, indent=1))
    plot(results, summary, out / "e2e.png",
         f"Nibble end to end: {args.input_len} in / {args.output_len} out, same KV bytes")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out / 'e2e.json'} and {out / 'e2e.png'}")


if __name__ == "__main__":
    main()
