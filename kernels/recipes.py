"""K recipes: KV cache formats whose K side differs from plain NVFP4.

The page layout does not change: every recipe stores K with one of the
existing element layouts (NVFP4 codes + E4M3 block scales, or FP8 bytes), so
the decode path dequantizes it exactly like the plain format.

``nvfp4_k46`` ("4 or 6" block scaling for K, NVFP4 V)
    Per 16-element block two scales are tried: the standard
    ``e4m3(amax / 6 / gs)`` (amax maps to the largest E2M1 magnitude, 6) and
    ``e4m3(amax / 4 / gs)`` (amax maps to 4, so small values land on the finer
    part of the grid ``0, 0.5, 1, 1.5, 2, 3, 4`` while values above ``4 * scale``
    saturate at ``6 * scale``). The block keeps whichever gives the lower sum of
    squared dequantization errors; ties keep the standard scale. Dequantization
    is always ``code * scale * gs``, so the choice lives in the scale byte itself:
    no flag and no extra byte. Readers use :func:`~.nvfp4.dequantize_nvfp4`.

``nvfp4_khad`` / ``nvfp4_khad46`` (Hadamard-rotated K, NVFP4 V)
    K rows are multiplied by the orthonormal Sylvester Hadamard matrix ``H``
    (``D x D``, symmetric, ``H @ H = I``) before NVFP4 (plain, or "4 or 6")
    quantization, which spreads outlier channels over the whole row; dequantize
    multiplies by ``H`` again. Stateless: no calibration. A fused kernel would
    rotate q instead (``q . k = (q H) . (k H)``). The element names differ from
    ``nvfp4`` so kernels that do not know the rotation refuse the format.

``fp8k_nvfp4v`` (FP8 E4M3 K, NVFP4 V)
    A mixed format. For SmolLM2 (3 KV heads, D = 64) a token-layer costs
    3 * (64 + 32 + 4) = 300 bytes against FP8's 384: 1.28x FP8's tokens.

Calibrated recipes (a :class:`~.formats.KRecipe` on the format; ``nvfp4``,
``nvfp4_kmean``, ``nvfp4_kc``, ``nvfp4_kcs``, ``nvfp4_kcb``, ``nvfp4_kcb_vc``)
    Plain NVFP4 element layouts, so every kernel reads them; what changes is
    what is stored. Per layer and KV head, :func:`calibrate_recipe` computes a
    shift ``c [D]`` and a map ``M [D, D]`` from one calibration sequence; the
    backends then store ``k' = (k - c) @ M`` and attend with ``q' = q @ M^-T``
    over every key (fresh or cached), so ``q' . k' = q . k - q . c``: one
    constant per query, which softmax ignores. See :class:`RecipeParams`; the
    calibration is in ``recipe_calibration.py``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from .errors import KernelInputError, NonFiniteInputError
from .formats import (DEFAULT_K_RECIPE, FP8_E4M3, NVFP4, ElementFormat, KRecipe, KVCacheFormat,
                      register_kv_format)
from .nvfp4 import (BLOCK, E2M1_MAX, _check_global_scale, _pair_lut, dequantize_nvfp4,
                    e2m1_encode, e4m3_round, pack_nibbles, quantize_nvfp4)

# amax maps to this E2M1 magnitude in the alternative candidate scale.
ALT_TARGET = 4.0


def _codes_for_scale(blocks: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``blocks`` float32 ``[..., nb, 16]`` with E4M3 ``scale`` ``[..., nb]``.

    Returns ``(codes uint8 [..., nb, 16], sq_err float32 [..., nb])`` where
    ``sq_err`` is the block's sum of squared dequantization errors. Same
    rounding as :func:`~.nvfp4.quantize_nvfp4` (a zero scale encodes zeros).
    """
    denom = scale.float() * gs
    safe = torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)
    q = torch.where(denom.unsqueeze(-1) > 0, blocks / safe, blocks * 0.0)
    codes = e2m1_encode(q)
    lut = _pair_lut(blocks.device)[:16, 0]          # low-nibble values of bytes 0..15
    deq = (lut[codes.long()] * scale.float().unsqueeze(-1)) * gs
    return codes, (deq - blocks).square().sum(dim=-1)


