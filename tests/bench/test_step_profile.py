"""The memory floor and the profiler summary of bench/e2e.py's steady decode steps."""

from __future__ import annotations

import pytest
import torch

from nibble.bench._step_profile import FloorMeter, trace_summary, weight_read_bytes


def test_floor_meter_arithmetic():
    m = FloorMeter(weight_bytes=10**9, kv_bytes_per_token=1000.0, read_tbs=1.0)
    m.add(0.004, 4, 1_000_000)          # 1 GB weights + 1 GB KV at 1 TB/s: 2 ms floor
    m.add(0.002, 4, 3_000_000)          # 4 GB: 4 ms floor (faster than the floor: share > 1)
    s = m.summary()
    assert s["steps"] == 2 and s["decode_tok_s"] == pytest.approx(8 / 0.006)
    assert s["floor_ms"] == pytest.approx(3.0) and s["step_ms"] == pytest.approx(3.0)
    assert s["floor_share"] == pytest.approx(1.0) and s["kv_gb_per_step"] == pytest.approx(2.0)


def test_weight_read_bytes_skips_an_untied_embedding():
    class M(torch.nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.embed = torch.nn.Parameter(torch.zeros(10, 4))
            self.lm_head = self.embed if tied else torch.nn.Parameter(torch.zeros(10, 4))
            self.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    assert weight_read_bytes(M(tied=True)) == 160 + 6
    assert weight_read_bytes(M(tied=False)) == 160 + 6


def test_trace_summary_counts_kernels_and_idle():
    ev = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 400},
          {"ph": "X", "cat": "kernel", "name": "norm", "ts": 300, "dur": 200},    # overlaps
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 900, "dur": 100},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1500, "dur": 500},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]
    s = trace_summary(ev, steps=2, wall_s=0.004)
    assert s["kernels_per_step"] == 1.5 and s["copies_per_step"] == 0.5
    assert s["gpu_busy_ms_per_step"] == pytest.approx(1.1 / 2)      # 500 + 100 + 500 us
    assert s["gpu_idle_share"] == pytest.approx(1 - 1.1 / 4)
    assert s["kernel_ms_per_step"] == pytest.approx(0.55)
    assert s["top_kernels"][0] == {"name": "gemm", "calls_per_step": 1.0, "ms_per_step": 0.45}


def test_profile_steps_on_cpu_traces_host_ops():
    """Without a GPU the pass records host ops (there is nothing else) and says so."""
    import torch

    from nibble.bench._step_profile import profile_steps
    x = torch.ones(64, 64)
    s = profile_steps(lambda: x @ x, 3, torch.device("cpu"))
    assert s["profiled_steps"] == 3 and s["host_ops_traced"] is True
    assert s["kernels_per_step"] == 0 and s["step_ms"] > 0
