"""The one configuration tree: frozen dataclasses built once from CLI flags.

Flag names follow SGLang/vLLM. Each component receives only its own slice
(``cfg.cache``, ``cfg.scheduler`` ...); nothing reads a global.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from nibble.kernels import KV_CACHE_FORMATS

from .errors import ConfigError

DEFAULT_PORT = 30000
DEFAULT_GRPC_PORT = 30001          # what a bare --grpc-port means


@dataclass(frozen=True)
class ModelConfig:
    model_path: str | None = None          # HF safetensors dir or .gguf file; None = embedded SmolLM2
    served_model_name: str | None = None   # name in /v1/models; default derived from the path
    dtype: str = "auto"                    # compute dtype: auto|float32|bfloat16|float16
    context_length: int | None = None      # cap on prompt + output tokens; None = model's
    load_format: str = "auto"              # auto: read weights; dummy: random weights (benchmarks)


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_dtype: str = "nvfp4"          # a registered KV format; "auto" = model dtype -> bf16
    page_size: int = 16                    # tokens per page
    mem_fraction_static: float | None = None  # fraction of device memory for weights + KV pool
    max_total_tokens: int | None = None    # pool capacity in tokens; overrides mem fraction
    prefill_kv_dtype: str = "auto"         # fp8_e4m3: cast fresh K/V (and extend workspace) to FP8
    disable_radix_cache: bool = False      # turn prefix reuse off


@dataclass(frozen=True)
class HiCacheConfig:
    enable_hierarchical_cache: bool = False  # L2 host pool + L3 storage below the device pool
    hicache_ratio: float = 2.0             # L2 pages as a multiple of L1 pages
    hicache_size: float | None = None      # L2 size in GB (overrides the ratio)
    hicache_storage_backend: str = "file"  # file | redis | none
    hicache_storage_url: str | None = None  # redis://host:port/db, or a directory for file
    hicache_storage_prefix: str = "nibble:kv:"  # Redis key prefix
    hicache_storage_ttl: int | None = None  # Redis TTL in seconds
    hicache_write_policy: str = "write_through"  # write_through | write_through_selective | write_back
    hicache_prefetch_policy: str = "best_effort"  # best_effort | wait_complete | timeout
    hicache_prefetch_timeout: float = 2.0  # seconds a request waits under "timeout"


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64         # decode batch cap
    chunked_prefill_size: int = 512        # max prefill tokens of one request per step
    max_prefill_tokens: int = 2048         # token budget of one step (prefill chunks + decodes)
    max_queued_requests: int | None = None  # admission gate: 503 + Retry-After beyond it
    schedule_policy: str = "fcfs"          # fcfs | lpm (longest prefix match first)
    schedule_conservativeness: float = 1.0  # share of running requests' future decode pages held back


@dataclass(frozen=True)
class DisaggConfig:
    disaggregate: bool = False             # prefill and decode on separate Ray actors
    prefill_workers: int = 1
    decode_workers: int = 1
    ray_address: str | None = None         # join a cluster; None starts a local one
    kv_transport: str = "grpc"             # nixl | grpc
    kv_transfer_failure_policy: str = "recompute"  # recompute | fail
    kv_transfer_timeout: float = 30.0      # seconds from reservation to installed pages
    kv_lease: float = 5.0                  # decode-side reservation lease, renewed by heartbeats


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"                   # auto|cpu|cuda
    attention_backend: str = "auto"        # auto|torch|triton
    disable_cuda_graph: bool = False       # CUDA only: run decode steps eagerly
    cuda_graph_max_bs: int = 64            # largest decode batch replayed from a captured graph


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    log_level: str = "info"
    # Keys never show in repr (logs); the gateway redacts them from /get_server_info.
    api_keys: tuple[str, ...] = field(default=(), repr=False)        # guard /v1/*
    admin_api_keys: tuple[str, ...] = field(default=(), repr=False)  # guard the admin routes
    grpc_port: int | None = None       # the gRPC API (services/grpc_api) beside HTTP; None = off


@dataclass(frozen=True)
class NibbleConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Register the engine flags (shared by ``serve`` and the benchmarks)."""
    d = NibbleConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None, help="HF safetensors dir or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default=d.model.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--load-format", default=d.model.load_format, choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config.json (speed benchmarks; "
                        "without tokenizer files a numeric tokenizer is used)")
    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-cache-dtype", default=d.cache.kv_cache_dtype,
                   choices=["auto", *sorted(KV_CACHE_FORMATS)])
    g.add_argument("--page-size", type=int, default=d.cache.page_size)
    g.add_argument("--mem-fraction-static", type=float, default=None)
    g.add_argument("--max-total-tokens", type=int, default=None)
    g.add_argument("--prefill-kv-dtype", default=d.cache.prefill_kv_dtype, choices=["auto", "fp8_e4m3"])
    g.add_argument("--disable-radix-cache", action="store_true")
    h = HiCacheConfig()
    g = p.add_argument_group("hierarchical cache (L2 host memory, L3 storage)")
    g.add_argument("--enable-hierarchical-cache", action="store_true")
    g.add_argument("--hicache-ratio", type=float, default=h.hicache_ratio)
    g.add_argument("--hicache-size", type=float, default=None, help="L2 size in GB")
    g.add_argument("--hicache-storage-backend", default=h.hicache_storage_backend,
                   choices=["file", "redis", "none"])
    g.add_argument("--hicache-storage-url", default=None)
    g.add_argument("--hicache-storage-prefix", default=h.hicache_storage_prefix)
    g.add_argument("--hicache-storage-ttl", type=int, default=None)
    g.add_argument("--hicache-write-policy", default=h.hicache_write_policy,
                   choices=["write_through", "write_through_selective", "write_back"])
    g.add_argument("--hicache-prefetch-policy", default=h.hicache_prefetch_policy,
                   choices=["best_effort", "wait_complete", "timeout"])
    g.add_argument("--hicache-prefetch-timeout", type=float, default=h.hicache_prefetch_timeout)
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-running-requests", type=int, default=d.scheduler.max_running_requests)
    g.add_argument("--chunked-prefill-size", type=int, default=d.scheduler.chunked_prefill_size)
    g.add_argument("--max-prefill-tokens", type=int, default=d.scheduler.max_prefill_tokens)
    g.add_argument("--max-queued-requests", type=int, default=None)
    g.add_argument("--schedule-policy", default=d.scheduler.schedule_policy, choices=["fcfs", "lpm"])
    g.add_argument("--schedule-conservativeness", type=float,
                   default=d.scheduler.schedule_conservativeness)
    dd = DisaggConfig()
    g = p.add_argument_group("disaggregated serving (Ray)")
    g.add_argument("--disaggregate", action="store_true")
    g.add_argument("--prefill-workers", type=int, default=dd.prefill_workers)
    g.add_argument("--decode-workers", type=int, default=dd.decode_workers)
    g.add_argument("--ray-address", default=None)
    g.add_argument("--kv-transport", default=dd.kv_transport, choices=["nixl", "grpc"])
    g.add_argument("--kv-transfer-failure-policy", default=dd.kv_transfer_failure_policy,
                   choices=["recompute", "fail"])
    g.add_argument("--kv-transfer-timeout", type=float, default=dd.kv_transfer_timeout)
    g = p.add_argument_group("device")
    g.add_argument("--device", default=d.device.device, choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention-backend", default=d.device.attention_backend,
                   choices=["auto", "torch", "triton"])
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs")
    g.add_argument("--cuda-graph-max-bs", type=int, default=d.device.cuda_graph_max_bs,
                   help="largest decode batch captured in a CUDA graph (bigger ones run eagerly)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--log-level", default=d.log_level)
    g.add_argument("--api-key", dest="api_keys", action="append", default=None, metavar="KEY",
                   help="require this key (Authorization: Bearer KEY or x-api-key) on /v1 "
                        "routes; repeat for several keys (default: unauthenticated)")
    g.add_argument("--admin-api-key", dest="admin_api_keys", action="append", default=None,
                   metavar="KEY", help="require this key on /flush_cache, /abort_request and "
                   "/get_server_info; repeatable (default: the --api-key keys)")
    g.add_argument("--grpc-port", type=int, nargs="?", const=DEFAULT_GRPC_PORT, default=None,
                   help=f"also serve the gRPC API (nibble.v1.Nibble, health, reflection) on "
                        f"this port of --host; bare flag: {DEFAULT_GRPC_PORT} (default: off)")


