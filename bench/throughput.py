"""Generation throughput on this machine: Nibble's engine against HF transformers.

Runs the same prompts through Nibble's in-process engine (NVFP4 KV by default)
and through ``transformers`` ``generate`` on the same GGUF weights, for 1
stream and for N concurrent streams, with EOS ignored so every run produces
exactly ``--output-len`` tokens. Writes JSON and a bar chart.

    python -m nibble.bench.throughput --streams 1 8 --output-len 64 --out out/throughput

``--dtype bfloat16`` runs both engines' weights in bf16 (fast where the CPU has AVX512-BF16).
``--quantization none gguf`` runs Nibble twice: on the dequantized weights, and with the GGUF's
4-bit weights packed for decode steps (``services/models/weight_quant.py``).
``--llama-bench BIN`` also times llama.cpp's ``llama-bench`` (built separately, see
docs/benchmarks.md) on the same GGUF, single stream, in the same run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import time

import torch
from tqdm import tqdm

from nibble.services.config import CacheConfig, ModelConfig, NibbleConfig, SchedulerConfig
from nibble.services.engine.builder import build_parts
from nibble.services.engine.types import GenerateRequest, SamplingParams

PROMPTS = [
    "Explain how a hash map works.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Describe the water cycle for a child.",
    "List five tips for writing clean code.", "Why is the sky blue?",
    "Summarize the plot of a heist movie you invent.", "How do vaccines train the immune system?",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(prompt)


def run_nibble(kv: str, streams: int, output_len: int, dtype: str = "float32",
               quantization: str = "none") -> dict:
    cfg = NibbleConfig(model=ModelConfig(dtype=dtype, quantization=quantization),
                       cache=CacheConfig(kv_cache_dtype=kv, max_total_tokens=32768),
                       scheduler=SchedulerConfig(max_running_requests=max(streams, 1)))
    parts = build_parts(cfg)
    core, tok = parts.core, parts.tokenizer
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # Warm-up: one short request.
    core.add_request(GenerateRequest("warm", chat_ids(tok, "hi"), SamplingParams(max_tokens=4)))
    while core.has_unfinished():
        core.step()
    reqs = [GenerateRequest(f"r{i}", chat_ids(tok, PROMPTS[i % len(PROMPTS)]), sp)
            for i in range(streams)]
    t0 = time.perf_counter()
    for r in reqs:
        core.add_request(r)
    produced, t_first, first = 0, None, 0
    label = f"nibble-{kv}" + ("-gguf" if quantization == "gguf" else "")
    with tqdm(total=streams * output_len, desc=f"{label} x{streams}", leave=False) as bar:
        while core.has_unfinished():
            n = sum(len(o.new_token_ids) for o in core.step())
            produced += n
            if t_first is None and produced >= streams:   # every prompt prefilled
                t_first, first = time.perf_counter(), produced
            bar.update(n)
    t_end = time.perf_counter()
    dt = t_end - t0
    return {"engine": label, "dtype": dtype, "quantization": quantization, "streams": streams,
            "output_tokens": produced, "seconds": dt, "tokens_per_s": produced / dt,
            # the decode phase alone (what llama-bench's tg test times): after the prefills
            "decode_tokens_per_s": (produced - first) / (t_end - t_first)
            if t_first is not None and t_end > t_first else None}


def run_hf(streams: int, output_len: int, dtype: str = "float32") -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nibble.services.models.loader import default_model_path

    path = pathlib.Path(default_model_path())
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=getattr(torch, dtype)).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     tokenize=False, add_generation_prompt=True)
             for i in range(streams)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
              pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        model.generate(**tok(["hi"], return_tensors="pt"), max_new_tokens=4)
        t0 = time.perf_counter()
        out = model.generate(**enc, **kw)
        dt = time.perf_counter() - t0
    produced = (out.shape[1] - enc["input_ids"].shape[1]) * streams
    return {"engine": "hf-transformers", "dtype": dtype, "streams": streams,
            "output_tokens": produced, "seconds": dt, "tokens_per_s": produced / dt}


def parse_llama_bench(text: str) -> dict:
    """The generation row of ``llama-bench -o json`` output: tokens and mean tok/s."""
    rows = [r for r in json.loads(text) if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if len(rows) != 1:
        raise ValueError(f"expected one generation-only row in llama-bench output, got "
                         f"{len(rows)}")
    return {"output_tokens": int(rows[0]["n_gen"]), "tokens_per_s": float(rows[0]["avg_ts"]),
            "threads": int(rows[0].get("n_threads", 0)), "model_type": rows[0].get("model_type")}


def run_llama(binary: str, output_len: int, threads: int = 2) -> dict:
    """``llama-bench`` on the default model's GGUF (its own Q4_1 kernels), one stream."""
    from nibble.services.models.loader import default_model_path

    cmd = [binary, "-m", str(default_model_path()), "-t", str(threads), "-p", "0",
           "-n", str(output_len), "-r", "3", "-o", "json"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    row = parse_llama_bench(done.stdout)
    return {"engine": "llama.cpp-q4_1", "dtype": "q4_1", "streams": 1,
            "seconds": time.perf_counter() - t0, **row}


def plot(results: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = sorted({r["engine"] for r in results})
    streams = sorted({r["streams"] for r in results})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(engines)
    for i, eng in enumerate(engines):
        vals = [next((r["tokens_per_s"] for r in results
                      if r["engine"] == eng and r["streams"] == s), 0) for s in streams]
        ax.bar([j + i * width for j in range(len(streams))], vals, width, label=eng)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(streams))],
                  [f"{s} stream(s)" for s in streams])
    ax.set_ylabel("output tokens / s")
    ax.set_title("Generation throughput, SmolLM2-135M, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv", nargs="+", default=["nvfp4", "bf16"])
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model dtype of both engines (bfloat16: AVX512-BF16 CPUs)")
    p.add_argument("--quantization", nargs="+", default=["none"], choices=("none", "gguf"),
                   help="Nibble's weights: none (dequantized, --dtype), gguf (the file's 4-bit "
                        "codes for decode steps); several run side by side")
    p.add_argument("--llama-bench", default=None, metavar="BIN",
                   help="also time this llama-bench binary on the same GGUF (1 stream)")
    p.add_argument("--out", default="out/throughput")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for s in args.streams:
        if args.llama_bench and s == 1:
            results.append(run_llama(args.llama_bench, args.output_len))
            print(json.dumps(results[-1]))
        for kv in args.kv:
            for q in args.quantization:
                results.append(run_nibble(kv, s, args.output_len, args.dtype, q))
                print(json.dumps(results[-1]))
        if not args.no_hf:
            results.append(run_hf(s, args.output_len, args.dtype))
            print(json.dumps(results[-1]))
    (out / "throughput.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "throughput.png")
    print(f"{'engine':<20}{'streams':>8}{'tok/s':>10}{'decode tok/s':>14}")
    for r in results:
        dec = r.get("decode_tokens_per_s")
        print(f"{r['engine']:<20}{r['streams']:>8}{r['tokens_per_s']:>10.1f}"
              f"{'' if dec is None else format(dec, '.1f'):>14}")


if __name__ == "__main__":
    main()
