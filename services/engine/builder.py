"""Builds the engine from the config tree: ``build_parts`` loads the model for the server,
``build_engine_core`` wires pool, backend, radix tree, tiers, graphs and runner around any
model (the server, the workers, the tests and the benchmarks all build through it)."""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nibble.kernels import KV_CACHE_FORMATS, PageLayout
from nibble.tiering import KVPool, pages_for_budget
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.secret import KVSecret
from nibble.tiering.tier_manager import TierManager
from nibble.tiering.tier_mirror import TierMirror

from .. import attention
from ..attention import ATTENTION_BACKENDS
from ..attention.calibration import calibrate_pool
from ..attention.calibration_cache import CalibrationCache, resolve_dir
from ..parallel.follower import mirror_tiers
from ..parallel.devices import local_rank_device
from ..parallel.group import SingleGroup, TPGroup
from ..config import CacheConfig, DeviceConfig, NibbleConfig
from ..errors import ConfigError
from .cuda_graph import DecodeGraphRunner
from .engine import EngineCore
from .grammar import (GrammarBackend, GrammarError, create_grammar_backend,
                      grammar_backend_names, share_backend)
from .model_runner import ModelRunner
from .step_budget import resolve_scheduler
from .tier_setup import build_tier_mirror, build_tiers, host_pages_for, load_secret

log = logging.getLogger(__name__)

# Defaults for --mem-fraction-static: the share of device memory for weights + KV.
DEFAULT_MEM_FRACTION = {"cuda": 0.85, "cpu": 0.10}
# Kept free for activations beyond weights and KV.
ACTIVATION_RESERVE_BYTES = {"cuda": 2 << 30, "cpu": 256 << 20}


@dataclass(frozen=True)
class Injected:
    """What a test or benchmark hands ``build_engine_core`` that no flag describes."""

    storage: Any = None              # an L3 backend instance, instead of the flags' one
    secret: KVSecret | None = None   # the KV secret, instead of --kv-secret-file's
    tier_kw: dict = field(default_factory=dict)   # TierPolicy fields (l3_latency_s), clock
    sliding_windows: tuple | None = None   # the backend's windows (default: the model's)
    calibrate: bool = True           # calibrate the format's K recipe on the model
    static_decode_path: bool = False  # CPU: the decode graphs' static buffers, run eagerly
    use_l1_tiers: bool = True        # False: no tier manager when L2/L3 are off
    overlap: bool | None = None      # overlap scheduling (default: on CUDA unless disabled)


@dataclass
class EngineParts:
    core: EngineCore
    tokenizer: object
    model_name: str
    fingerprint: str
    backend_name: str
    bytes_per_token_by_format: dict[str, float]
    follower_pids: tuple[int, ...] = ()          # tensor parallel: ranks 1.. (for operators)