def config_from_args(ns: argparse.Namespace) -> NibbleConfig:
    """Build and validate the config tree from parsed flags (server flags optional)."""
    get = lambda name, default=None: getattr(ns, name, default)  # noqa: E731
    cfg = NibbleConfig(
        model=ModelConfig(ns.model_path, ns.served_model_name, ns.dtype, ns.context_length,
                          get("load_format", "auto")),
        cache=CacheConfig(ns.kv_cache_dtype, ns.page_size, ns.mem_fraction_static,
                          ns.max_total_tokens, ns.prefill_kv_dtype, ns.disable_radix_cache),
        hicache=HiCacheConfig(
            ns.enable_hierarchical_cache, ns.hicache_ratio, ns.hicache_size,
            ns.hicache_storage_backend, ns.hicache_storage_url, ns.hicache_storage_prefix,
            ns.hicache_storage_ttl, ns.hicache_write_policy, ns.hicache_prefetch_policy,
            ns.hicache_prefetch_timeout),
        scheduler=SchedulerConfig(ns.max_running_requests, ns.chunked_prefill_size,
                                  ns.max_prefill_tokens, ns.max_queued_requests,
                                  ns.schedule_policy, ns.schedule_conservativeness),
        disagg=DisaggConfig(get("disaggregate", False), get("prefill_workers", 1),
                            get("decode_workers", 1), get("ray_address"),
                            get("kv_transport", "grpc"),
                            get("kv_transfer_failure_policy", "recompute"),
                            get("kv_transfer_timeout", 30.0)),
        device=DeviceConfig(ns.device, ns.attention_backend, get("disable_cuda_graph", False),
                            get("cuda_graph_max_bs", 64)),
        server=ServerConfig(get("host", "127.0.0.1"), get("port", DEFAULT_PORT),
                            get("log_level", "info"), tuple(get("api_keys") or ()),
                            tuple(get("admin_api_keys") or ()), get("grpc_port")),
    )
    validate(cfg)
    return cfg


