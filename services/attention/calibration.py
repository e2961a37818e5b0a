"""Start-up calibration of a KV format's K recipe (``kernels.recipes``).

A format with a :class:`~nibble.kernels.formats.KRecipe` (the default ``nvfp4``)
stores a transformed K whose parameters depend on the model. They are computed
once, when the engine is built, from a fixed text shipped here
(:data:`CALIBRATION_TEXT`, public-domain English prose) run through the model
with plain attention over fresh K/V: no download, no dependence on traffic, so
every worker with the same weights, dtype and kind of device computes the same
parameters (``RecipeParams.digest``; disaggregated workers and stored pages are
checked against it).

Post-RoPE keys drift with position, so the text also runs at later start
positions spread over the engine's context (:func:`calibration_starts`): a
recipe fitted only to the first few hundred positions can be worse than plain
NVFP4 thousands of positions later (docs/accuracy.md).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from nibble.kernels.recipe_calibration import calibrate_recipe
from nibble.kernels.recipes import RecipeParams
from nibble.tiering import KVPool

from .calibration_cache import CalibrationCache, cache_key

log = logging.getLogger(__name__)

MAX_CALIBRATION_TOKENS = 768
SHIFT_CONTEXT = 2048      # the shift fits positions [0, 2048): runs of the whole text
MAP_RUNS, MAP_RUN_TOKENS = 6, 256   # the map also sees 6 short runs spread up to the context

# Lewis Carroll, "Alice's Adventures in Wonderland" (1865), the opening of chapter I;
# Abraham Lincoln, the Gettysburg Address (1863); Jane Austen, "Pride and Prejudice"
# (1813), the opening of chapter 1. All in the public domain.
CALIBRATION_TEXT = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having \
nothing to do: once or twice she had peeped into the book her sister was reading, but it had \
no pictures or conversations in it, "and what is the use of a book," thought Alice "without \
pictures or conversations?"

So she was considering in her own mind (as well as she could, for the hot day made her feel \
very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the \
trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran \
close by her.

There was nothing so very remarkable in that; nor did Alice think it so very much out of the \
way to hear the Rabbit say to itself, "Oh dear! Oh dear! I shall be late!" (when she thought \
it over afterwards, it occurred to her that she ought to have wondered at this, but at the \
time it all seemed quite natural); but when the Rabbit actually took a watch out of its \
waistcoat-pocket, and looked at it, and then hurried on, Alice started to her feet, for it \
flashed across her mind that she had never before seen a rabbit with either a \
waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across the \
field after it, and fortunately was just in time to see it pop down a large rabbit-hole under \
the hedge.

In another moment down went Alice after it, never once considering how in the world she was \
to get out again.

Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. \
We have come to dedicate a portion of that field, as a final resting place for those who here \
gave their lives that that nation might live. It is altogether fitting and proper that we \
should do this.

But, in a larger sense, we can not dedicate, we can not consecrate, we can not hallow, this \
ground. The brave men, living and dead, who struggled here, have consecrated it, far above our \
poor power to add or detract. The world will little note, nor long remember what we say here, \
but it can never forget what they did here. It is for us the living, rather, to be dedicated \
here to the unfinished work which they who fought here have thus far so nobly advanced.

It is a truth universally acknowledged, that a single man in possession of a good fortune, \
must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a \
neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he \
is considered the rightful property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is \
let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."
"""


def calibration_ids(tokenizer, vocab_size: int, limit: int = MAX_CALIBRATION_TOKENS) -> list[int]:
    """The calibration text's token ids (with the BOS the model expects), at most ``limit``.

    A tokenizer that maps the text to a handful of ids (the numeric tokenizer of
    random-weight benchmark models) gets a fixed pseudo-random id sequence
    instead, so the calibration still sees varied keys.
    """
    ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=True)[:limit]
    if len(set(ids)) < len(ids) // 4:
        ids = [1 + (i * 7919) % (vocab_size - 1) for i in range(limit)]
    return ids


def calibration_starts(num_tokens: int, context: int) -> tuple[list[int], list[int]]:
    """Start positions ``(shift_runs, map_runs)``: runs of ``num_tokens`` tokens at 0 and,
    if it fits, ending at ``min(context, SHIFT_CONTEXT)``; then ``MAP_RUNS`` runs of
    ``MAP_RUN_TOKENS`` spread evenly from there to the end of the context."""
    shift_end = min(context, SHIFT_CONTEXT)
    shift = [0] if shift_end - num_tokens <= 0 else [0, shift_end - num_tokens]
    span = context - MAP_RUN_TOKENS - shift_end
    if span < 0:
        return shift, []
    return shift, sorted({shift_end + round(i * span / max(1, MAP_RUNS - 1))
                          for i in range(MAP_RUNS)})


