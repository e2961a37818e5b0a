"""Where a prompt chunk's step time goes (issue 16: the trade between ITL p99 and input
throughput under chunked prefill is set by what one chunk costs per token).

Builds the engine from the usual ``nibble serve`` flags once per KV format, warms it up, then
runs one prompt of ``--input-len`` tokens in chunks of ``--chunked-prefill-size``, alone or
beside ``--decode-riders`` requests that decode all the while (each chunk step then a mixed
step, as in a server), timing every chunk step (device synchronized after each, overlap
scheduling off), and profiles ``--profile-chunks``
chunk steps in the middle of the prompt (torch profiler: the top kernels). Prints each
chunk's ms and us per token and the dense-GEMM TFLOP/s that implies; JSON to ``--out``::

    python -m nibble.bench.prefill_profile --model-path bench/models/qwen3-8b \\
        --load-format dummy --mem-fraction-static 0.4 --input-len 32768 \\
        --chunked-prefill-size 2048 --max-prefill-tokens 2048 --kv-formats bf16 nvfp4
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import time

import torch

from nibble.services.config import add_engine_args, config_from_args
from nibble.services.engine.builder import build_parts
from nibble.services.engine.types import GenerateRequest, SamplingParams

from ._step_profile import profile_steps
from .e2e import _sync, random_prompt


def gemm_flops_per_token(model: torch.nn.Module) -> float:
    """2 x the elements of every 2-D weight but the embedding table: the dense GEMM work per
    prompt token (an upper bound: the LM head runs on the sampled rows only)."""
    embed = getattr(model, "embed_tokens", None)
    skip = {id(embed.weight)} if embed is not None and hasattr(embed, "weight") else set()
    return 2.0 * sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)


def run_format(fmt: str, args: argparse.Namespace) -> dict:
    """One engine, one prompt in chunks (beside ``--decode-riders`` decoding requests): per-chunk
    times and a profile of the middle chunks.

    Overlap scheduling is off: a launched chunk step would finish inside the next call, and
    each time would belong to the step before it."""
    ns = argparse.Namespace(**{**vars(args), "kv_cache_dtype": fmt,
                               "disable_overlap_schedule": True})
    parts = build_parts(config_from_args(ns))
    core, device = parts.core, parts.core.pool.device
    vocab = parts.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateRequest("warm", random_prompt(gen, args.input_len, vocab), one))
    while core.has_unfinished():
        core.step()
    _sync(device)
    n_chunks = -(-args.input_len // ns.chunked_prefill_size)
    start_riders(core, args, n_chunks + args.profile_chunks + args.host_profile + 8, gen, vocab)
    core.add_request(GenerateRequest("p", random_prompt(gen, args.input_len, vocab), one))
    chunks, enqueue, profile, host = [], [], None, None
    mid = max(1, n_chunks // 2)
    done = False
    while not done:
        if len(chunks) == mid and profile is None and device.type == "cuda":
            profile = profile_steps(core.step, args.profile_chunks, device)
            continue
        if len(chunks) == mid + 1 and host is None and args.host_profile:
            host = host_profile(core, args.host_profile, device)
            continue
        t0 = time.perf_counter()
        outs = core.step()
        _sync(device)
        chunks.append(1e3 * (time.perf_counter() - t0))
        enqueue.append(1e3 * core.runner.enqueue_s)
        done = any(o.request_id == "p" and o.finished for o in outs)
    core.abort_all()
    while core.has_unfinished():
        core.step()
    flops = gemm_flops_per_token(core.runner.model)
    per_tok_us = [1e3 * ms / ns.chunked_prefill_size for ms in chunks]
    res = {"format": fmt, "chunk": ns.chunked_prefill_size, "chunk_ms": chunks,
           "enqueue_ms": enqueue,
           "us_per_token": per_tok_us, "gemm_gflop_per_token": flops / 1e9,
           "first_chunk_gemm_tflops": flops * ns.chunked_prefill_size / (chunks[0] / 1e3) / 1e12,
           "profile": profile, "host_profile": host}
    del parts, core
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def start_riders(core, args: argparse.Namespace, steps: int, gen: torch.Generator,
                 vocab: int) -> None:
    """``--decode-riders`` requests of ``--rider-len`` prompt tokens, run until every one
    decodes, so that each measured chunk step is a mixed step, as in a server; they decode
    for ``steps`` more steps at most and are aborted after the measured prompt."""
    riders = {f"rider{i}" for i in range(args.decode_riders)}
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for rid in sorted(riders):
        core.add_request(GenerateRequest(rid, random_prompt(gen, args.rider_len, vocab), params))
    while riders:
        riders -= {o.request_id for o in core.step() if o.new_token_ids}


def host_profile(core, steps: int, device: torch.device, top: int = 30) -> dict:
    """cProfile over ``steps`` chunk steps (device synchronized after each): where the
    host's time goes, and each step's forward enqueue time beside its wall time."""
    import cProfile
    import io
    import pstats

    prof, enqueue, wall = cProfile.Profile(), [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        prof.enable()
        core.step()
        prof.disable()
        _sync(device)
        wall.append(1e3 * (time.perf_counter() - t0))
        enqueue.append(1e3 * core.runner.enqueue_s)
    out = {"wall_ms": wall, "enqueue_ms": enqueue}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        out[key] = buf.getvalue().splitlines()
    return out


def report(res: dict) -> None:
    ms = res["chunk_ms"]
    print(f"{res['format']}: {len(ms)} chunk steps of {res['chunk']} tokens: first {ms[0]:.1f} ms, "
          f"middle {ms[len(ms) // 2]:.1f} ms, last {ms[-1]:.1f} ms "
          f"({res['us_per_token'][0]:.1f} -> {res['us_per_token'][-1]:.1f} us/token); "
          f"GEMMs {res['gemm_gflop_per_token']:.1f} GFLOP/token, first chunk at "
          f"{res['first_chunk_gemm_tflops']:.0f} TFLOP/s")
    prof = res.get("profile") or {}
    if prof:
        print(f"  profiled middle chunk: {prof['step_ms']:.1f} ms/step, kernels "
              f"{prof['kernel_ms_per_step']:.1f} ms/step, "
              f"GPU idle {100 * prof['gpu_idle_share']:.0f}%")
        for k in prof["top_kernels"]:
            print(f"    {k['ms_per_step']:8.2f} ms {k['calls_per_step']:6.0f}x  {k['name']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--kv-formats", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--profile-chunks", type=int, default=2)
    ap.add_argument("--host-profile", type=int, default=0,
                    help="chunk steps to run under cProfile after the profiled ones (0: none)")
    ap.add_argument("--decode-riders", type=int, default=0,
                    help="requests decoding beside the measured prompt (mixed steps, as served)")
    ap.add_argument("--rider-len", type=int, default=4096, help="each rider's prompt tokens")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    results = []
    for fmt in args.kv_formats:
        results.append(run_format(fmt, args))
        report(results[-1])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