def validate(cfg: NibbleConfig) -> None:
    """Reject inconsistent settings with a message naming the flag."""
    c, s = cfg.cache, cfg.scheduler
    if c.page_size <= 0 or c.page_size & (c.page_size - 1):
        raise ConfigError(f"--page-size must be a power of two, got {c.page_size}")
    if c.mem_fraction_static is not None and not 0 < c.mem_fraction_static < 1:
        raise ConfigError(f"--mem-fraction-static must be in (0, 1), got {c.mem_fraction_static}")
    if c.max_total_tokens is not None and c.max_total_tokens < c.page_size:
        raise ConfigError(f"--max-total-tokens must be >= --page-size ({c.page_size})")
    if s.max_running_requests <= 0 or s.chunked_prefill_size <= 0 or s.max_prefill_tokens <= 0:
        raise ConfigError("--max-running-requests, --chunked-prefill-size and "
                          "--max-prefill-tokens must be > 0")
    if s.max_queued_requests is not None and s.max_queued_requests < 0:
        raise ConfigError("--max-queued-requests must be >= 0")
    if s.schedule_conservativeness < 0:
        raise ConfigError("--schedule-conservativeness must be >= 0")
    d = cfg.disagg
    if d.disaggregate and (d.prefill_workers < 1 or d.decode_workers < 1):
        raise ConfigError("--prefill-workers and --decode-workers must be >= 1")
    if d.disaggregate and c.disable_radix_cache:
        raise ConfigError("--disaggregate needs the radix cache (drop --disable-radix-cache)")
    h = cfg.hicache
    if h.enable_hierarchical_cache and c.disable_radix_cache:
        raise ConfigError("--enable-hierarchical-cache needs the radix cache "
                          "(drop --disable-radix-cache)")
    if h.hicache_ratio <= 0 or (h.hicache_size is not None and h.hicache_size <= 0):
        raise ConfigError("--hicache-ratio and --hicache-size must be > 0")
    if cfg.model.context_length is not None and cfg.model.context_length <= 0:
        raise ConfigError("--context-length must be > 0")
    if cfg.device.cuda_graph_max_bs < 1:
        raise ConfigError("--cuda-graph-max-bs must be >= 1")
    if cfg.model.load_format == "dummy" and cfg.model.model_path is None:
        raise ConfigError("--load-format dummy needs --model-path (a directory with config.json)")
    g = cfg.server.grpc_port
    if g is not None and (not 0 < g < 65536 or g == cfg.server.port):
        raise ConfigError(f"--grpc-port must be in 1..65535 and differ from --port, got {g}")