@torch.inference_mode()
def capture_qkv(model, ids: Sequence[int], sm_scale: float,
                windows: Sequence[int | None] = (), start: int = 0
                ) -> list[tuple[torch.Tensor, ...]]:
    """Run ``ids`` (one sequence at positions ``start ...``) through ``model`` with plain
    causal attention over fresh K/V; per layer ``(q [T, Hq, D], k, v [T, H, D])`` float32."""
    device = next(model.parameters()).device
    tokens = torch.tensor(list(ids), dtype=torch.long, device=device)
    pos = torch.arange(start, start + len(ids), device=device)
    rel = pos[:, None] - pos[None, :]
    captures: list[tuple[torch.Tensor, ...]] = []

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        captures.append((q.float(), k.float(), v.float()))
        w = windows[layer] if windows else None
        mask = (rel >= 0) if w is None else (rel >= 0) & (rel < w)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, scale=sm_scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    model(tokens, pos, attn)
    return captures


def calibrate_pool(model, tokenizer, pool: KVPool, arch, context: int | None = None,
                   cache: CalibrationCache | None = None, fingerprint: str | None = None,
                   tp=None) -> RecipeParams | None:
    """Calibrate and install the K-recipe parameters of ``pool``'s format, if it has a recipe.

    ``arch``: the model's ``ModelArchConfig`` (``sm_scale``, ``vocab_size``,
    ``sliding_windows``, ``max_position_embeddings``); ``context``: the engine's
    context length (default: the model's). With a ``cache`` and the weights'
    ``fingerprint``, parameters calibrated before for the same inputs are read back
    instead (``calibration_cache.py``); ``tp``: the model's tensor-parallel group, whose
    ranks all read or all calibrate (the forwards collect). Returns the parameters, or
    None for a format without a recipe.
    """
    fmt = pool.layout.fmt
    if fmt.k_recipe is None:
        return None
    start = time.perf_counter()
    context = min(context or arch.max_position_embeddings, arch.max_position_embeddings)
    windows = tuple(getattr(arch, "sliding_windows", ()) or ())
    ids = calibration_ids(tokenizer, arch.vocab_size, min(MAX_CALIBRATION_TOKENS, context))
    key = None
    if cache is not None and fingerprint:
        key = cache_key(fingerprint=fingerprint, kv_format=fmt.name, recipe=fmt.k_recipe,
                        dtype=next(model.parameters()).dtype, device=pool.device.type,
                        context=context, ids=ids, global_scales=pool.global_scales,
                        windows=windows, tp_rank=getattr(tp, "rank", 0),
                        tp_size=getattr(tp, "size", 1))
        lay = pool.layout
        params = cache.load(key, fmt.k_recipe, (lay.num_layers, lay.num_kv_heads, lay.head_dim))
        if tp is not None and tp.size > 1 and not tp.all_min(int(params is not None)):
            params = None            # another rank misses: all calibrate, in step
        if params is not None:
            pool.set_recipe_params(params)
            log.info("KV format %s: K recipe %s read from the calibration cache in %.2f s "
                     "(parameters %s)", fmt.name, fmt.k_recipe, time.perf_counter() - start,
                     params.digest)
            return params
    params = _calibrate(model, ids, pool, arch, context, windows)
    if key is not None:
        cache.store(key, params)
    log.info("KV format %s: K recipe %s calibrated on %d tokens in %.2f s (parameters %s)",
             fmt.name, fmt.k_recipe, len(ids), time.perf_counter() - start, params.digest)
    return params


def _calibrate(model, ids, pool: KVPool, arch, context: int, windows) -> RecipeParams:
    """Run the calibration forwards, fit the recipe, install the parameters."""
    fmt = pool.layout.fmt
    shift_starts, map_starts = calibration_starts(len(ids), context)
    runs = [capture_qkv(model, ids, arch.sm_scale, windows, s) for s in shift_starts]
    runs += [capture_qkv(model, ids[:MAP_RUN_TOKENS], arch.sm_scale, windows, s)
             for s in map_starts]
    params = calibrate_recipe(fmt.k_recipe, runs, arch.sm_scale, fmt.k, fmt.v,
                              pool.global_scales, windows, len(shift_starts))
    pool.set_recipe_params(params)
    log.debug("calibration runs at positions %s", shift_starts + map_starts)
    return params
