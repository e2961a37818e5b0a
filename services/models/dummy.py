"""Random weights for speed benchmarks (``--load-format dummy``).

Speed does not depend on the weights' values, so a benchmark model needs only
its shape: a HF ``config.json`` (e.g. ``bench/models/qwen3-8b``). Parameters
are drawn on the target device from a seeded generator, so every worker that
loads the same config on the same kind of device gets the same weights and the
same fingerprint (disaggregated workers check it). Without tokenizer files the
model gets a numeric tokenizer: id ``i`` is the word ``t<i>``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from ..errors import ModelLoadError
from .config import ModelArchConfig
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

DUMMY_SEED = 0
WEIGHT_STD = 0.02          # GPT-2-style init: keeps activations finite through deep stacks
DUMMY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def numeric_tokenizer(vocab_size: int, eos_token_ids: Iterable[int]) -> Tokenizer:
    """A word-level tokenizer over ``t0 .. t{vocab_size-1}`` (unknown words -> ``t0``).

    Decoding joins the words with spaces; there is no chat template (the
    gateway's chat route then answers 400), so benchmarks send token ids.
    """
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token=None, eos_token=None, eos_token_ids=eos_token_ids,
                     chat_template=None)


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, norm_value: float = 1.0,
                       seed: int = DUMMY_SEED) -> None:
    """Norm weights (1-D parameters whose name says norm) get ``norm_value``, the rest
    N(0, 0.02^2) from a seeded generator on the parameters' device."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.fill_(norm_value)
        else:
            p.normal_(0.0, WEIGHT_STD, generator=gen)


def load_dummy(path: str, model: torch.nn.Module, arch: ModelArchConfig) -> Tokenizer:
    """Fill ``model`` (built for ``arch``, unloaded) with random weights; return the
    directory's tokenizer if it has one (``tokenizer.json``), else :func:`numeric_tokenizer`."""
    if arch.arch not in DUMMY_ARCHS:
        raise ModelLoadError(f"--load-format dummy supports {DUMMY_ARCHS}, "
                             f"{path} is {arch.arch!r}")
    # Gemma's RMSNorm scales by (1 + w): 0 is its identity
    fill_dummy_weights(model, 0.0 if arch.arch == "gemma3" else 1.0)
    model.eval()
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        tok = Tokenizer.from_hf_dir(path, arch.eos_token_ids)
    else:
        tok = numeric_tokenizer(arch.vocab_size, arch.eos_token_ids)
    log.info("dummy weights for %s (%s, %.2fB parameters)", os.path.basename(path), arch.arch,
             sum(p.numel() for p in model.parameters()) / 1e9)
    return tok
