"""One tiered scenario at TP=1 in-process and at TP=2 over gloo: a prompt is computed, then
read back after an L1 eviction (from L2), then after an L1 + L2 flush (from L3, the file
backend). Every rank hashes the prompt's L1 pages after each phase (rank 0 broadcasts a
``snap`` message, which the followers' group wrapper answers between steps)."""

from __future__ import annotations

import hashlib
import os
import traceback
from types import SimpleNamespace

import torch

from nibble.services.config import HiCacheConfig
from nibble.services.engine.builder import Injected, build_engine_core
from nibble.services.engine.types import GenerateRequest, SamplingParams
from nibble.services.models.loader import new_model
from nibble.services.parallel.follower import follow, stop_followers
from nibble.services.parallel.group import SingleGroup, TorchGroup
from nibble.tiering.secret import KVSecret

from ..engine.conftest import engine_config
from .tp_harness import PROMPT, TextTokenizer, hf_weights

SECRET = KVSecret("tp-tiers-test-secret-0123456789abcdef")
TOKENS = PROMPT[:60]          # 3 full pages of 16 reusable (one token is always computed)


class SnapTap:
    """A follower's view of the group: ``snap`` broadcasts are answered here (hash the named
    pages of ``pool``), everything else goes to ``follow``."""

    def __init__(self, tp, pool):
        self.tp, self.pool, self.rank, self.size = tp, pool, tp.rank, tp.size
        self.snaps: dict[str, list[str]] = {}

    def broadcast_object(self, obj=None):
        while True:
            msg = self.tp.broadcast_object(obj)
            if msg[0] != "snap":
                return msg
            self.snaps[msg[1]] = page_hashes(self.pool, msg[2])

    def gather_object(self, obj=None):
        return self.tp.gather_object(obj)


def page_hashes(pool, pages) -> list[str]:
    """SHA-256 of each page's bytes (uint8 ``[num_layers, layer_nbytes]``)."""
    return [hashlib.sha256(pool.pages[p].contiguous().numpy().tobytes()).hexdigest()
            for p in pages]


def tiered_config(kv: str, l3_dir: str):
    hicache = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=1.0,
                            hicache_storage_backend="file", hicache_storage_url=l3_dir,
                            hicache_write_policy="write_through",
                            hicache_prefetch_policy="wait_complete")
    return engine_config(kv, num_pages=64, page_size=16, chunked_prefill_size=16,
                         hicache=hicache)


def build(arch, kv: str, l3_dir: str, tp=None):
    model = new_model(arch, torch.float32, torch.device("cpu"), tp)
    model.load_weights(hf_weights(arch).items())
    model.finish_loading()
    return build_engine_core(model, TextTokenizer(), tiered_config(kv, l3_dir),
                             inject=Injected(calibrate=kv != "bf16", secret=SECRET))


def _run(eng, rid: str) -> None:
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request(GenerateRequest(rid, list(TOKENS), sp))
    while eng.has_unfinished():
        eng.step()


def scenario(eng, tp) -> dict:
    """Rank 0: compute, evict L1 and load from L2, flush L1+L2 and load from L3. Returns the
    logits of every sampled row, rank 0's page hashes per phase and tier counters."""
    seen, snaps = [], {}
    orig = eng.runner._sample
    eng.runner._sample = lambda picked, logits: (seen.append(logits.clone()),
                                                 orig(picked, logits))[1]
    probe = SimpleNamespace(request_id="probe", token_ids=list(TOKENS), namespace="",
                            no_reuse=False)

    def snap(name):
        pages = list(eng.kv.match(probe).pages)
        assert len(pages) == 3, f"{name}: {len(pages)} cached pages"
        tp.broadcast_object(("snap", name, pages))
        snaps[name] = page_hashes(eng.kv.pool, pages)

    _run(eng, "a")
    assert eng.kv.tiers.drain()
    snap("computed")
    assert len(eng.kv.evict(64)) >= 3                      # L1 forgets the prompt
    _run(eng, "b")
    snap("from_l2")
    eng.kv.flush()                                         # L1 and L2 forget it
    _run(eng, "c")
    snap("from_l3")
    assert eng.kv.tiers.drain()
    return {"logits": [t.tolist() for t in seen], "snaps": snaps,
            "counters": dict(eng.kv.tiers.counters)}


def run_rank(rank: int, size: int, port: int, arch, kv: str, l3_dir: str, queue) -> None:
    import torch.distributed as dist
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        torch.manual_seed(0)
        tp = TorchGroup()
        eng = build(arch, kv, l3_dir, tp)
        if rank == 0:
            out = scenario(eng, tp)
            stop_followers(tp)
        else:
            tap = SnapTap(tp, eng.kv.pool)
            follow(eng.runner, tap, eng.runner.tier_mirror)
            out = {"snaps": tap.snaps, "counters": dict(eng.runner.tier_mirror.counters)}
        queue.put(("ok", rank, out))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent test
        queue.put(("error", rank, traceback.format_exc()))


def tp_run(arch, kv: str, size: int, port: int, l3_dir: str) -> dict[int, dict]:
    """Every rank's result, by rank."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, size, port, arch, kv, l3_dir, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(size):
            status, rank, payload = queue.get(timeout=300)
            if status != "ok":
                raise AssertionError(f"rank {rank}: {payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


def single_run(arch, kv: str, l3_dir: str) -> dict:
    torch.manual_seed(0)
    return scenario(build(arch, kv, l3_dir), SingleGroup())
