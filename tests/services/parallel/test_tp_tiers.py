"""Tiers with tensor parallelism on CPU (gloo, 2 ranks, L2 host pool + L3 file backend):
each rank writes its own L3 records; after an L1 eviction (L2 hit) and after an L1 + L2
flush (L3 hit) every rank's pages come back bit-identical, and the logits equal the
TP=1 run within 1e-4."""

from __future__ import annotations

import os

import pytest

from nibble.bench._server import free_port

from .tp_harness import arch_of
from .tp_tiers_harness import single_run, tp_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kv", ["nvfp4", "bf16"])
def test_tp2_tiers_bring_every_rank_its_pages_back(tmp_path, kv):
    arch = arch_of("qwen3")
    ref = single_run(arch, kv, str(tmp_path / "tp1"))
    got = tp_run(arch, kv, 2, free_port(), str(tmp_path / "tp2"))

    rank0 = got[0]["counters"]
    assert rank0["l2_hit_pages"] == 3 and rank0["l3_hit_pages"] == 3
    assert rank0["l3_peer_missing"] == 0
    follower = got[1]["counters"]
    assert follower["l3_read"] == 3 and follower["l1_loaded"] == 6
    for rank in (0, 1):
        snaps = got[rank]["snaps"]
        assert snaps["from_l2"] == snaps["computed"], f"rank {rank}: L2 copy differs"
        assert snaps["from_l3"] == snaps["computed"], f"rank {rank}: L3 copy differs"
    assert got[0]["snaps"]["computed"] != got[1]["snaps"]["computed"]   # each its own heads

    # each rank wrote its own records, in its own directory
    dirs = sorted(os.listdir(tmp_path / "tp2"))
    assert dirs == ["tp2-rank0", "tp2-rank1"]
    for d in dirs:
        records = [f for _, _, fs in os.walk(tmp_path / "tp2" / d) for f in fs]
        assert len(records) >= 3

    assert len(got[0]["logits"]) == len(ref["logits"]) == 12
    import torch
    for a, b in zip(got[0]["logits"], ref["logits"]):
        a, b = torch.tensor(a), torch.tensor(b)
        assert (a - b).abs().max().item() < 1e-4
        assert (a.argmax(-1) == b.argmax(-1)).all()
