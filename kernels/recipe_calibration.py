"""Calibration of the K recipes (:class:`~.formats.KRecipe`) from captured q, K, V.

Per layer and KV head, from calibration text run through the model:

* **shift** ``c``: the attention-weighted mean of the keys (``"sink"``; the plain
  mean for ``"mean"``), nudged so that the first token's key (the attention
  sink, which draws much of the attention and sits far from the mean) maps onto
  the NVFP4 grid and is stored exactly;
* **map** ``M``: ``"diag"`` smoothing ``s = sqrt(amax|k - c| / amax|q|)`` per
  channel, or ``"balanced"``: the D x D map that gives q and K the same
  (attention-weighted) second moments, then a Hadamard rotation.

Post-RoPE keys drift with position, so the text is also run at later positions:
the shift averages the first runs (short contexts keep their gain), the map sees
every run's keys around that shift, the first runs weighing 3/4 (longer contexts
stay safe: fitted to the first few hundred positions only, the recipe is worse
than plain NVFP4 at 3-4K tokens).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .errors import KernelInputError
from .formats import ElementFormat, KRecipe
from .recipes import RecipeParams, hadamard

SINK_TOKENS = 1        # leading calibration tokens treated as the attention sink
RIDGE = 1e-3           # relative ridge on the second moments of the balanced map
LEAD_SHARE = 0.75      # the map's weight on the runs the shift is fitted to (short contexts)


def _key_weights(q: torch.Tensor, k: torch.Tensor, sm_scale: float, window: int | None
                 ) -> torch.Tensor:
    """float64 ``[H, T]`` (CPU): attention mass each key receives from every query of the
    calibration sequence and every query head of its group (causal, optionally windowed)."""
    t, h, d = k.shape
    s = torch.einsum("thgd,shd->hgts", q.reshape(t, h, -1, d), k) * sm_scale
    pos = torch.arange(t, device=k.device)
    rel = pos[:, None] - pos[None, :]
    vis = (rel >= 0) if window is None else (rel >= 0) & (rel < window)
    p = s.masked_fill(~vis, float("-inf")).softmax(-1)
    return p.sum((1, 2)).double().cpu()


def _psd_sqrt(a: torch.Tensor) -> torch.Tensor:
    w, u = torch.linalg.eigh(a)
    return (u * w.clamp_min(0).sqrt()) @ u.mT


def _balanced_map(sk: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    """float64 ``[D, D]`` map ``M`` with ``M^T Sk M = M^-1 Sq M^-T`` (diagonal): K and q get
    the same second moments, which minimises ``E|q'|^2 * E|k'|^2`` over invertible maps."""
    d = sk.shape[0]
    eye = torch.eye(d, dtype=sk.dtype)
    sk = sk + (RIDGE * sk.trace() / d + 1e-12) * eye
    sq = sq + (RIDGE * sq.trace() / d + 1e-12) * eye
    root = _psd_sqrt(sk)
    lam, u = torch.linalg.eigh(root @ sq @ root)
    return torch.linalg.inv(root) @ u * lam.clamp_min(1e-30) ** 0.25


def _rotation(d: int) -> torch.Tensor:
    """float64 ``[d, d]``: the Hadamard matrix where ``d`` is a power of 2, else the identity."""
    if d & (d - 1):
        return torch.eye(d, dtype=torch.float64)
    return hadamard(d).double()


def _layer_map(transform: str, qs: torch.Tensor, keys: torch.Tensor, w: torch.Tensor
               ) -> torch.Tensor | None:
    """``M [H, D, D]`` float64 for shifted ``keys [S, H, D]`` weighted by ``w [H, S]`` (sum 1)
    and the queries ``qs [S', Hq, D]``."""
    if transform == "none":
        return None
    _, h, d = keys.shape
    qg = qs.reshape(qs.shape[0], h, -1, d)
    if transform == "diag":
        s = (keys.abs().amax(0) / qg.abs().amax((0, 2)).clamp_min(1e-12)).clamp_min(1e-12).sqrt()
        m = torch.diag_embed(1.0 / s)
    else:
        sk = torch.einsum("hs,shd,she->hde", w, keys, keys)
        qf = qg.transpose(0, 1).reshape(h, -1, d)
        sq = qf.mT @ qf / qf.shape[1]
        m = torch.stack([_balanced_map(sk[i], sq[i]) for i in range(h)]) @ _rotation(d)
    # Keep k' as large as k - c (RMS over the calibration keys): E4M3 block scales stay normal.
    before = keys.square().mean((0, 2)).sqrt()
    after = torch.einsum("shd,hde->she", keys, m).square().mean((0, 2)).sqrt()
    ratio = torch.where(after > 0, before / after, torch.ones_like(after))
    return m * ratio[:, None, None]


def _pooled_keys(recipe: KRecipe, runs, sm_scale: float, window: int | None, lead: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[S, H, D]`` of every run but its sink, and their weights ``[H, S]`` (float64,
    CPU): attention mass received (uniform for the plain mean), normalized so that the
    first ``lead`` runs weigh ``LEAD_SHARE`` (all of it when there are no others)."""
    keys, weights = [], []
    n = len(runs)
    for i, (q, k, _) in enumerate(runs):
        t, h, _ = k.shape
        if recipe.center == "sink" or recipe.transform == "balanced":
            w = _key_weights(q, k, sm_scale, window)[:, SINK_TOKENS:]
        else:
            w = torch.ones(h, t - SINK_TOKENS, dtype=torch.float64)
        share = 1.0 / n if n == lead else (
            LEAD_SHARE / lead if i < lead else (1 - LEAD_SHARE) / (n - lead))
        weights.append(w / w.sum(-1, keepdim=True) * share)
        keys.append(k[SINK_TOKENS:].double().cpu())
    return torch.cat(keys), torch.cat(weights, 1)


def _calibrate_layer(recipe: KRecipe, runs, shift_runs: int, sm_scale: float,
                     window: int | None, k_roundtrip: Callable[[torch.Tensor], torch.Tensor],
                     v_roundtrip: Callable[[torch.Tensor], torch.Tensor]):
    """``(k_shift [H, D], M [H, D, D] or None, v_shift [H, D] or None)``, float64 on CPU.

    ``runs``: ``(q, k, v)`` of this layer per calibration run, ``runs[0]`` starting at
    position 0. The shift averages the first ``shift_runs`` runs; the map sees every
    run's keys around that shift (so drift over the positions it covers is accounted
    for), the first ``shift_runs`` weighing ``LEAD_SHARE``.
    """
    keys, w = _pooled_keys(recipe, runs[:shift_runs], sm_scale, window, shift_runs)
    mean = torch.einsum("hs,shd->hd", w, keys)
    keys, w = _pooled_keys(recipe, runs, sm_scale, window, shift_runs)
    qs = torch.cat([q[SINK_TOKENS:].double().cpu() for q, _, _ in runs])
    m = _layer_map(recipe.transform, qs, keys - mean, w)
    k0 = runs[0][1][0].double().cpu()
    shift = mean
    if recipe.center == "sink":
        # Nudge the shift so the sink's k' lies on the NVFP4 grid: it is stored exactly.
        y = k0 - mean
        y = y if m is None else torch.einsum("hd,hde->he", y, m)
        y = k_roundtrip(y.float()).double()
        shift = k0 - (y if m is None else torch.einsum("he,hed->hd", y, torch.linalg.inv(m)))
    v_shift = None
    if recipe.center_v:
        vd = runs[0][2].double().cpu()
        v0 = vd[0] - vd[SINK_TOKENS:].mean(0)
        v_shift = vd[0] - v_roundtrip(v0.float()).double()
    return shift, m, v_shift


def element_roundtrip(fmt: ElementFormat, global_scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> dequantize(quantize(x))`` in fp32 for one element format and global scale."""
    def rt(x: torch.Tensor) -> torch.Tensor:
        data, scales = fmt.quantize(x, global_scale)
        return fmt.dequantize(data, scales, global_scale, torch.float32)
    return rt


def calibrate_recipe(recipe: KRecipe, runs: Sequence[Sequence[tuple[torch.Tensor, ...]]],
                     sm_scale: float, k_fmt: ElementFormat, v_fmt: ElementFormat,
                     global_scales: torch.Tensor, windows: Sequence[int | None] = (),
                     shift_runs: int = 1) -> RecipeParams:
    """Parameters of ``recipe`` from calibration text run through the model.

    Args:
        runs: per run, per layer ``(q [T, Hq, D], k [T, H, D], v [T, H, D])`` as the
            attention backend receives them (RoPE applied). ``runs[0]`` starts at
            position 0 (its first token is the attention sink); the others are the
            same text at later positions (post-RoPE K drifts with position).
        sm_scale: the model's softmax scale.
        k_fmt, v_fmt: the element formats K and V are stored in.
        global_scales: float32 ``[L, 2]`` (K, V), the pool's.
        windows: per-layer sliding windows (None = full), or empty.
        shift_runs: how many leading runs the shift averages (the map uses all).
    Returns:
        :class:`RecipeParams` with ``[L, H, D]`` shifts (and ``[L, H, D, D]`` maps).
    """
    if not runs or not runs[0] or runs[0][0][1].shape[0] <= SINK_TOKENS + 1:
        raise KernelInputError("K recipe calibration needs a sequence of at least 3 tokens")
    shifts, maps, v_shifts = [], [], []
    for layer in range(len(runs[0])):
        gk, gv = (float(x) for x in global_scales[layer])
        shift, m, v_shift = _calibrate_layer(
            recipe, [run[layer] for run in runs], max(1, shift_runs), sm_scale,
            windows[layer] if windows else None, element_roundtrip(k_fmt, gk),
            element_roundtrip(v_fmt, gv))
        shifts.append(shift)
        maps.append(m)
        v_shifts.append(v_shift)
    return RecipeParams.create(recipe, torch.stack(shifts),
                               None if maps[0] is None else torch.stack(maps),
                               None if v_shifts[0] is None else torch.stack(v_shifts))
