"""Where a steady decode step stands against the memory roofline, for ``bench/e2e.py``.

* :func:`weight_read_bytes` and :class:`FloorMeter`: the *memory floor* of a decode
  step is the bytes it must read (every weight the step multiplies by, plus the KV
  of every context token, codes and scales) over the device's read ceiling; the
  share reached is that floor over the measured step time.
* :func:`profile_steps`: a torch profiler pass over a few steady steps: kernels per
  step, the GPU's busy time (the union of its kernel and copy intervals) and the
  share of the step it sits idle, and the kernels that take the most time. Recording
  the kernels costs the replayed graph about 2 us per kernel (H200, 2026-12-04: a
  419-kernel NVFP4 step ran 11.87 ms profiled against 11.05 ms unprofiled, and tracing
  host ops too added 0.15 ms more), so the idle share inside the pass overstates the
  gaps; ``bench/e2e.py`` also sets the pass's busy time against the unprofiled step.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from typing import Callable

import torch

# Read ceiling of one H200 (a Triton read kernel over 4 GiB, measured 2026-11-29 on the
# lent device: 4.47 TB/s in the kernel sitting's run; FACTS.md has 4.57 from another run).
H200_READ_TBS = 4.47


def weight_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters one decode step reads: all of them but an untied embedding table,
    of which it gathers only the batch's rows (the LM head is read whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if embed is not None and head is not None and embed is not head:
        total -= embed.numel() * embed.element_size()
    return total


class FloorMeter:
    """Sums the memory floor and the measured time over a run of decode steps.

    Args:
        weight_bytes: :func:`weight_read_bytes` of the model.
        kv_bytes_per_token: the pool's KV bytes per token over all layers.
        read_tbs: the read ceiling in TB/s.
    """

    def __init__(self, weight_bytes: int, kv_bytes_per_token: float, read_tbs: float):
        self.weight_bytes, self.bpt, self.bw = weight_bytes, kv_bytes_per_token, read_tbs * 1e12
        self.steps, self.tokens, self.seconds, self.floor_s, self.kv_bytes = 0, 0, 0.0, 0.0, 0.0

    def add(self, seconds: float, batch: int, context_tokens: int) -> None:
        """One step of ``batch`` sequences holding ``context_tokens`` tokens in all."""
        kv = context_tokens * self.bpt
        self.steps += 1
        self.tokens += batch
        self.seconds += seconds
        self.kv_bytes += kv
        self.floor_s += (self.weight_bytes + kv) / self.bw

    def summary(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps,
                "decode_tok_s": self.tokens / self.seconds if self.seconds else 0.0,
                "step_ms": 1e3 * self.seconds / n, "floor_ms": 1e3 * self.floor_s / n,
                "floor_share": self.floor_s / self.seconds if self.seconds else 0.0,
                "weight_gb": self.weight_bytes / 1e9, "kv_gb_per_step": self.kv_bytes / n / 1e9}


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def trace_summary(events: list[dict], steps: int, wall_s: float, top: int = 12) -> dict:
    """Kernels per step, GPU busy/idle and the top kernels from chrome-trace ``events``."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in
           ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        rec = by_name[e["name"][:90]]
        rec[0] += 1
        rec[1] += e["dur"]
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    n = max(steps, 1)
    return {"profiled_steps": steps, "kernels_per_step": len(kernels) / n,
            "copies_per_step": (len(gpu) - len(kernels)) / n,
            "kernel_ms_per_step": sum(e["dur"] for e in kernels) / 1e3 / n,
            "gpu_busy_ms_per_step": busy_us / 1e3 / n, "step_ms": 1e3 * wall_s / n,
            "gpu_idle_share": max(0.0, 1 - busy_us / 1e6 / wall_s) if wall_s else 0.0,
            "top_kernels": [{"name": k, "calls_per_step": c / n, "ms_per_step": us / 1e3 / n}
                            for k, (c, us) in ranked]}


def profile_steps(step: Callable[[], object], steps: int, device: torch.device,
                  host_ops: bool = False) -> dict:
    """Run ``step`` ``steps`` times under the torch profiler: GPU activity only, or with
    ``host_ops`` every host op too (CPU activity, which slows the host a little more).

    The wall time is the host's, synchronized at both ends, so the idle share counts the
    GPU's gaps inside the steps (host work the GPU waits on), not the profiler's export.
    """
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    if host_ops or not acts:
        acts.insert(0, ProfilerActivity.CPU)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with profile(activities=acts) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return {**trace_summary(events, steps, wall),
            "host_ops_traced": ProfilerActivity.CPU in acts}
