"""Shared by the GPU micro-benchmarks: CUDA-graph replay timing, and the JSON and plot."""

from __future__ import annotations

import json
import pathlib
from typing import Callable

import torch


def replay_us(graph: torch.cuda.CUDAGraph, units: int, reps: int = 10) -> float:
    """Microseconds per unit of work (``units`` per replay, e.g. layers) over ``reps``
    back-to-back replays of ``graph`` between two CUDA events, after one warm replay."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / units


def save(data: dict, out: str, plot: Callable[[dict, pathlib.Path], None]) -> None:
    """``data`` as JSON at ``out`` (folders made) and ``plot(data, <out>.png)``."""
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    plot(data, path.with_suffix(".png"))
