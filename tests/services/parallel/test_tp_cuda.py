"""Tensor parallelism on CUDA, 2 ranks: fp32 tiny models through the GPU engine (Triton and
CUDA attention, the fused layer kernels, every KV format), TP=2 logits against TP=1 on the
same GPU.

- One GPU: both ranks share it over gloo (``--tp-backend gloo``; NCCL refuses two ranks on
  one GPU), eager steps.
- Two GPUs: NCCL, one GPU per rank, decode steps replayed from CUDA graphs that captured the
  all-reduces on both ranks (runs where two GPUs are visible: the two-GPU issue).

The ranks' partial sums differ from one GEMM's in the last bits: the same 1e-4 bound as the
CPU test (an H200 gave at most 4.8e-6 over the three formats)."""

from __future__ import annotations

import pytest
import torch

from nibble.bench._server import free_port

from .tp_harness import arch_of, single_logits, tp_logits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOL = 1e-4


def _check(kv: str, backend: str, devices: list[str]):
    arch = arch_of("qwen3")
    ref = single_logits(arch, kv, "cuda:0")
    got = tp_logits(arch, kv, 2, free_port(), backend, devices)
    assert len(got) == len(ref) >= 10
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref))
    print(f"{kv} {backend}: max |TP2 - TP1| = {worst:.2e} over {len(ref)} steps")
    assert worst < TOL
    for a, b in zip(got, ref):
        assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "nvfp4"])
def test_tp2_sharing_one_gpu_over_gloo_equals_tp1(kv):
    _check(kv, "gloo", ["cuda:0", "cuda:0"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_tp2_over_nccl_with_cuda_graphs_equals_tp1(kv):
    _check(kv, "nccl", ["cuda:0", "cuda:1"])
