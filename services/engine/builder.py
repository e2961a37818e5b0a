"""Builds the engine's parts from the config tree: model, pool, backend, runner."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from nibble.kernels import KV_CACHE_FORMATS, PageLayout
from nibble.tiering import KVPool, pages_for_budget
from nibble.tiering.host_pool import HostPool
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.secret import KVSecret
from nibble.tiering.storage import create_storage_backend
from nibble.tiering.tier_manager import TierManager, TierPolicy

from .. import attention
from ..attention import ATTENTION_BACKENDS
from ..attention.calibration import calibrate_pool
from ..config import CacheConfig, DeviceConfig, HiCacheConfig, NibbleConfig
from ..credentials import (KV_SECRET_ENV, STORAGE_PASSWORD_ENV, load_kv_secret,
                           load_storage_password)
from ..errors import ConfigError
from .engine import EngineCore
from .cuda_graph import DecodeGraphRunner
from .model_runner import ModelRunner

log = logging.getLogger(__name__)

# Defaults for --mem-fraction-static: the share of device memory for weights + KV.
DEFAULT_MEM_FRACTION = {"cuda": 0.85, "cpu": 0.10}
# Kept free for activations beyond weights and KV.
ACTIVATION_RESERVE_BYTES = {"cuda": 2 << 30, "cpu": 256 << 20}
# The file backend's budget without --hicache-storage-size: this, or half of what the
# directory could use (free space + what it holds), whichever is less.
DEFAULT_STORAGE_BYTES = 16 * 10**9


@dataclass
class EngineParts:
    core: EngineCore
    tokenizer: object
    model_name: str
    fingerprint: str
    backend_name: str
    bytes_per_token_by_format: dict[str, float]


def resolve_device(cfg: DeviceConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was given but no CUDA device is available")
    return torch.device(cfg.device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


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


def default_storage_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nibble", "kv")


def _bytes_under(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def storage_budget(cfg: HiCacheConfig, path: str) -> int:
    """Bytes the file backend's directory may hold: ``--hicache-storage-size`` GB, else
    ``DEFAULT_STORAGE_BYTES`` or half of (free disk + what the directory already holds),
    whichever is less."""
    if cfg.hicache_storage_size is not None:
        return max(1, int(cfg.hicache_storage_size * 1e9))
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    held = _bytes_under(Path(path)) if Path(path).is_dir() else 0
    return max(1, min(DEFAULT_STORAGE_BYTES, (shutil.disk_usage(probe).free + held) // 2))


def load_secret(cfg: CacheConfig, for_storage: bool) -> KVSecret:
    """The deployment's KV secret (``--kv-secret-file`` / ``$NIBBLE_KV_SECRET``), else a random
    one for this process; ``for_storage``: L3 is on, so say what a random one costs."""
    secret = load_kv_secret(cfg.kv_secret_file)
    if secret is not None:
        return secret
    if for_storage:
        log.warning("no --kv-secret-file or $%s: using a random KV secret for this process. "
                    "L3 page records it writes will not verify after a restart or on another "
                    "replica (they are recomputed); give every replica the same secret to "
                    "keep and share L3", KV_SECRET_ENV)
    return KVSecret.generate()


def build_storage(cfg: HiCacheConfig):
    """The L3 backend of --hicache-storage-backend, or None."""
    if cfg.hicache_storage_backend == "redis":
        url = cfg.hicache_storage_url or "redis://127.0.0.1:6379/0"
        try:
            in_url = urlsplit(url).password
        except ValueError:
            in_url = None
        if in_url:
            log.warning("the Redis password in --hicache-storage-url is visible to every local "
                        "user (ps, /proc); use --hicache-storage-password-file or $%s",
                        STORAGE_PASSWORD_ENV)
        password = load_storage_password(cfg.hicache_storage_password_file)
        return create_storage_backend("redis", url, prefix=cfg.hicache_storage_prefix,
                                      ttl_s=cfg.hicache_storage_ttl,
                                      **({"password": password} if password else {}))
    if cfg.hicache_storage_backend == "file":
        path = cfg.hicache_storage_url or default_storage_dir()
        budget = storage_budget(cfg, path)
        log.info("L3 file storage: %s, budget %.2f GB", path, budget / 1e9)
        return create_storage_backend("file", path, max_bytes=budget)
    return None


def build_tiers(cfg: HiCacheConfig, pool: KVPool, cache: RadixCache, fingerprint: str,
                secret: KVSecret) -> TierManager | None:
    """L2 host pool and L3 storage below ``pool``, per --enable-hierarchical-cache.

    Without it the tier manager still runs L1-only: it keys cached pages and
    publishes KV events, so a router can mirror the cache. ``secret`` keys the
    content keys and authenticates L3 records.
    """
    if not cfg.enable_hierarchical_cache:
        return TierManager(pool, cache, fingerprint, None, None, secret=secret)
    layout = pool.layout
    if cfg.hicache_size is not None:
        host_pages = int(cfg.hicache_size * 1e9) // layout.page_nbytes
    else:
        host_pages = int(pool.num_pages * cfg.hicache_ratio)
    host = HostPool(layout, max(1, host_pages), pin_memory=pool.device.type == "cuda")
    storage = build_storage(cfg)
    policy = TierPolicy(cfg.hicache_write_policy, cfg.hicache_prefetch_policy,
                        cfg.hicache_prefetch_timeout)
    log.info("hierarchical cache: L2 %d pages (%.1f MiB host%s), L3 %s, %s, prefetch %s",
             host.num_pages, host.nbytes / 2**20, ", pinned" if pool.device.type == "cuda" else "",
             cfg.hicache_storage_backend, cfg.hicache_write_policy, cfg.hicache_prefetch_policy)
    return TierManager(pool, cache, fingerprint, host, storage, policy, secret=secret)


def select_attention_backend(requested: str, layout: PageLayout, device: torch.device,
                             sliding_window: bool = False) -> str:
    """The backend name for --attention-backend ``requested`` (auto|torch|triton).

    ``auto`` picks ``triton`` on CUDA when Triton imports and its kernels fit the
    layout, else ``torch``. A forced ``triton`` that cannot run is a ConfigError
    (on CPU it runs only under Triton's interpreter, TRITON_INTERPRET=1).
    ``sliding_window``: the model has sliding-window layers (Gemma 3); only
    backends with ``supports_sliding_window`` qualify (auto falls back to torch).
    """
    triton_cls = attention.TritonAttentionBackend
    if requested == "auto":
        if (device.type == "cuda" and triton_cls is not None
                and (triton_cls.supports_sliding_window or not sliding_window)
                and triton_cls.unsupported_reason(layout, device) is None):
            return "triton"
        return "torch"
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
                       context: int, page_size: int) -> DecodeGraphRunner | None:
    """Captured decode graphs on CUDA with a backend that supports them, else None (eager)."""
    if device.type != "cuda" or cfg.disable_cuda_graph:
        return None
    if not backend.supports_cuda_graph:
        log.info("CUDA graphs off: the %s attention backend cannot be captured", backend.name)
        return None
    graphs = DecodeGraphRunner(model, backend, device, cfg.cuda_graph_max_bs, context, page_size)
    graphs.capture()
    return graphs


def build_parts(cfg: NibbleConfig) -> EngineParts:
    from ..models.loader import load_model  # heavy import, deferred

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    loaded = load_model(cfg.model.model_path, dtype, device, cfg.model.load_format)
    arch = loaded.arch
    kv_format = "bf16" if cfg.cache.kv_cache_dtype == "auto" else cfg.cache.kv_cache_dtype
    geometry = dict(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads,
                    head_dim=arch.head_dim, page_size=cfg.cache.page_size)
    layout = PageLayout(kv_format, **geometry)
    backend_name = select_attention_backend(cfg.device.attention_backend, layout, device,
                                            arch.has_sliding_window)
    log.info("attention backend: %s", backend_name)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    pool = KVPool(layout, plan_num_pages(cfg.cache, layout, device, weight_bytes), device)
    # The format's K recipe, if any: calibrated over the context the engine will serve.
    calibrate_pool(loaded.model, loaded.tokenizer, pool, arch, cfg.model.context_length)
    # Fused Triton layer kernels on CUDA (after calibration, which stays on the torch ops).
    loaded.model.set_fused_kernels(device.type == "cuda" and not cfg.device.disable_fused_kernels)
    per_format = {name: PageLayout(name, **geometry).bytes_per_token for name in KV_CACHE_FORMATS}
    backend = ATTENTION_BACKENDS[backend_name](pool, arch.sm_scale, cfg.cache.prefill_kv_dtype,
                                               device_cfg=cfg.device)
    backend.set_sliding_windows(arch.sliding_windows)
    context = min(cfg.model.context_length or arch.max_position_embeddings,
                  arch.max_position_embeddings)
    cache = None if cfg.cache.disable_radix_cache else RadixCache(layout.page_size, pool)
    storage_on = cfg.hicache.enable_hierarchical_cache and \
        cfg.hicache.hicache_storage_backend != "none"
    tiers = None if cache is None else build_tiers(
        cfg.hicache, pool, cache, loaded.fingerprint, load_secret(cfg.cache, storage_on))
    graphs = build_graph_runner(cfg.device, loaded.model, backend, device, context,
                                layout.page_size)
    core = EngineCore(ModelRunner(loaded.model, backend, device, graphs), pool, loaded.tokenizer,
                      cfg.scheduler, context, cache, tiers)
    cap = pool.capacity()
    log.info("KV pool: %s, %d pages x %d tokens = %d tokens, %.0f bytes/token, %.1f MiB",
             cap.kv_format, cap.num_pages, cap.page_size, cap.max_tokens, cap.bytes_per_token,
             cap.pool_bytes / 2**20)
    log.info("bytes/token by format: %s; for the same bytes nvfp4 holds %.2fx the tokens of fp8",
             {k: round(v, 1) for k, v in per_format.items()},
             per_format["fp8_e4m3"] / per_format["nvfp4"])
    name = cfg.model.served_model_name or loaded.name
    return EngineParts(core, loaded.tokenizer, name, loaded.fingerprint, backend_name, per_format)