def resolve_device(cfg: DeviceConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was given but no CUDA device is available")
    return torch.device(cfg.device)


def served_name(served: str | None, model_path: str | None, checkpoint_name: str) -> str:
    """The model name of ``/v1/models`` and of requests: ``--served-model-name``, else the
    packaged model's name as typed (``--model-path gemma3-270m``, as SGLang and vLLM serve
    under the ``--model`` value), else the checkpoint's own name. A filesystem path is never
    the name: requests would then probe the server's directories."""
    from ..models.packaged import NAMED_MODELS
    if served:
        return served
    if model_path in NAMED_MODELS and not os.path.exists(os.path.expanduser(model_path)):
        return model_path
    return checkpoint_name


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_weights(cfg: NibbleConfig, device: torch.device) -> tuple[str, torch.dtype]:
    """``(quantization, dtype)`` of the weights (``models/weight_quant.resolve_quantization``)."""
    from ..models.loader import resolve_model_path
    from ..models.weight_quant import cpu_has_native_bf16, resolve_quantization
    m = cfg.model
    gguf = None
    if m.load_format == "auto" and m.quantization != "none":
        path = resolve_model_path(m.model_path)
        gguf = path if os.path.isfile(path) and path.lower().endswith(".gguf") else None
    try:
        quantization, dtype = resolve_quantization(m.quantization, m.dtype, device,
                                                   cfg.device.tp_size, gguf)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    resolved = resolve_dtype(dtype, device)
    if device.type == "cpu" and resolved == torch.bfloat16 and not cpu_has_native_bf16():
        log.warning("--dtype bfloat16 on a CPU without hardware bf16 (AVX512-BF16 or AMX): "
                    "torch's bf16 matrix products run about 50x slower than float32 there "
                    "(0.7 against 34 GFLOP/s on an AVX2 EPYC); --dtype float32, the CPU "
                    "default, is faster")
    return quantization, resolved


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_num_pages(cfg: CacheConfig, layout: PageLayout, device: torch.device,
                   weight_bytes: int) -> int:
    """Pool size in pages from --max-total-tokens, else from --mem-fraction-static."""
    if cfg.max_total_tokens is not None:
        return -(-cfg.max_total_tokens // layout.page_size)
    frac = cfg.mem_fraction_static or DEFAULT_MEM_FRACTION[device.type]
    budget = device_memory_bytes(device) * frac - weight_bytes - ACTIVATION_RESERVE_BYTES[device.type]
    pages = pages_for_budget(layout, int(budget))
    if pages < 1:
        raise ConfigError(f"--mem-fraction-static {frac} leaves no room for the KV pool "
                          f"(weights take {weight_bytes / 2**30:.2f} GiB)")
    return pages


def select_attention_backend(requested: str, layout: PageLayout, device: torch.device,
                             sliding_window: bool = False) -> str:
    """The backend name for --attention-backend ``requested`` (auto|torch|torch_fast|triton).

    ``auto`` picks ``triton`` on CUDA when Triton imports and its kernels fit the
    layout, ``torch_fast`` (the reference with a batched decode) on CPU, else
    ``torch``. A forced ``triton`` that cannot run is a ConfigError (on CPU it runs
    only under Triton's interpreter, TRITON_INTERPRET=1).
    ``sliding_window``: the model has sliding-window layers (Gemma 3); only
    backends with ``supports_sliding_window`` qualify (auto falls back to torch).
    """
    triton_cls = attention.TritonAttentionBackend
    if requested == "auto":
        if (device.type == "cuda" and triton_cls is not None
                and (triton_cls.supports_sliding_window or not sliding_window)
                and triton_cls.unsupported_reason(layout, device) is None):
            return "triton"
        return "torch_fast" if device.type == "cpu" else "torch"
    if requested == "triton":
        if triton_cls is None:
            raise ConfigError(f"--attention-backend triton: Triton is not usable here "
                              f"({attention.TRITON_IMPORT_ERROR})")
        reason = triton_cls.unsupported_reason(layout, device)
        if reason is not None:
            raise ConfigError(f"--attention-backend triton: {reason}")
    if requested not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention backend {requested!r} is not available; "
                          f"known: {sorted(ATTENTION_BACKENDS)}")
    if sliding_window and not ATTENTION_BACKENDS[requested].supports_sliding_window:
        raise ConfigError(f"--attention-backend {requested}: the model has sliding-window "
                          f"attention layers, which this backend does not implement; use "
                          f"--attention-backend torch (or auto)")
    return requested


def build_graph_runner(cfg: DeviceConfig, model, backend, device: torch.device,
                       context: int, page_size: int, static_path: bool = False
                       ) -> DecodeGraphRunner | None:
    """Captured decode graphs on CUDA with a backend that supports them, else None (eager).
    ``static_path``: off CUDA, the graphs' static buffers run eagerly (tests of that path)."""
    use_graphs = device.type == "cuda" and not cfg.disable_cuda_graph
    if not use_graphs and not static_path:
        return None
    if not backend.supports_cuda_graph:
        log.info("CUDA graphs off: the %s attention backend cannot be captured", backend.name)
        return None
    graphs = DecodeGraphRunner(model, backend, device, cfg.cuda_graph_max_bs, context, page_size,
                               use_graphs)
    graphs.capture()
    return graphs


def build_engine_core(model, tokenizer, cfg: NibbleConfig, *, device: torch.device | None = None,
                      fingerprint: str = "local", inject: Injected = Injected()) -> EngineCore:
    """The engine around a loaded ``model`` (its ``arch``; on ``device``, default CPU).

    The pool's format, page size and size come from ``cfg.cache`` (``max_total_tokens``,
    else ``--mem-fraction-static`` of the device less the weights); the attention backend,
    decode graphs and kernels from ``cfg.device``; the tiers from ``cfg.hicache``; the
    scheduler from ``cfg.scheduler``; the context from ``cfg.model.context_length``.
    ``fingerprint`` names the weights in the tiers' content keys.
    """
    device = device or torch.device("cpu")
    arch = model.arch
    kv_format = "bf16" if cfg.cache.kv_cache_dtype == "auto" else cfg.cache.kv_cache_dtype
    layout = PageLayout(kv_format, arch.num_layers, arch.num_kv_heads, arch.head_dim,
                        cfg.cache.page_size)
    windows = arch.sliding_windows if inject.sliding_windows is None else inject.sliding_windows
    backend_name = select_attention_backend(cfg.device.attention_backend, layout, device,
                                            any(w for w in windows or ()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tp = model.tp if isinstance(getattr(model, "tp", None), TPGroup) else SingleGroup()
    # tensor parallel: every rank holds the same page ids (its own KV heads in them)
    num_pages = tp.all_min(plan_num_pages(cfg.cache, layout, device, weight_bytes))
    pool = KVPool(layout, num_pages, device)
    context = min(cfg.model.context_length or arch.max_position_embeddings,
                  arch.max_position_embeddings)
    if inject.calibrate:      # the format's K recipe, if any, over the context to serve
        root = resolve_dir(cfg.cache.calibration_cache_dir)
        calibrate_pool(model, tokenizer, pool, arch, context,
                       CalibrationCache(root) if root is not None else None,
                       fingerprint if fingerprint != "local" else None, tp)
    # Fused layer kernels (Triton on CUDA, C on the CPU): after calibration (which runs the
    # torch ops), before the decode graphs are captured.
    model.set_fused_kernels(device.type == "cuda" and not cfg.device.disable_fused_kernels)
    model.set_cpu_layer_ops(device.type == "cpu" and not cfg.device.disable_fused_kernels)
    backend = ATTENTION_BACKENDS[backend_name](pool, arch.sm_scale, cfg.cache.prefill_kv_dtype,
                                               device_cfg=cfg.device)
    backend.set_sliding_windows(windows)
    _warm_prefill(backend, cfg, arch, model, context)
    cache = None if cfg.cache.disable_radix_cache else RadixCache(layout.page_size, pool)
    tiers, mirror = _tiers(cfg, inject, pool, cache, fingerprint, tp)
    # CUDA graphs capture NCCL's collectives (every rank captures the same buckets in the
    # same order here, and replays when rank 0 does); gloo's go through the host: eager.
    # Overlap scheduling: rank 0 broadcasts each launched step's sampled ids to the
    # followers (parallel/follower.py), so it runs at any TP size.
    eager_tp = tp.size > 1 and tp.backend != "nccl"
    graphs = None if eager_tp else build_graph_runner(
        cfg.device, model, backend, device, context, layout.page_size, inject.static_decode_path)
    overlap = inject.overlap if inject.overlap is not None else (
        device.type == "cuda" and not cfg.scheduler.disable_overlap_schedule)
    runner = ModelRunner(model, backend, device, graphs)
    runner.tier_mirror = mirror
    if tiers is not None and tp.size > 1 and cfg.hicache.enable_hierarchical_cache:
        tiers.mirror = functools.partial(mirror_tiers, tp)
        runner.tier_sync = tiers.sync
    runner.grammar = build_grammar(cfg.sampling.grammar_backend, tokenizer, arch.vocab_size)
    core = EngineCore(runner, pool, tokenizer, resolve_scheduler(cfg.scheduler, arch),
                      context, cache, tiers,
                      overlap=overlap)
    if tp.size > 1:           # what the whole group holds (each rank: its own KV heads)
        page_bytes = sum(tp.gather_ints(layout.page_nbytes))
        core.tp_info = {"size": tp.size, "kv_heads_per_rank": tp.gather_ints(arch.num_kv_heads),
                        "group_bytes_per_token": page_bytes / layout.page_size,
                        "group_pool_bytes": page_bytes * num_pages}
    return core


def _warm_prefill(backend, cfg: NibbleConfig, arch, model, context: int) -> None:
    """Prepare the backend's prefill kernels for the step's largest chunk (the fused QKV
    kernel's prompt variants, cuDNN's plans)."""
    start = time.perf_counter()
    chunk = min(cfg.scheduler.chunked_prefill_size, cfg.scheduler.max_prefill_tokens)
    shapes = backend.warm_prefill(arch.num_heads, next(model.parameters()).dtype, chunk, context,
                                  qk_norm=arch.qk_norm)
    if shapes:
        log.info("prefill attention: cuDNN plans for %d shapes in %.1fs", shapes,
                 time.perf_counter() - start)


def _tiers(cfg: NibbleConfig, inject: Injected, pool: KVPool, cache, fingerprint: str,
           tp: TPGroup) -> tuple[TierManager | None, TierMirror | None]:
    """Rank 0's tier manager, or (tensor parallel, ranks 1..) the mirror that replays it."""
    hier = cfg.hicache.enable_hierarchical_cache
    if cache is None or not (inject.use_l1_tiers or hier):
        return None, None
    storage_on = hier and (inject.storage is not None or
                           cfg.hicache.hicache_storage_backend != "none")
    secret = inject.secret or load_secret(cfg.cache, storage_on and tp.rank == 0)
    # every rank the same L2 slots: rank 0's moves name them
    host_pages = tp.all_min(host_pages_for(cfg.hicache, pool)) if hier else None
    if tp.rank > 0:
        return None, (build_tier_mirror(cfg.hicache, pool, secret, host_pages,
                                        (tp.size, tp.rank)) if hier else None)
    return build_tiers(cfg.hicache, pool, cache, fingerprint, secret, inject.storage,
                       tp=(tp.size, tp.rank), host_pages=host_pages, **inject.tier_kw), None


def build_grammar(name: str, tokenizer, vocab_size: int) -> GrammarBackend | None:
    """The --grammar-backend for ``tokenizer`` over ``vocab_size`` logits, shared with the
    frontend (which compiles a request's grammar while preparing it); None for ``none`` or
    a tokenizer without a vocabulary (the test tokenizers)."""
    grammar_backend_names()          # registers the importable backends
    try:
        backend = create_grammar_backend(name, tokenizer, vocab_size)
    except GrammarError as exc:
        log.info("structured outputs off: %s", exc)
        backend = None
    share_backend(tokenizer, backend)
    return backend


def build_parts(cfg: NibbleConfig, start_group=None) -> EngineParts:
    """The server's engine: the model of ``cfg.model`` loaded, then ``build_engine_core``.

    ``start_group(cfg) -> (TPGroup, [follower pid])`` forms the tensor-parallel group when
    ``--tp-size`` > 1 (default: local processes, ``parallel/launch.py``; a disaggregated
    worker in a Ray placement group passes ``parallel/ray_group.py``'s)."""
    from ..models.loader import load_model  # heavy import, deferred

    device = resolve_device(cfg.device)
    quantization, dtype = resolve_weights(cfg, device)
    tp, pids = None, ()
    if cfg.device.tp_size > 1:
        if start_group is None:        # the followers are daemons: they end with this process
            from ..parallel.launch import start_group
        tp, started = start_group(cfg)
        pids = tuple(getattr(p, "pid", p) for p in started)
        device = tp.device             # this rank's GPU (parallel/devices.py)
    elif device.type == "cuda" and cfg.device.base_gpu_id:
        device = local_rank_device("cuda", 0, 1, cfg.device.base_gpu_id, "nccl")
        torch.cuda.set_device(device)
    loaded = load_model(cfg.model.model_path, dtype, device, cfg.model.load_format, tp=tp,
                        quantization=quantization)
    core = build_engine_core(loaded.model, loaded.tokenizer, cfg, device=device,
                             fingerprint=loaded.fingerprint)
    backend_name = core.runner.backend.name
    log.info("attention backend: %s", backend_name)
    arch, layout = loaded.arch, core.pool.layout
    geometry = dict(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads,
                    head_dim=arch.head_dim, page_size=layout.page_size)
    per_format = {name: PageLayout(name, **geometry).bytes_per_token for name in KV_CACHE_FORMATS}
    cap = core.pool.capacity()
    log.info("KV pool: %s, %d pages x %d tokens = %d tokens, %.0f bytes/token, %.1f MiB",
             cap.kv_format, cap.num_pages, cap.page_size, cap.max_tokens, cap.bytes_per_token,
             cap.pool_bytes / 2**20)
    log.info("bytes/token by format: %s; for the same bytes nvfp4 holds %.2fx the tokens of fp8",
             {k: round(v, 1) for k, v in per_format.items()},
             per_format["fp8_e4m3"] / per_format["nvfp4"])
    name = served_name(cfg.model.served_model_name, cfg.model.model_path, loaded.name)
    return EngineParts(core, loaded.tokenizer, name, loaded.fingerprint, backend_name, per_format,
                       pids)
