"""Runs one engine scenario at TP=1 in-process and at TP=n in n spawned processes (joined by
``parallel.launch.join``: gloo on CPU; on CUDA gloo or NCCL), returning the logits every step
sampled from (rank 0's; the followers only compute)."""

from __future__ import annotations

import dataclasses
import traceback

import torch

from nibble.services.engine.types import GenerateRequest, SamplingParams
from nibble.services.models.config import ModelArchConfig
from nibble.services.models.loader import new_model
from nibble.services.parallel.launch import join
from nibble.services.parallel.follower import follow, stop_followers

from ..engine.conftest import CharTokenizer, engine_config
from ..engine.conftest import tiny_arch as engine_tiny_arch

from nibble.services.engine.builder import Injected, build_engine_core

PROMPT = [(7 * i + 3) % 90 + 1 for i in range(70)]


def arch_of(name: str, **kw) -> ModelArchConfig:
    """Tiny random architectures of every family (head counts that split over 2 ranks
    unevenly where ``kw`` says so)."""
    extra = {"gemma3": dict(attention_bias=False, qk_norm=True, tie_word_embeddings=True,
                            query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                            sliding_windows=(8, None), rope_local_theta=10000.0)}
    return engine_tiny_arch(name, **{**extra.get(name, {}), **kw})


def hf_weights(arch: ModelArchConfig, seed: int = 0):
    """Random checkpoint tensors under HF names for ``arch`` (the same for every rank)."""
    full = new_model(arch, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    out = {}
    norm_base = 0.0 if arch.arch == "gemma3" else 1.0
    for i, layer in enumerate(full.layers):
        for hf, (attr, part) in type(full).layer_map.items():
            param = getattr(layer, attr, None)
            if param is None:
                continue
            rows = param[full._part_slice(f"layers.{i}.{attr}", part, param.shape[0])]
            value = (torch.full(rows.shape, norm_base) + 0.05 * torch.randn(rows.shape, generator=g)
                     if "norm" in attr else 0.15 * torch.randn(rows.shape, generator=g))
            out[f"model.layers.{i}.{hf}"] = value
    out["model.embed_tokens.weight"] = torch.randn(arch.vocab_size, arch.hidden_size, generator=g)
    out["model.norm.weight"] = torch.full((arch.hidden_size,), norm_base)
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = 0.15 * torch.randn(arch.vocab_size, arch.hidden_size, generator=g)
    return out


def scenario(eng) -> list[torch.Tensor]:
    """Prefill in chunks, an extend over a cached prefix, decode: every sampled row's logits."""
    seen = []
    orig = eng.runner.sample_tokens        # every path samples here (sync, graphs, overlap)
    eng.runner.sample_tokens = lambda picked, logits: (seen.append(logits.float().cpu()),
                                                       orig(picked, logits))[1]
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eng.add_request(GenerateRequest("a", PROMPT[:40], sp))
    while eng.has_unfinished():
        eng.step()
    eng.add_request(GenerateRequest("b", PROMPT[:40] + PROMPT[50:62], sp))   # extend
    eng.add_request(GenerateRequest("c", PROMPT[5:25], sp))
    while eng.has_unfinished():
        eng.step()
    return seen


def dense_logits(model) -> list[torch.Tensor]:
    """The model alone, no paged cache: causal fp32 attention over PROMPT[:40], the logits of
    every position (checks the sharding math exactly)."""
    scale = model.arch.sm_scale

    def attn(layer_id, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            scale=scale, enable_gqa=True)
        return o.transpose(0, 1)
    dev = next(model.parameters()).device
    ids = torch.tensor(PROMPT[:40], device=dev)
    with torch.inference_mode():
        return [model.compute_logits(model(ids, torch.arange(40, device=dev), attn))]


class TextTokenizer(CharTokenizer):
    """CharTokenizer plus ``encode``, for the K recipe's calibration text."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 90 + 1 for c in text]


def build(arch: ModelArchConfig, kv: str, tp=None, device: torch.device | None = None,
          overlap: bool = False):
    device = device or torch.device("cpu")
    model = new_model(arch, torch.float32, device, tp)
    model.load_weights(hf_weights(arch).items())
    model.finish_loading()
    if kv == "dense":
        return model
    cfg = engine_config(kv, num_pages=64, page_size=16, chunked_prefill_size=16)
    if device.type == "cuda":
        cfg = dataclasses.replace(cfg, device=dataclasses.replace(cfg.device, device="cuda",
                                                                  cuda_graph_max_bs=4))
    # each rank calibrates the K recipe on its own KV heads (in step: the forwards collect)
    return build_engine_core(model, TextTokenizer(), cfg, device=device,
                             inject=Injected(calibrate=kv != "bf16", use_l1_tiers=False,
                                             overlap=overlap))


def run_rank(rank: int, size: int, port: int, arch: ModelArchConfig, kv: str, queue,
             backend: str = "gloo", device: str = "cpu", overlap: bool = False) -> None:
    """One rank of the TP group (a spawned process); ``device``: ``"cpu"``, or ``"cuda:N"``."""
    import torch.distributed as dist
    try:
        torch.manual_seed(0)
        tp = join(rank, size, port, backend=backend, device=torch.device(device))
        eng = build(arch, kv, tp, tp.device, overlap)
        if kv == "dense":
            got = dense_logits(eng)
            if rank == 0:
                queue.put(("ok", [t.tolist() for t in got], 0))
        elif rank == 0:
            got = scenario(eng)
            stop_followers(tp)
            launches = eng.overlap.launches if eng.overlap is not None else 0
            queue.put(("ok", [t.tolist() for t in got], launches))
        else:
            follow(eng.runner, tp, eng.runner.tier_mirror)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent test
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def tp_logits(arch: ModelArchConfig, kv: str, size: int, port: int, backend: str = "gloo",
              devices: list[str] | None = None, overlap: bool = False,
              stats: dict | None = None) -> list[torch.Tensor]:
    """Rank 0's sampled logits (on the CPU) of the scenario at TP ``size``; ``devices``: each
    rank's device (default all ``"cpu"``); ``overlap``: overlap scheduling on rank 0 (its
    launched steps go into ``stats["launches"]``)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    devices = devices or ["cpu"] * size
    procs = [ctx.Process(target=run_rank, args=(r, size, port, arch, kv, queue, backend,
                                                devices[r], overlap))
             for r in range(size)]
    for p in procs:
        p.start()
    status, payload, *extra = queue.get(timeout=300)
    if stats is not None and extra:
        stats["launches"] = extra[0]
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise AssertionError(payload)
    return [torch.tensor(t) for t in payload]


def single_logits(arch: ModelArchConfig, kv: str, device: str = "cpu",
                  overlap: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(0)
    built = build(arch, kv, device=torch.device(device), overlap=overlap)
    got = dense_logits(built) if kv == "dense" else scenario(built)
    return [t.cpu() for t in got]


__all__ = ["arch_of", "tp_logits", "single_logits", "dataclasses"]
