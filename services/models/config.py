"""Architecture hyper-parameters of a decoder-only checkpoint.

One frozen ``ModelArchConfig`` describes Llama, Qwen2, Qwen3 and Gemma 3 (text)
checkpoints, built either from a Hugging Face ``config.json`` dict or from GGUF
metadata. Gemma 3 adds sliding-window layers, a local RoPE base, a query
scalar and logit soft-capping (``_gemma3_hf`` / ``_gemma3_gguf``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ModelLoadError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "yarn", "freq_factors")


@dataclass(frozen=True)
class ModelArchConfig:
    arch: str                          # "llama" | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int                     # query heads
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None          # None = plain RoPE; else {"rope_type": ..., params}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool               # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool                      # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Gemma 3; the defaults describe Llama / Qwen.
    sliding_windows: tuple[int | None, ...] = ()  # per layer: window (tokens), None = full; () = all full
    rope_local_theta: float | None = None          # RoPE base of sliding layers (unscaled); None: rope_theta
    query_pre_attn_scalar: float | None = None     # sm_scale = scalar ** -0.5; None = head_dim
    final_logit_softcapping: float | None = None   # logits = cap * tanh(logits / cap)

    @property
    def sm_scale(self) -> float:
        """Softmax scale of attention logits: ``query_pre_attn_scalar ** -0.5`` (default head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def has_sliding_window(self) -> bool:
        """Whether any layer attends over a sliding window (see ``sliding_windows``)."""
        return any(w is not None for w in self.sliding_windows)

    @property
    def o_bias(self) -> bool:
        """Output projection bias: Llama/Qwen3 tie it to ``attention_bias``, Qwen2 never has one."""
        return self.attention_bias and self.arch != "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"unsupported architecture {self.arch!r}; supported: {SUPPORTED_ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads {self.num_heads} is not a multiple of "
                                 f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_windows and (len(self.sliding_windows) != self.num_layers or any(
                w is not None and (not isinstance(w, int) or w < 1) for w in self.sliding_windows)):
            raise ModelLoadError(f"sliding_windows must hold {self.num_layers} positive ints or None, "
                                 f"got {self.sliding_windows!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: "
                                     f"none, {', '.join(SUPPORTED_ROPE_TYPES)}")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any],
                       extra_eos_ids: Collection[int] = ()) -> ModelArchConfig:
        """Build from a parsed HF ``config.json`` (transformers 4.x or 5.x layout).

        ``extra_eos_ids`` adds stop ids found elsewhere (``generation_config.json``).
        """
        arch = _hf_arch(cfg)
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            rope_params = dict(cfg.get("rope_parameters") or {})
            rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
            max_pos = int(cfg.get("max_position_embeddings") or 2048)
            bias = True if arch == "qwen2" else bool(cfg.get("attention_bias", False))
            num_layers = int(cfg["num_hidden_layers"])
            extra = _gemma3_hf(cfg, num_layers, max_pos) if arch == "gemma3" else {}
            fields = dict(
                arch=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers, num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
                rope_scaling=_normalize_rope(cfg.get("rope_scaling") or rope_params, max_pos),
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bias, qk_norm=arch in ("qwen3", "gemma3"),
                bos_token_id=_opt_int(cfg.get("bos_token_id")),
                eos_token_ids=_eos_tuple(cfg.get("eos_token_id"), extra_eos_ids),
            )
            return cls(**{**fields, **extra})
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json lacks or mangles a required field: {e!r}") from e

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any],
                           tensor_names: Collection[str]) -> ModelArchConfig:
        """Build from GGUF key/value metadata plus the file's tensor names.

        Tied embeddings and q/k/v bias are not stated in GGUF metadata; they are
        read off the presence of ``output.weight`` and ``blk.0.attn_q.bias``.
        """
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHS}")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        try:
            hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
            max_pos = int(key("context_length", 2048))
            vocab = key("vocab_size") or len(meta["tokenizer.ggml.tokens"])
            eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                         "tokenizer.ggml.eom_token_id")]
            head_dim = int(key("attention.key_length") or hidden // heads)
            extra = _gemma3_gguf(key, hidden, heads, head_dim) if arch == "gemma3" else {}
            fields = dict(
                arch=arch, vocab_size=int(vocab), hidden_size=hidden,
                intermediate_size=int(key("feed_forward_length")),
                num_layers=int(key("block_count")), num_heads=heads,
                num_kv_heads=int(key("attention.head_count_kv") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
                rope_theta=float(key("rope.freq_base", 10000.0)),
                rope_scaling=_gguf_rope(key, max_pos),
                max_position_embeddings=max_pos,
                tie_word_embeddings="output.weight" not in tensor_names,
                attention_bias="blk.0.attn_q.bias" in tensor_names,
                qk_norm=arch in ("qwen3", "gemma3"),
                bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
                eos_token_ids=_eos_tuple([e for e in eos if e is not None], ()),
            )
            return cls(**{**fields, **extra})
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"GGUF metadata lacks or mangles a required key: {e!r}") from e


def _hf_arch(cfg: Mapping[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_ARCHS and model_type != "gemma3":
        return model_type
    if model_type == "gemma3_text":
        return "gemma3"
    if model_type == "gemma3":
        raise ModelLoadError("Gemma 3 multimodal checkpoints (model_type 'gemma3') are not supported; "
                             "use a text-only one (model_type 'gemma3_text')")
    if model_type is None:  # very old configs: fall back to the class name
        for name in cfg.get("architectures") or ():
            for arch in SUPPORTED_ARCHS:
                if name.lower().startswith(arch):
                    return arch
    raise ModelLoadError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_ARCHS}")


def _normalize_rope(params: Mapping[str, Any] | None, max_pos: int) -> dict | None:
    """HF ``rope_scaling``/``rope_parameters`` -> None or a dict keyed by ``rope_type``."""
    if not params:
        return None
    out = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    out["rope_type"] = kind
    if kind in ("llama3", "yarn"):
        out.setdefault("original_max_position_embeddings", max_pos)
        if out.get("factor") is None and kind == "yarn":
            out["factor"] = max_pos / out["original_max_position_embeddings"]
    return out


def _gguf_rope(key, max_pos: int) -> dict | None:
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(key("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": int(key("rope.scaling.original_context_length",
                                                            max_pos))}
        for src, dst in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if key(f"rope.scaling.{src}") is not None:
                out[dst] = float(key(f"rope.scaling.{src}"))
        return out
    raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r}")


GEMMA3_PATTERN = 6          # every 6th layer global when a config states no layer types
GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's base for the sliding layers when GGUF states none
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _gemma3_hf(cfg: Mapping[str, Any], num_layers: int, max_pos: int) -> dict:
    """Gemma 3 fields of a ``gemma3_text`` config.json (transformers 4.x or 5.x layout).

    4.x: ``rope_theta`` + ``rope_scaling`` (global layers) and ``rope_local_base_freq``;
    5.x: ``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``.
    Layer kinds come from ``layer_types``, else from ``sliding_window_pattern``.
    """
    for name, ok in (("attn_logit_softcapping", cfg.get("attn_logit_softcapping") is None),
                     ("use_bidirectional_attention", not cfg.get("use_bidirectional_attention")),
                     ("hidden_activation", cfg.get("hidden_activation", _GELU_TANH[0]) in _GELU_TANH)):
        if not ok:
            raise ModelLoadError(f"Gemma 3 with {name}={cfg.get(name)!r} is not supported")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta")}
        local = {"rope_theta": cfg.get("rope_local_base_freq")}
    if _normalize_rope(local, max_pos) is not None:
        raise ModelLoadError(f"scaled RoPE on Gemma 3 sliding layers is not supported: {local}")
    types = cfg.get("layer_types")
    if not types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or GEMMA3_PATTERN)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(num_layers)]
    window = int(cfg.get("sliding_window") or 4096)
    return dict(
        rope_theta=float(full.get("rope_theta") or 1e6),
        rope_scaling=_normalize_rope(full, max_pos),
        rope_local_theta=float(local.get("rope_theta") or GEMMA3_LOCAL_THETA),
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        final_logit_softcapping=_opt_float(cfg.get("final_logit_softcapping")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _gemma3_gguf(key, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 3 fields from GGUF metadata, with llama.cpp's defaults for what GGUF leaves out.

    llama.cpp's converter writes the window but not the layer pattern (every 6th
    layer global), the local RoPE base (10000) or the query scalar: head_dim,
    except the 27B model (62 layers), which scales by ``hidden / heads``.
    """
    layers = int(key("block_count"))
    window = int(key("attention.sliding_window", 4096))
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer converters: one bool per layer, True = sliding
        kinds = [bool(x) for x in pattern]
    else:
        n = int(pattern or GEMMA3_PATTERN)
        kinds = [(i + 1) % n != 0 for i in range(layers)]
    return dict(
        sliding_windows=tuple(window if sliding else None for sliding in kinds),
        rope_local_theta=float(key("rope.freq_base_swa", GEMMA3_LOCAL_THETA)),
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        final_logit_softcapping=_opt_float(key("final_logit_softcapping")),
    )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _eos_tuple(v: Any, extra: Collection[int]) -> tuple[int, ...]:
    ids = [] if v is None else [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
    for x in extra:
        if int(x) not in ids:
            ids.append(int(x))
    return tuple(ids)
