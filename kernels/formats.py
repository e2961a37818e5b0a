"""KV element formats behind one interface, registered by name.

Every format stores a token-head row of ``head_dim`` values as raw bytes:

=========  ==================  ===================
format     data bytes per row  scale bytes per row
=========  ==================  ===================
bf16       2 * D               0
fp8_e4m3   D                   0   (one FP32 scale per layer)
nvfp4      D / 2               D / 16 (E4M3 per 16)
=========  ==================  ===================

A *KV cache format* (what ``--kv-cache-dtype`` names) picks one element format
for K and one for V, so mixed formats are one registry entry. It may also name a
calibrated :class:`KRecipe` (``nvfp4``, the default 4-bit format, does; the
uncalibrated NVFP4 is ``nvfp4_plain``): a per-model transform of q and K applied
before K is stored, whose parameters the pool holds (see ``recipes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import KernelInputError, NonFiniteInputError
from .fp8 import dequantize_fp8, quantize_fp8
from .nvfp4 import BLOCK, dequantize_nvfp4, quantize_nvfp4


@dataclass(frozen=True)
class ElementFormat:
    """How one tensor (K or V) of a layer is stored.

    ``quantize(x[..., D], global_scale) -> (data uint8 [..., data_bytes(D)],
    scales uint8 [..., scale_bytes(D)] or None)``; ``dequantize`` inverts it.
    """

    name: str
    data_bytes: Callable[[int], int]
    scale_bytes: Callable[[int], int]
    quantize: Callable[[torch.Tensor, float | torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
    dequantize: Callable[..., torch.Tensor]
    uses_global_scale: bool

    def bytes_per_row(self, head_dim: int) -> int:
        return self.data_bytes(head_dim) + self.scale_bytes(head_dim)


def _bf16_quantize(x: torch.Tensor, global_scale: float | torch.Tensor = 1.0):
    if not x.is_floating_point():
        raise KernelInputError(f"bf16 store expects a floating tensor, got {x.dtype}")
    xb = x.to(torch.bfloat16)
    if not torch.isfinite(xb).all():
        raise NonFiniteInputError("KV store got NaN or inf input")
    return xb.contiguous().view(torch.uint8), None


def _bf16_dequantize(data, scales, global_scale=1.0, dtype=torch.float32):
    return data.contiguous().view(torch.bfloat16).to(dtype)


def _fp8_dequantize(data, scales, global_scale, dtype=torch.float32):
    return dequantize_fp8(data, global_scale, dtype)


BF16 = ElementFormat("bf16", lambda d: 2 * d, lambda d: 0, _bf16_quantize, _bf16_dequantize, False)
FP8_E4M3 = ElementFormat("fp8_e4m3", lambda d: d, lambda d: 0,
                         lambda x, s: (quantize_fp8(x, s), None), _fp8_dequantize, True)
NVFP4 = ElementFormat("nvfp4", lambda d: d // 2, lambda d: d // BLOCK,
                      quantize_nvfp4, dequantize_nvfp4, True)


@dataclass(frozen=True)
class KRecipe:
    """A calibrated transform of q and K (and V) applied before K is stored.

    The parameters are computed per model (``recipes.calibrate_recipe``) and live
    in the KV pool beside the global scales; they are part of the stored format.

    ``center``: ``"mean"`` subtracts the per-channel mean of the calibration keys;
    ``"sink"`` subtracts their attention-weighted mean, nudged so that the first
    token's key (the attention sink) is stored exactly.
    ``transform``: ``"none"``; ``"diag"`` (per-channel smoothing ``s``: K / s is
    stored and q * s attends); ``"balanced"`` (a D x D map balancing the
    attention-weighted second moments of q and K, then a Hadamard rotation).
    ``center_v``: also center V (the attention output gets the V shift back).
    """

    center: str = "sink"
    transform: str = "none"
    center_v: bool = False

    def __post_init__(self) -> None:
        if self.center not in ("mean", "sink") or self.transform not in ("none", "diag", "balanced"):
            raise KernelInputError(f"bad K recipe {self}")


@dataclass(frozen=True)
class KVCacheFormat:
    """A named pair of element formats: one for K, one for V (and an optional K recipe).

    ``experimental``: a research format (an ablation or an alternative K recipe), offered
    by ``--kv-cache-dtype`` only with ``--enable-experimental-kv-formats``.
    """

    name: str
    k: ElementFormat
    v: ElementFormat
    k_recipe: KRecipe | None = None
    experimental: bool = False

    def bytes_per_token_per_layer(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies in one layer, K and V, codes and scales."""
        return num_kv_heads * (self.k.bytes_per_row(head_dim) + self.v.bytes_per_row(head_dim))


KV_CACHE_FORMATS: dict[str, KVCacheFormat] = {}


def register_kv_format(fmt: KVCacheFormat) -> KVCacheFormat:
    """Register a KV cache format under ``fmt.name`` (names are unique)."""
    if fmt.name in KV_CACHE_FORMATS:
        raise KernelInputError(f"KV cache format {fmt.name!r} is already registered")
    KV_CACHE_FORMATS[fmt.name] = fmt
    return fmt


def kv_format_names(experimental: bool = False) -> list[str]:
    """Registered format names, sorted; the experimental ones only if ``experimental``."""
    return sorted(n for n, f in KV_CACHE_FORMATS.items() if experimental or not f.experimental)


def get_kv_format(name: str) -> KVCacheFormat:
    try:
        return KV_CACHE_FORMATS[name]
    except KeyError:
        raise KernelInputError(
            f"unknown KV cache format {name!r}; known: {sorted(KV_CACHE_FORMATS)}") from None


register_kv_format(KVCacheFormat("bf16", BF16, BF16))
register_kv_format(KVCacheFormat("fp8_e4m3", FP8_E4M3, FP8_E4M3))
# The default 4-bit format: NVFP4 K and V with the calibrated K recipe (centering with an
# exact attention sink, balanced smoothing + Hadamard folded into q); docs/accuracy.md.
DEFAULT_K_RECIPE = KRecipe(center="sink", transform="balanced")
register_kv_format(KVCacheFormat("nvfp4", NVFP4, NVFP4, DEFAULT_K_RECIPE))
register_kv_format(KVCacheFormat("nvfp4_plain", NVFP4, NVFP4, experimental=True))
