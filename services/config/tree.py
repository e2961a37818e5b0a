"""The config tree: one frozen dataclass per component, each field declared once.

A field's :func:`~.flags.flag` carries its default, flag name, help and choices;
``nibble serve``'s parser and :func:`~nibble.services.config.config_from_args`
are generated from these declarations. Choices that name registered things (KV
formats, attention backends, storage backends, transports) are read from their
registries when the parser is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..credentials import ADMIN_API_KEY_ENV, API_KEY_ENV, collect_keys
from ..errors import ConfigError
from .flags import Alias, Choices, flag

DEFAULT_PORT = 30000
DEFAULT_GRPC_PORT = 30001          # what a bare --grpc-port means
EXPERIMENTAL_FLAG = "--enable-experimental-kv-formats"


# ---------------------------------------------------------------- choices from the registries

def kv_format_choices() -> Choices:
    """``auto`` and the stable KV formats; the experimental ones are accepted (hidden) and
    gated by --enable-experimental-kv-formats in validate()."""
    from nibble.kernels import kv_format_names
    stable = kv_format_names()
    return Choices(["auto", *stable], sorted(set(kv_format_names(True)) - set(stable)))


def experimental_help() -> str:
    from nibble.kernels import kv_format_names
    hidden = sorted(set(kv_format_names(True)) - set(kv_format_names()))
    return ("let --kv-cache-dtype take the experimental KV formats (research K recipes and "
            f"ablations; docs/accuracy.md): {', '.join(hidden)}")


def attention_backend_choices() -> list[str]:
    """``auto`` and the registered backends; ``triton`` stays a choice where Triton does not
    import, so that asking for it explains why (engine/builder.py)."""
    from .. import attention
    names = set(attention.ATTENTION_BACKENDS) | {"triton"}
    return ["auto", *sorted(names)]


def kernel_choices() -> tuple[str, ...]:
    from ..attention.decode_select import KERNEL_CHOICES
    return KERNEL_CHOICES


def ragged_kernel_choices() -> tuple[str, ...]:
    from nibble.kernels.ragged import RAGGED_KERNELS
    return RAGGED_KERNELS


def storage_backend_choices() -> list[str]:
    from nibble.tiering.storage import storage_backend_names
    return [*storage_backend_names(), "none"]


def tool_parser_choices() -> list[str]:
    from ..frontend.tool_parsers import tool_parser_names
    return ["auto", *tool_parser_names(), "none"]


def transport_choices() -> list[str]:
    from nibble.tiering.transfer import transport_names
    return transport_names()


def write_policy_choices() -> tuple[str, ...]:
    from nibble.tiering.tier_manager import WRITE_POLICIES
    return WRITE_POLICIES


def prefetch_policy_choices() -> tuple[str, ...]:
    from nibble.tiering.tier_manager import PREFETCH_POLICIES
    return PREFETCH_POLICIES


# ---------------------------------------------------------------- SGLang's names

def _sglang_disaggregation_mode(value: str) -> bool:
    """SGLang's ``null`` = colocated; ``prefill`` or ``decode`` = disaggregated (Nibble runs
    both roles itself, on Ray actors)."""
    if value not in ("null", "prefill", "decode"):
        raise ConfigError(f"--disaggregation-mode takes null, prefill or decode, got {value!r}")
    return value != "null"


def _sglang_transfer_backend(value: str) -> str:
    if value not in transport_choices():
        raise ConfigError(f"--disaggregation-transfer-backend {value}: Nibble moves KV pages "
                          f"over {' or '.join(transport_choices())} (SGLang's mooncake, ascend "
                          f"and fake backends do not exist here)")
    return value


def _keys(value, spec, ns, env) -> tuple[str, ...]:
    """Keys from the repeatable flag, then its key files (the ``-file`` flag), then $ENV."""
    files = getattr(ns, spec.extra[0][1]["dest"], None)
    return collect_keys(value, files, env, spec.env, spec.flag)


def _key_file(name: str, help: str) -> tuple[str, dict]:
    dest = name[2:].replace("-", "_") + "s"
    return name, dict(dest=dest, action="append", default=None, metavar="PATH", help=help)


# ---------------------------------------------------------------- the slices

@dataclass(frozen=True)
class ModelConfig:
    model_path: str | None = flag(None, help="HF safetensors dir or GGUF file (default: "
                                             "embedded SmolLM2-135M-Instruct)")
    served_model_name: str | None = flag(None)   # name in /v1/models; default: builder.served_name
    dtype: str = flag("auto", choices=("auto", "float32", "bfloat16", "float16"))
    context_length: int | None = flag(None)      # cap on prompt + output tokens; None = model's
    load_format: str = flag("auto", choices=("auto", "dummy"),
                            help="dummy: random weights from the model's config.json (speed "
                                 "benchmarks; without tokenizer files a numeric tokenizer is "
                                 "used)")
    quantization: str = flag("auto", choices=("auto", "none", "gguf"),
                             help="gguf: keep a GGUF checkpoint's Q4_0/Q4_1 weights (and a Q8_0 "
                                  "LM head) packed and multiply CPU decode steps of up to 8 "
                                  "sequences by them (bf16 products; prompts keep the dense "
                                  "--dtype GEMMs); auto: gguf on one x86 CPU rank with AVX2 "
                                  "or hardware bf16; none: dequantized weights only")


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_dtype: str = flag("nvfp4", choices=kv_format_choices,
                               help="KV page format (auto: the model's dtype, as bf16); the "
                                    f"experimental formats need {EXPERIMENTAL_FLAG}")
    page_size: int = flag(16)                    # tokens per page
    mem_fraction_static: float | None = flag(None)  # device memory share for weights + KV pool
    max_total_tokens: int | None = flag(None)    # pool capacity in tokens; overrides the fraction
    prefill_kv_dtype: str = flag("auto", choices=("auto", "fp8_e4m3"))
    disable_radix_cache: bool = flag(False)      # turn prefix reuse off
    kv_secret_file: str | None = flag(
        None, metavar="PATH",
        help="the deployment's KV secret (>= 16 bytes): authenticates L3 page records, keys "
             "the content keys, signs transfer tickets; the same on every replica and worker "
             "(default: $NIBBLE_KV_SECRET, else a random secret per process)")
    enable_experimental_kv_formats: bool = flag(False, help=experimental_help)
    calibration_cache_dir: str = flag(
        "auto", metavar="DIR",
        help="where calibrated K-recipe parameters are kept, so a restart with the same "
             "weights, format and context skips calibrating (auto: "
             "$XDG_CACHE_HOME/nibble/calibration or ~/.cache/nibble/calibration; off: "
             "calibrate at every start). Only a directory private to the user is used")


@dataclass(frozen=True)
class HiCacheConfig:
    enable_hierarchical_cache: bool = flag(False)  # L2 host pool + L3 storage below the device
    hicache_ratio: float = flag(2.0)             # L2 pages as a multiple of L1 pages
    hicache_size: float | None = flag(None, help="L2 size in GB")
    hicache_storage_backend: str = flag("file", choices=storage_backend_choices)
    hicache_storage_url: str | None = flag(
        None, help="redis://host:port/db, or the file backend's directory; keep a password "
                   "out of it (see --hicache-storage-password-file)")
    hicache_storage_prefix: str = flag("nibble:kv:")   # Redis key prefix
    hicache_storage_ttl: int | None = flag(None)       # Redis TTL in seconds
    hicache_storage_size: float | None = flag(
        None, metavar="GB", help="file backend: most bytes the directory may hold, LRU-evicted "
                                 "(default: 16 GB or half the free disk, whichever is less)")
    hicache_write_policy: str = flag("write_through", choices=write_policy_choices)
    hicache_prefetch_policy: str = flag("best_effort", choices=prefetch_policy_choices,
                                        aliases=("--hicache-storage-prefetch-policy",))
    hicache_prefetch_timeout: float = flag(2.0)  # seconds a request waits under "timeout"
    hicache_storage_password_file: str | None = flag(
        None, metavar="PATH", help="the Redis password, first line of this file (default: "
                                   "$NIBBLE_HICACHE_STORAGE_PASSWORD)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = flag(64)         # decode batch cap
    chunked_prefill_size: int = flag(512)        # max prefill tokens of one request per step
    max_prefill_tokens: int = flag(2048)         # token budget of one step (chunks + decodes)
    max_queued_requests: int | None = flag(None)  # admission gate: 503 + Retry-After beyond it
    schedule_policy: str = flag("fcfs", choices=("fcfs", "lpm"))  # lpm: longest prefix first
    schedule_conservativeness: float = flag(1.0)  # share of future decode pages held back
    disable_overlap_schedule: bool = flag(
        False, help="plan each step after the previous one finished, instead of while it runs "
                    "on the GPU (overlap scheduling is on for CUDA; A/B runs)")
    debug_checks: bool = flag(False, help="check the KV cache's bookkeeping "
                                          "(KVCacheManager.check_integrity) whenever the "
                                          "engine idles")
    chunk_cost_context: int = flag(
        0, help="weight prefill chunks by their attention cost: a chunk of n tokens after c "
                "cached ones counts as n*(1+(c+n/2)/N) tokens against --max-prefill-tokens, so "
                "a long prompt's chunks shrink as its prefix grows and a mixed step stays "
                "short; N = the context at which a token's attention costs its forward pass; "
                "-1 derives N from the model (Qwen3-8B: 11776); 0 counts tokens only")
    step_trace_file: str | None = flag(
        None, help="write one JSON line per engine step (kind, decodes, chunk and prefix "
                   "tokens, budget cost, interval since the previous step, host time to "
                   "schedule and enqueue it, GC pauses and device-allocator segments) to this "
                   "file, to see which steps stretch the inter-token latency and why")


@dataclass(frozen=True)
class DisaggConfig:
    disaggregate: bool = flag(False, sglang=Alias(   # prefill and decode on separate Ray actors
        "--disaggregation-mode", _sglang_disaggregation_mode, metavar="{null,prefill,decode}",
        help="SGLang's flag: null = colocated; prefill or decode = --disaggregate (Nibble "
             "runs both roles itself)"))
    prefill_workers: int = flag(1)
    decode_workers: int = flag(1)
    ray_address: str | None = flag(None)         # join a cluster; None starts a local one
    kv_transport: str = flag("grpc", choices=transport_choices, sglang=Alias(
        "--disaggregation-transfer-backend", _sglang_transfer_backend, metavar="{grpc,nixl}",
        help="SGLang's name for --kv-transport (nixl or grpc; SGLang's other backends are "
             "refused)"))
    kv_transfer_failure_policy: str = flag("recompute", choices=("recompute", "fail"))
    kv_transfer_timeout: float = flag(30.0)      # seconds from reservation to installed pages
    kv_lease: float = flag(5.0, "--kv-lease-seconds",
                           help="decode-side page reservation lease, renewed by heartbeats "
                                "every third of it; a reservation whose prefill side goes "
                                "silent is freed after this many seconds")
    kv_transfer_host: str | None = flag(
        None, help="interface the KV-transfer servers bind (default: 127.0.0.1 on a local "
                   "cluster, the node's Ray address on a joined one)")
    kv_transfer_ssl_certfile: str | None = flag(
        None, help="TLS certificate of this worker's KV-transfer server")
    kv_transfer_ssl_keyfile: str | None = flag(None)
    kv_transfer_ssl_ca_certs: str | None = flag(
        None, help="CA that signs every worker's transfer certificate (mutual TLS)")
    prefill_tp_size: int | None = flag(
        None, help="tensor-parallel ranks of each prefill worker (default: --tp-size)")
    decode_tp_size: int | None = flag(
        None, help="tensor-parallel ranks of each decode worker (default: --tp-size)")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = flag("auto", choices=("auto", "cpu", "cuda"))
    attention_backend: str = flag("auto", choices=attention_backend_choices)
    disable_cuda_graph: bool = flag(
        False, help="run decode steps eagerly instead of replaying captured CUDA graphs")
    cuda_graph_max_bs: int = flag(
        64, help="largest decode batch captured in a CUDA graph (bigger ones run eagerly)")
    decode_kernel: str = flag(
        "auto", choices=kernel_choices,
        help="Triton backend: the paged-decode kernel (auto: the CUDA sm_90 kernel where it "
             "applies, else Triton; cuda where it cannot run is an error)")
    store_kernel: str = flag(
        "auto", choices=kernel_choices,
        help="Triton backend: the NVFP4 quantize-and-store kernel (auto = triton; cuda: the "
             "CUDA C++ one, same bytes, needs compute capability 9.0)")
    prefill_attention_kernel: str = flag(
        "auto", choices=ragged_kernel_choices,
        help="Triton backend, CUDA: the prefill/extend attention (auto: cuDNN's fused "
             "attention on sm_90 for up to 4 sequences of >= 256 new tokens, else "
             "FlashAttention-2 varlen; cudnn where it cannot run is an error)")
    disable_fused_kernels: bool = flag(
        False, help="CUDA: run each decoder layer on unfused torch ops (about 45 kernels per "
                    "layer) instead of the fused Triton kernels (residual add + RMSNorm, "
                    "QK-norm + RoPE + K recipe + KV store, SiLU-and-mul; 10 per decode layer), "
                    "for A/B runs")
    disable_pdl: bool = flag(
        False, help="CUDA: launch the paged-decode kernel after the fused QKV kernel in the "
                    "usual way, instead of as its programmatic dependent (PDL, default on "
                    "sm_90: the decode kernel's CTAs start and fill their rings from the "
                    "cached pages while the QKV kernel still runs), for A/B runs")
    tp_size: int = flag(
        1, aliases=("--tensor-parallel-size",),
        help="tensor parallelism: split the model over this many ranks (one process each; "
             "rank 0 schedules, the others run its steps on their shard of the weights and "
             "KV heads). CPU: gloo; CUDA: NCCL, one GPU per rank")
    tp_backend: str = flag(
        "auto", choices=("auto", "nccl", "gloo"),
        help="collectives of --tp-size > 1 on CUDA (auto = nccl, one GPU per rank; gloo copies "
             "through the host, runs without CUDA graphs and lets ranks share a GPU: tests)")
    base_gpu_id: int = flag(
        0, help="CUDA: the first GPU this server uses (rank r of --tp-size takes base + r)")


@dataclass(frozen=True)
class ServerConfig:
    host: str = flag("127.0.0.1")
    port: int = flag(DEFAULT_PORT)
    log_level: str = flag("info")
    # Keys never show in repr (logs); the gateway redacts them from /get_server_info.
    api_keys: tuple[str, ...] = flag(
        (), "--api-key", metavar="KEY", secret=True, env=API_KEY_ENV, build=_keys,
        extra=(_key_file("--api-key-file", "API keys, one per line; repeatable"),),
        help="require this key (Authorization: Bearer KEY or x-api-key) on /v1 routes; "
             "repeatable. Visible in ps: prefer --api-key-file or $NIBBLE_API_KEY (default: "
             "unauthenticated)")
    admin_api_keys: tuple[str, ...] = flag(
        (), "--admin-api-key", metavar="KEY", secret=True, env=ADMIN_API_KEY_ENV, build=_keys,
        extra=(_key_file("--admin-api-key-file", "admin keys, one per line; repeatable (or "
                                                 "$NIBBLE_ADMIN_API_KEY)"),),
        help="require this key on the admin routes (/flush_cache, /abort_request, "
             "/get_server_info, /kv_events); repeatable. Without one, the admin routes answer "
             "on loopback only")
    grpc_port: int | None = flag(
        None, bare=DEFAULT_GRPC_PORT,
        help=f"also serve the gRPC API (nibble.v1.Nibble, health, reflection) on this port of "
             f"--host; bare flag: {DEFAULT_GRPC_PORT} (default: off)")
    ssl_keyfile: str | None = flag(None, help="TLS private key (HTTP and gRPC)")
    ssl_certfile: str | None = flag(None, help="TLS certificate chain (HTTP and gRPC)")
    ssl_ca_certs: str | None = flag(
        None, help="CA bundle; when set, clients must present a certificate it signed")
    allow_unauthenticated: bool = flag(
        False, help="allow a non-loopback --host without any API key")
    graceful_shutdown_timeout: float = flag(
        30.0, help="on SIGTERM: stop admitting (503), give running requests this many seconds, "
                   "then end the remaining streams with an error event")
    max_request_body_bytes: int = flag(
        16 << 20, help="largest HTTP request body and gRPC message accepted")
    tool_call_parser: str = flag(
        "auto", choices=tool_parser_choices,
        help="how tool calls are read from the model's output (chat tools / tool_choice): "
             "hermes (<tool_call> blocks: Qwen2.5/3, Hermes, SmolLM2-style ChatML), "
             "llama3_json, pythonic; auto picks from the chat template; none refuses tools")


def grammar_backend_choices() -> list[str]:
    from ..engine.grammar import grammar_backend_names
    return grammar_backend_names()


@dataclass(frozen=True)
class SamplingConfig:
    grammar_backend: str = flag(
        "xgrammar", choices=grammar_backend_choices,
        help="structured outputs (response_format json_object / json_schema, regex, ebnf): "
             "the grammar engine that masks the sampler's tokens; none refuses them")


def _slice(cls, title: str, args: str):
    return field(default_factory=cls, metadata={"title": title, "args": args})


@dataclass(frozen=True)
class NibbleConfig:
    """The whole tree; each field's metadata names its argument group and whether it belongs
    to the engine flags (``serve`` and the benchmarks) or the server flags (``serve``)."""

    model: ModelConfig = _slice(ModelConfig, "model", "engine")
    cache: CacheConfig = _slice(CacheConfig, "KV cache", "engine")
    hicache: HiCacheConfig = _slice(
        HiCacheConfig, "hierarchical cache (L2 host memory, L3 storage)", "engine")
    scheduler: SchedulerConfig = _slice(SchedulerConfig, "scheduler", "engine")
    disagg: DisaggConfig = _slice(DisaggConfig, "disaggregated serving (Ray)", "engine")
    device: DeviceConfig = _slice(DeviceConfig, "device", "engine")
    server: ServerConfig = _slice(ServerConfig, "server", "server")
    sampling: SamplingConfig = _slice(SamplingConfig, "sampling", "engine")
