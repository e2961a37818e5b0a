"""Decode step time on the CPU as the context grows: one stream of the default model.

Steps one greedy request through the in-process engine and, at each context length asked for,
times ``--steps`` decode steps and the C decode attention's share of them
(``kernels/cpu/decode.DecodeStep._run``, the C call of every layer). Writes JSON.

    python -m nibble.bench.cpu_context --contexts 64 640 --quantization auto --out out/cpu_ctx
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from tqdm import tqdm

from nibble.kernels.cpu import decode as cpu_decode
from nibble.services.config import CacheConfig, ModelConfig, NibbleConfig, SchedulerConfig
from nibble.services.engine.builder import build_parts
from nibble.services.engine.types import GenerateRequest, SamplingParams

PROMPT = "Explain how a hash map works."


class _LayerTimer:
    """Wraps ``DecodeStep._run`` (under ``layer`` and ``layer_qkv``) to add up its wall time
    while installed."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        self._orig = cpu_decode.DecodeStep._run

    def __enter__(self):
        orig, timer = self._orig, self

        def timed(step, *args, **kwargs):
            t = time.perf_counter()
            try:
                return orig(step, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - t
                timer.calls += 1
        cpu_decode.DecodeStep._run = timed
        return self

    def __exit__(self, *exc):
        cpu_decode.DecodeStep._run = self._orig


def run(contexts: list[int], steps: int, quantization: str, dtype: str) -> list[dict]:
    cfg = NibbleConfig(model=ModelConfig(dtype=dtype, quantization=quantization),
                       cache=CacheConfig(max_total_tokens=max(contexts) + 4096),
                       scheduler=SchedulerConfig(max_running_requests=1))
    parts = build_parts(cfg)
    core, tok = parts.core, parts.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    total = max(contexts) + steps - len(ids) + 8
    core.add_request(GenerateRequest("ctx", ids, SamplingParams(
        max_tokens=total, temperature=0.0, ignore_eos=True)))
    rows, ctx = [], len(ids)
    with tqdm(total=max(contexts), desc="context", leave=False) as bar:
        for want in sorted(contexts):
            while ctx < want:
                core.step()
                ctx += 1
                bar.update(1)
            times = []
            with _LayerTimer() as timer:
                for _ in range(steps):
                    t = time.perf_counter()
                    core.step()
                    times.append(time.perf_counter() - t)
            ctx += steps
            rows.append({"context": want, "step_ms": sum(times) / steps * 1e3,
                         # robust to the neighbours' bursts that shared machines add
                         "step_ms_median": statistics.median(times) * 1e3,
                         "decode_layer_us": timer.seconds / max(timer.calls, 1) * 1e6,
                         "quantization": quantization, "dtype": dtype})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 640])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--out", default="out/cpu_context")
    args = p.parse_args(argv)
    rows = run(args.contexts, args.steps, args.quantization, args.dtype)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_context.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
