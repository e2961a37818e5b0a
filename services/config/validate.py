"""Checks across the config tree, each naming the flag to change."""

from __future__ import annotations

from ..errors import ConfigError
from .tree import EXPERIMENTAL_FLAG, NibbleConfig


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
    if s.chunk_cost_context < -1:
        raise ConfigError("--chunk-cost-context must be >= 0, or -1 (from the model)")
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
    if cfg.disagg.kv_lease <= 0:
        raise ConfigError(f"--kv-lease-seconds must be > 0, got {cfg.disagg.kv_lease}")
    if cfg.model.load_format == "dummy" and cfg.model.model_path is None:
        raise ConfigError("--load-format dummy needs --model-path (a directory with config.json)")
    g = cfg.server.grpc_port
    if g is not None and (not 0 < g < 65536 or g == cfg.server.port):
        raise ConfigError(f"--grpc-port must be in 1..65535 and differ from --port, got {g}")
    _validate_kv_format(cfg)
    _validate_security(cfg)
    _validate_tp(cfg)


def _validate_kv_format(cfg: NibbleConfig) -> None:
    from nibble.kernels import KV_CACHE_FORMATS
    c = cfg.cache
    fmt = KV_CACHE_FORMATS.get(c.kv_cache_dtype)
    if fmt is not None and fmt.experimental and not c.enable_experimental_kv_formats:
        raise ConfigError(f"--kv-cache-dtype {c.kv_cache_dtype} is an experimental KV format: "
                          f"add {EXPERIMENTAL_FLAG} to use it")


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


def role_tp_sizes(cfg: NibbleConfig) -> tuple[int, int]:
    """(prefill, decode) tensor-parallel sizes of a --disaggregate deployment: each
    --prefill-tp-size / --decode-tp-size, else --tp-size."""
    d, n = cfg.disagg, cfg.device.tp_size
    return (n if d.prefill_tp_size is None else d.prefill_tp_size,
            n if d.decode_tp_size is None else d.decode_tp_size)


def _validate_tp(cfg: NibbleConfig) -> None:
    """What tensor parallelism supports in this version (the rest is refused by name)."""
    n = cfg.device.tp_size
    if n < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {n}")
    _validate_role_tp(cfg)
    if cfg.disagg.disaggregate:
        n = max(n, *role_tp_sizes(cfg))
    if cfg.device.base_gpu_id < 0:
        raise ConfigError(f"--base-gpu-id must be >= 0, got {cfg.device.base_gpu_id}")
    if cfg.device.tp_backend == "nccl" and cfg.device.device == "cpu":
        raise ConfigError("--tp-backend nccl needs --device cuda (CPU ranks use gloo)")
    # the GPU count is checked where the ranks start (parallel/devices.py): Ray ranks each
    # see only their own GPU


def _validate_role_tp(cfg: NibbleConfig) -> None:
    """--prefill-tp-size / --decode-tp-size: only with --disaggregate, and equal (each rank's
    pages move to the same rank of the decode group, services/disagg/rank_transfer.py)."""
    d = cfg.disagg
    given = [f for f, v in (("--prefill-tp-size", d.prefill_tp_size),
                            ("--decode-tp-size", d.decode_tp_size)) if v is not None]
    if given and not d.disaggregate:
        raise ConfigError(f"{' and '.join(given)} size the workers of --disaggregate; a "
                          f"colocated engine takes --tp-size")
    prefill, decode = role_tp_sizes(cfg)
    if min(prefill, decode) < 1:
        raise ConfigError(f"--prefill-tp-size and --decode-tp-size must be >= 1, got "
                          f"{prefill} and {decode}")
    if not d.disaggregate:
        return
    if prefill != decode:
        raise ConfigError(
            f"--prefill-tp-size {prefill} and --decode-tp-size {decode} differ: re-slicing KV "
            f"heads during the prefill -> decode transfer is not supported; give both the "
            f"same size")
