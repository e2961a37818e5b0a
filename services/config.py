"""The one configuration tree: frozen dataclasses built once from CLI flags.

Flag names follow SGLang/vLLM. Each component receives only its own slice
(``cfg.cache``, ``cfg.scheduler`` ...); nothing reads a global.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from nibble.kernels import KV_CACHE_FORMATS

from .credentials import ADMIN_API_KEY_ENV, API_KEY_ENV, collect_keys
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
    kv_secret_file: str | None = None      # the deployment's KV secret (else $NIBBLE_KV_SECRET)


@dataclass(frozen=True)
class HiCacheConfig:
    enable_hierarchical_cache: bool = False  # L2 host pool + L3 storage below the device pool
    hicache_ratio: float = 2.0             # L2 pages as a multiple of L1 pages
    hicache_size: float | None = None      # L2 size in GB (overrides the ratio)
    hicache_storage_backend: str = "file"  # file | redis | none
    hicache_storage_url: str | None = None  # redis://host:port/db, or a directory for file
    hicache_storage_prefix: str = "nibble:kv:"  # Redis key prefix
    hicache_storage_ttl: int | None = None  # Redis TTL in seconds
    hicache_storage_size: float | None = None  # file backend: directory budget in GB (None = auto)
    hicache_write_policy: str = "write_through"  # write_through | write_through_selective | write_back
    hicache_prefetch_policy: str = "best_effort"  # best_effort | wait_complete | timeout
    hicache_prefetch_timeout: float = 2.0  # seconds a request waits under "timeout"
    hicache_storage_password_file: str | None = None  # Redis password (else its env variable)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64         # decode batch cap
    chunked_prefill_size: int = 512        # max prefill tokens of one request per step
    max_prefill_tokens: int = 2048         # token budget of one step (prefill chunks + decodes)
    max_queued_requests: int | None = None  # admission gate: 503 + Retry-After beyond it
    schedule_policy: str = "fcfs"          # fcfs | lpm (longest prefix match first)
    schedule_conservativeness: float = 1.0  # share of running requests' future decode pages held back
    debug_checks: bool = False             # check the KV cache's bookkeeping whenever the engine idles


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
    kv_transfer_host: str | None = None    # interface the transfer servers bind (None: loopback on
                                           # a local cluster, the node's address on a joined one)
    kv_transfer_ssl_certfile: str | None = None  # TLS for the gRPC transfer channel
    kv_transfer_ssl_keyfile: str | None = None
    kv_transfer_ssl_ca_certs: str | None = None  # CA that signs every worker's certificate (mTLS)


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
    ssl_keyfile: str | None = None     # TLS for HTTP and gRPC (both or neither of key and cert)
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None    # when set, clients must present a certificate it signed
    allow_unauthenticated: bool = False  # bind a non-loopback host without any API key
    graceful_shutdown_timeout: float = 30.0  # SIGTERM: seconds running requests get to finish
    max_request_body_bytes: int = 16 << 20   # larger HTTP bodies / gRPC messages are refused


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
    g.add_argument("--kv-secret-file", default=None, metavar="PATH",
                   help="the deployment's KV secret (>= 16 bytes): authenticates L3 page "
                        "records, keys the content keys, signs transfer tickets; the same on "
                        "every replica and worker (default: $NIBBLE_KV_SECRET, else a random "
                        "secret per process)")
    h = HiCacheConfig()
    g = p.add_argument_group("hierarchical cache (L2 host memory, L3 storage)")
    g.add_argument("--enable-hierarchical-cache", action="store_true")
    g.add_argument("--hicache-ratio", type=float, default=h.hicache_ratio)
    g.add_argument("--hicache-size", type=float, default=None, help="L2 size in GB")
    g.add_argument("--hicache-storage-backend", default=h.hicache_storage_backend,
                   choices=["file", "redis", "none"])
    g.add_argument("--hicache-storage-url", default=None,
                   help="redis://host:port/db, or the file backend's directory; keep a "
                        "password out of it (see --hicache-storage-password-file)")
    g.add_argument("--hicache-storage-password-file", default=None, metavar="PATH",
                   help="the Redis password, first line of this file (default: "
                        "$NIBBLE_HICACHE_STORAGE_PASSWORD)")
    g.add_argument("--hicache-storage-prefix", default=h.hicache_storage_prefix)
    g.add_argument("--hicache-storage-ttl", type=int, default=None)
    g.add_argument("--hicache-storage-size", type=float, default=None, metavar="GB",
                   help="file backend: most bytes the directory may hold, LRU-evicted "
                        "(default: 16 GB or half the free disk, whichever is less)")
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
    g.add_argument("--debug-checks", action="store_true")
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
    g.add_argument("--kv-transfer-host", default=None,
                   help="interface the KV-transfer servers bind (default: 127.0.0.1 on a "
                        "local cluster, the node's Ray address on a joined one)")
    g.add_argument("--kv-transfer-ssl-certfile", default=None,
                   help="TLS certificate of this worker's KV-transfer server")
    g.add_argument("--kv-transfer-ssl-keyfile", default=None)
    g.add_argument("--kv-transfer-ssl-ca-certs", default=None,
                   help="CA that signs every worker's transfer certificate (mutual TLS)")
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
                        "routes; repeatable. Visible in ps: prefer --api-key-file or "
                        "$NIBBLE_API_KEY (default: unauthenticated)")
    g.add_argument("--api-key-file", dest="api_key_files", action="append", default=None,
                   metavar="PATH", help="API keys, one per line; repeatable")
    g.add_argument("--admin-api-key", dest="admin_api_keys", action="append", default=None,
                   metavar="KEY", help="require this key on the admin routes (/flush_cache, "
                   "/abort_request, /get_server_info, /kv_events); repeatable. Without one, "
                   "the admin routes answer on loopback only")
    g.add_argument("--admin-api-key-file", dest="admin_api_key_files", action="append",
                   default=None, metavar="PATH", help="admin keys, one per line; repeatable "
                   "(or $NIBBLE_ADMIN_API_KEY)")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="allow a non-loopback --host without any API key")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (HTTP and gRPC)")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (HTTP and gRPC)")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="CA bundle; when set, clients must present a certificate it signed")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=d.graceful_shutdown_timeout,
                   help="on SIGTERM: stop admitting (503), give running requests this many "
                        "seconds, then end the remaining streams with an error event")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="largest HTTP request body and gRPC message accepted")
    g.add_argument("--grpc-port", type=int, nargs="?", const=DEFAULT_GRPC_PORT, default=None,
                   help=f"also serve the gRPC API (nibble.v1.Nibble, health, reflection) on "
                        f"this port of --host; bare flag: {DEFAULT_GRPC_PORT} (default: off)")


def _server_config(ns: argparse.Namespace, env: Mapping[str, str]) -> ServerConfig:
    get = lambda name, default=None: getattr(ns, name, default)  # noqa: E731
    d = ServerConfig()
    return ServerConfig(
        host=get("host", d.host), port=get("port", d.port), log_level=get("log_level", d.log_level),
        api_keys=collect_keys(get("api_keys"), get("api_key_files"), env, API_KEY_ENV,
                              "--api-key"),
        admin_api_keys=collect_keys(get("admin_api_keys"), get("admin_api_key_files"), env,
                                    ADMIN_API_KEY_ENV, "--admin-api-key"),
        grpc_port=get("grpc_port"), ssl_keyfile=get("ssl_keyfile"),
        ssl_certfile=get("ssl_certfile"), ssl_ca_certs=get("ssl_ca_certs"),
        allow_unauthenticated=bool(get("allow_unauthenticated", False)),
        graceful_shutdown_timeout=get("graceful_shutdown_timeout", d.graceful_shutdown_timeout),
        max_request_body_bytes=get("max_request_body_bytes", d.max_request_body_bytes))


def config_from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None
                     ) -> NibbleConfig:
    """Build and validate the config tree from parsed flags (server flags optional).

    ``env`` (default ``os.environ``) supplies the keys of ``$NIBBLE_API_KEY`` and
    ``$NIBBLE_ADMIN_API_KEY``; key files are read here, once."""
    env = os.environ if env is None else env
    get = lambda name, default=None: getattr(ns, name, default)  # noqa: E731
    dd = DisaggConfig()
    cfg = NibbleConfig(
        model=ModelConfig(ns.model_path, ns.served_model_name, ns.dtype, ns.context_length,
                          get("load_format", "auto")),
        cache=CacheConfig(ns.kv_cache_dtype, ns.page_size, ns.mem_fraction_static,
                          ns.max_total_tokens, ns.prefill_kv_dtype, ns.disable_radix_cache,
                          kv_secret_file=get("kv_secret_file")),
        hicache=HiCacheConfig(
            ns.enable_hierarchical_cache, ns.hicache_ratio, ns.hicache_size,
            ns.hicache_storage_backend, ns.hicache_storage_url, ns.hicache_storage_prefix,
            ns.hicache_storage_ttl, get("hicache_storage_size"), ns.hicache_write_policy,
            ns.hicache_prefetch_policy, ns.hicache_prefetch_timeout,
            get("hicache_storage_password_file")),
        scheduler=SchedulerConfig(ns.max_running_requests, ns.chunked_prefill_size,
                                  ns.max_prefill_tokens, ns.max_queued_requests,
                                  ns.schedule_policy, ns.schedule_conservativeness,
                                  get("debug_checks", False)),
        disagg=DisaggConfig(
            disaggregate=get("disaggregate", False), prefill_workers=get("prefill_workers", 1),
            decode_workers=get("decode_workers", 1), ray_address=get("ray_address"),
            kv_transport=get("kv_transport", dd.kv_transport),
            kv_transfer_failure_policy=get("kv_transfer_failure_policy",
                                           dd.kv_transfer_failure_policy),
            kv_transfer_timeout=get("kv_transfer_timeout", dd.kv_transfer_timeout),
            kv_transfer_host=get("kv_transfer_host"),
            kv_transfer_ssl_certfile=get("kv_transfer_ssl_certfile"),
            kv_transfer_ssl_keyfile=get("kv_transfer_ssl_keyfile"),
            kv_transfer_ssl_ca_certs=get("kv_transfer_ssl_ca_certs")),
        device=DeviceConfig(ns.device, ns.attention_backend, get("disable_cuda_graph", False),
                            get("cuda_graph_max_bs", 64)),
        server=_server_config(ns, env),
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
    _validate_security(cfg)


def _validate_security(cfg: NibbleConfig) -> None:
    s, d = cfg.server, cfg.disagg
    if (s.ssl_keyfile is None) != (s.ssl_certfile is None):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
    if s.ssl_ca_certs is not None and s.ssl_certfile is None:
        raise ConfigError("--ssl-ca-certs (client certificates) needs --ssl-certfile and "
                          "--ssl-keyfile")
    tls = (d.kv_transfer_ssl_certfile, d.kv_transfer_ssl_keyfile, d.kv_transfer_ssl_ca_certs)
    if any(tls) and not all(tls):
        raise ConfigError("--kv-transfer-ssl-certfile, --kv-transfer-ssl-keyfile and "
                          "--kv-transfer-ssl-ca-certs go together (mutual TLS between workers)")
    if s.graceful_shutdown_timeout < 0:
        raise ConfigError("--graceful-shutdown-timeout must be >= 0")
    if s.max_request_body_bytes < 1024:
        raise ConfigError("--max-request-body-bytes must be >= 1024")
    h = cfg.hicache
    if h.hicache_storage_size is not None and h.hicache_storage_size <= 0:
        raise ConfigError("--hicache-storage-size must be > 0")
    if h.hicache_storage_password_file and h.hicache_storage_backend != "redis":
        raise ConfigError("--hicache-storage-password-file is for --hicache-storage-backend "
                          "redis")