def quantize_nvfp4_k46(x: torch.Tensor, global_scale: float | torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 with a per-block choice of amax -> 6 or amax -> 4 (lower squared error).

    Args:
        x: floating tensor ``[..., D]``, ``D % 16 == 0``, finite.
        global_scale: one positive finite FP32 value.
    Returns:
        ``(codes uint8 [..., D // 2], scales uint8 [..., D // 16])`` in the
        plain NVFP4 encoding (readable by :func:`~.nvfp4.dequantize_nvfp4`).
    """
    if not x.is_floating_point():
        raise KernelInputError(f"quantize_nvfp4_k46 expects a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise KernelInputError(
            f"last dim must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    gs = _check_global_scale(global_scale).to(x.device)
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise NonFiniteInputError("NVFP4 (k46) quantize got NaN or inf input")
    blocks = xf.unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(dim=-1)
    s6 = e4m3_round(amax / E2M1_MAX / gs)
    s4 = e4m3_round(amax / ALT_TARGET / gs)
    c6, e6 = _codes_for_scale(blocks, s6, gs)
    c4, e4 = _codes_for_scale(blocks, s4, gs)
    use4 = e4 < e6
    codes = torch.where(use4.unsqueeze(-1), c4, c6).flatten(-2)
    scale = torch.where(use4, s4.float(), s6.float()).to(torch.float8_e4m3fn)
    return pack_nibbles(codes), scale.view(torch.uint8)


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 ``[d, d]`` orthonormal Sylvester Hadamard matrix (``d`` a power of 2)."""
    device = torch.device(device)
    if d <= 0 or d & (d - 1):
        raise KernelInputError(f"Hadamard rotation needs a power-of-2 head_dim, got {d}")
    h = _HADAMARD.get((d, device))
    if h is None:
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = (h / d ** 0.5).to(device)
        _HADAMARD[(d, device)] = h
    return h


def _rotated(quantize):
    def q(x: torch.Tensor, global_scale):
        if not x.is_floating_point():
            raise KernelInputError(f"rotated NVFP4 expects a floating tensor, got {x.dtype}")
        xf = x.float()
        if not torch.isfinite(xf).all():
            raise NonFiniteInputError("rotated NVFP4 quantize got NaN or inf input")
        return quantize(xf @ hadamard(x.shape[-1], x.device), global_scale)
    return q


def dequantize_nvfp4_rotated(codes: torch.Tensor, scales: torch.Tensor,
                             global_scale: float | torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 dequantize ``[..., D]`` then undo the Hadamard rotation (fp32 matmul)."""
    y = dequantize_nvfp4(codes, scales, global_scale, torch.float32)
    return (y @ hadamard(y.shape[-1], y.device)).to(dtype)


NVFP4_K46 = ElementFormat("nvfp4_46", lambda d: d // 2, lambda d: d // BLOCK,
                          quantize_nvfp4_k46, dequantize_nvfp4, True)

NVFP4_HAD = ElementFormat("nvfp4_had", lambda d: d // 2, lambda d: d // BLOCK,
                          _rotated(quantize_nvfp4), dequantize_nvfp4_rotated, True)
NVFP4_HAD46 = ElementFormat("nvfp4_had46", lambda d: d // 2, lambda d: d // BLOCK,
                            _rotated(quantize_nvfp4_k46), dequantize_nvfp4_rotated, True)

register_kv_format(KVCacheFormat("nvfp4_k46", NVFP4_K46, NVFP4, experimental=True))
register_kv_format(KVCacheFormat("nvfp4_khad", NVFP4_HAD, NVFP4, experimental=True))
register_kv_format(KVCacheFormat("nvfp4_khad46", NVFP4_HAD46, NVFP4, experimental=True))
register_kv_format(KVCacheFormat("fp8k_nvfp4v", FP8_E4M3, NVFP4, experimental=True))


# ------------------------------------------------------------------ calibrated recipes

@dataclass(frozen=True, eq=False)
class RecipeParams:
    """Calibrated parameters of a :class:`~.formats.KRecipe` for one model.

    ``k_shift`` ``[L, H, D]``; ``k_map`` / ``q_map`` ``[L, H, D, D]`` or None
    (identity); ``v_shift`` ``[L, H, D]`` or None; ``k_bias`` ``[L, H, 1, D]``
    = ``-(k_shift @ k_map)`` (derived). K is stored as ``(k - k_shift) @ k_map``;
    queries attend as ``q @ q_map`` with ``q_map = k_map^-T`` (the query heads of
    a KV head's group share it), so every score drops by the same
    ``q . k_shift``. V is stored as ``v - v_shift`` and the attention output gets
    ``v_shift`` back (the probabilities sum to 1). ``digest`` names the (fp32)
    parameters: pages written under one digest are only valid under it. The
    tensors are fp32 on CPU as created; :meth:`to` gives a device/dtype copy.
    """

    recipe: KRecipe
    k_shift: torch.Tensor
    k_map: torch.Tensor | None
    q_map: torch.Tensor | None
    v_shift: torch.Tensor | None
    digest: str
    k_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.k_map is not None and self.k_bias is None:
            bias = -torch.einsum("lhd,lhde->lhe", self.k_shift.double(), self.k_map.double())
            object.__setattr__(self, "k_bias", bias.unsqueeze(2).to(self.k_shift.dtype))

    @classmethod
    def create(cls, recipe: KRecipe, k_shift: torch.Tensor, k_map: torch.Tensor | None,
               v_shift: torch.Tensor | None) -> "RecipeParams":
        """Parameters from ``k_shift``, ``k_map`` (``q_map`` is derived) and ``v_shift``."""
        f32 = lambda t: None if t is None else t.detach().to("cpu", torch.float32).contiguous()  # noqa: E731
        k_shift, k_map, v_shift = f32(k_shift), f32(k_map), f32(v_shift)
        q_map = None if k_map is None else f32(torch.linalg.inv(k_map.double()).mT)
        h = hashlib.sha256(json.dumps(recipe.__dict__, sort_keys=True).encode())
        for t in (k_shift, k_map, v_shift):
            h.update(b"-" if t is None else t.numpy().tobytes())
        for t in (k_shift, k_map, q_map, v_shift):
            if t is not None and not torch.isfinite(t).all():
                raise NonFiniteInputError("K recipe calibration produced non-finite parameters")
        return cls(recipe, k_shift, k_map, q_map, v_shift, h.hexdigest()[:16])

    @classmethod
    def identity(cls, recipe: KRecipe, num_layers: int, num_kv_heads: int, head_dim: int
                 ) -> "RecipeParams":
        """Parameters that change nothing (zero shifts, identity maps), digest ""."""
        shape = (num_layers, num_kv_heads, head_dim)
        eye = torch.eye(head_dim).expand(*shape, head_dim).contiguous()
        maps = None if recipe.transform == "none" else eye
        return cls(recipe, torch.zeros(shape), maps, None if maps is None else eye.clone(),
                   torch.zeros(shape) if recipe.center_v else None, "")

    _TENSORS = ("k_shift", "k_map", "q_map", "v_shift", "k_bias")

    def load_(self, other: "RecipeParams") -> None:
        """Copy ``other``'s values into these tensors in place (a captured CUDA graph keeps
        reading them); same recipe and shapes."""
        if other.recipe != self.recipe or other.shape != self.shape:
            raise KernelInputError(f"cannot load {other.recipe} {other.shape} into "
                                   f"{self.recipe} {self.shape}")
        for name in self._TENSORS:
            dst = getattr(self, name)
            if dst is not None:
                dst.copy_(getattr(other, name))
        object.__setattr__(self, "digest", other.digest)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)``."""
        return tuple(self.k_shift.shape)

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32
           ) -> "RecipeParams":
        """The same parameters (and digest) on ``device`` in ``dtype`` (the compute dtype:
        q and K are transformed in it, accumulating in fp32 inside the matmuls)."""
        mv = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
        return RecipeParams(self.recipe, *(mv(getattr(self, n)) for n in self._TENSORS[:4]),
                            self.digest, mv(self.k_bias))

    def apply(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]``, ``k``/``v`` ``[T, H, D]`` (the parameters' dtype and device) ->
        the transformed q, k, v, same shapes (k may be a strided view). Two batched matmuls
        per layer: ``k @ k_map + k_bias`` (the shift folded into the bias) and ``q @ q_map``."""
        if self.k_map is None:
            k = k - self.k_shift[layer]
        else:
            t, h, d = k.shape
            k = torch.baddbmm(self.k_bias[layer], k.transpose(0, 1), self.k_map[layer])
            k = k.transpose(0, 1)
            q = torch.einsum("thgd,hde->thge", q.reshape(t, h, -1, d),
                             self.q_map[layer]).reshape(q.shape)
        if self.v_shift is not None:
            v = v - self.v_shift[layer]
        return q, k, v

    def finish(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, Hq, D]`` -> plus the V shift of each query head's KV head."""
        if self.v_shift is None:
            return out
        t, hq, d = out.shape
        h = self.v_shift.shape[1]
        return (out.reshape(t, h, hq // h, d) + self.v_shift[layer][:, None]).reshape(t, hq, d)


_KCB = DEFAULT_K_RECIPE                     # nvfp4_kcb is the default nvfp4 under its own name
for _name, _k, _recipe in [("nvfp4_kmean", NVFP4, KRecipe("mean")), ("nvfp4_kc", NVFP4, KRecipe()),
                           ("nvfp4_kcs", NVFP4, KRecipe("sink", "diag")), ("nvfp4_kcb", NVFP4, _KCB),
                           ("nvfp4_kcb_vc", NVFP4, KRecipe("sink", "balanced", True)),
                           ("nvfp4_kcb46", NVFP4_K46, _KCB)]:
    register_kv_format(KVCacheFormat(_name, _k, NVFP4, _recipe, experimental=True))
