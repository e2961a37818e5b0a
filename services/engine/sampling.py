"""Token sampling for one engine step.

``sample`` turns the step's last-position logits into one token per sequence.
Greedy rows take the argmax; the other rows apply temperature, then top-k, then
top-p (nucleus) and draw one token with the row's own ``torch.Generator``.

The draw is inverse-CDF sampling with one uniform number per row, so a seeded
row's token depends only on its own logits and generator, never on which other
requests share the batch.
"""

from __future__ import annotations

import torch

from nibble.services.engine.types import SamplingParams

from ..host_copy import floats_to_device, ints_to_device

_MIN_TEMPERATURE = 1e-6


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded for one request, or None to use torch's default RNG."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row.

    logits: [B, V] float (float32 expected), one row per sequence, any device.
    params, generators: length B; ``generators[i]`` (or the default RNG when
    None) draws row i's randomness and is advanced by one draw per sampled row.
    Returns a [B] int64 tensor of token ids on ``logits.device``. The params were
    checked when their requests entered the engine (``SamplingParams.check``).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if len(params) != batch or len(generators) != batch:
        raise ValueError(f"{batch} logit rows but {len(params)} params, {len(generators)} generators")

    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    row_idx = ints_to_device(rows, logits.device)
    picked = _sample_rows(
        logits.index_select(0, row_idx).float(),
        [params[i] for i in rows],
        [generators[i] for i in rows],
    )
    out.index_copy_(0, row_idx, picked)
    return out


def _sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Temperature, top-k, top-p and a draw for non-greedy rows.

    logits: [N, V] float32. Returns [N] int64 token ids.
    """
    device = logits.device
    vocab = logits.shape[1]
    # the clamp keeps logits / temperature finite for subnormal temperatures
    temps = floats_to_device([max(p.temperature, _MIN_TEMPERATURE) for p in params], device)
    scaled = logits / temps.unsqueeze(1)

    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    # top_p 1.0 becomes 2.0 so float rounding of the cumulative mass can never
    # trim a row that asked for no nucleus cut
    top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
    if all(k >= vocab for k in top_k) and all(p > 1.0 for p in top_p):
        probs = _min_p(torch.softmax(scaled, dim=-1), params)
        return _draw(probs, _uniforms(generators, device))

    width = min(max(top_k), vocab)
    if width == vocab:
        vals, ids = torch.sort(scaled, dim=-1, descending=True)
    else:
        # every row caps its support at width tokens: a partial sort suffices
        vals, ids = torch.topk(scaled, width, dim=-1)
    keep_sorted = _keep_sorted(
        vals,
        ints_to_device(top_k, device),
        floats_to_device(top_p, device),
    )
    # back to vocab order: the draw then sees the same probabilities whichever
    # path (no filter, topk, full sort) the rest of the batch forced
    keep = torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, ids, keep_sorted)
    probs = _min_p(torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1), params)
    return _draw(probs, _uniforms(generators, device))


def _min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the tokens below ``min_p`` times their row's top probability (rows with
    min_p 0 untouched; the draw normalizes by the row's remaining mass)."""
    if not any(p.min_p > 0.0 for p in params):
        return probs
    min_p = floats_to_device([p.min_p for p in params], probs.device, probs.dtype)
    floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return probs.masked_fill(probs < floor, 0.0)


def _keep_sorted(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which sorted tokens survive top-k then top-p.

    vals: [N, W] float32 logits sorted descending per row; top_k: [N] int64
    (>= W means off); top_p: [N] float32 (> 1 means off). Returns [N, W] bool.
    """
    width = vals.shape[1]
    ranks = torch.arange(width, device=vals.device).unsqueeze(0)
    vals = vals.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    # mass of the strictly better tokens: a token stays while that mass is
    # still short of top_p, which keeps the smallest set reaching top_p and
    # always the first token (its preceding mass is 0 < top_p)
    before = torch.cumsum(probs, dim=-1) - probs
    return (ranks < top_k.unsqueeze(1)) & (before < top_p.unsqueeze(1))


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) float64 per row, each from its row's generator. Returns [N]."""
    out = torch.rand(len(generators), device=device, dtype=torch.float64)
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.rand(1, generator=gen, device=device, dtype=torch.float64)[0]
    return out


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw. probs: [N, W] (rows sum to ~1); u: [N] in [0, 1). Returns [N] int64."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    # right=True lands on the first index whose cdf exceeds the target, which
    # always has nonzero probability
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1)
    pos = pos.clamp_(max=probs.shape[1] - 1)
    # rounding can leave target == cdf[-1]; fall back to the row's top token
    ok = probs.gather(1, pos.unsqueeze(1)).squeeze(1) > 0
    return torch.where(ok, pos, torch.argmax(probs, dim=-1))
