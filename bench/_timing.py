"""Timing helpers shared by the GPU benchmarks."""

from __future__ import annotations

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
