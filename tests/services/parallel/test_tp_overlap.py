"""Tensor parallelism with overlap scheduling, on CPU (gloo, 2 ranks): rank 0 launches decode
steps and prompt chunks without waiting, broadcasting each launched step's sampled ids as a
tensor; the followers build the next step's input ids from their copy. Logits of every
sampled row equal TP=1 with overlap (same steps, same extra step at each stop), within the
CPU test's 1e-4, with the same greedy tokens, and steps really were launched."""

from __future__ import annotations

import pytest

from nibble.bench._server import free_port

from .tp_harness import arch_of, single_logits, tp_logits

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_tp2_overlapped_engine_equals_tp1_overlapped(kv):
    arch = arch_of("qwen3")
    ref = single_logits(arch, kv, overlap=True)
    stats: dict = {}
    got = tp_logits(arch, kv, 2, free_port(), overlap=True, stats=stats)
    assert stats["launches"] >= 4              # decode steps and chunks launched ahead
    assert len(got) == len(ref) >= 10
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() < 1e-4
        assert (a.argmax(-1) == b.argmax(-1)).all()
