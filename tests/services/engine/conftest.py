"""A tiny random Llama-family model wired into a real EngineCore (no mocks below the tokenizer)."""

from __future__ import annotations

import pytest
import torch

from nibble.services.config import (CacheConfig, DeviceConfig, HiCacheConfig, ModelConfig,
                                    NibbleConfig, SchedulerConfig)
from nibble.services.engine.builder import Injected, build_engine_core
from nibble.services.engine.engine import EngineCore
from nibble.services.models.config import ModelArchConfig
from nibble.services.models.llama import CausalLM

VOCAB = 96


class CharTokenizer:
    """Token i decodes to one printable character; token 0 is EOS."""

    eos_token_ids = frozenset({0})
    bos_token_id = None
    vocab_size = VOCAB

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i) for i in ids if not (skip_special_tokens and i == 0))


def tiny_arch(arch="llama", **kw) -> ModelArchConfig:
    base = dict(arch=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False,
                attention_bias=arch == "qwen2", qk_norm=arch == "qwen3", bos_token_id=None,
                eos_token_ids=(0,))
    base.update(kw)
    return ModelArchConfig(**base)


def tiny_model(arch: ModelArchConfig, dtype=torch.float32, seed=0) -> CausalLM:
    g = torch.Generator().manual_seed(seed)
    model = CausalLM(arch, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if name == "embed" else 0.15))
    model.eval()
    # Logits in fp32 even for a bf16 model: bf16 logits tie exactly too often
    # for greedy comparisons to mean anything.
    model.compute_logits = lambda h: torch.nn.functional.linear(h.float(), model.lm_head.float())
    return model


def engine_config(kv="bf16", num_pages=64, page_size=16, prefill_kv_dtype="auto", radix=True,
                  backend="torch", context=None, hicache: HiCacheConfig | None = None,
                  device: DeviceConfig | None = None, **sched) -> NibbleConfig:
    """The config tree of a test engine: a pool of ``num_pages`` pages of format ``kv``, the
    attention ``backend``, scheduler fields ``sched`` over the tests' defaults (8 running,
    512-token chunks, 2048-token steps)."""
    sched = {"max_running_requests": 8, "chunked_prefill_size": 512,
             "max_prefill_tokens": 2048, **sched}
    return NibbleConfig(
        model=ModelConfig(context_length=context),
        cache=CacheConfig(kv_cache_dtype=kv, page_size=page_size,
                          max_total_tokens=num_pages * page_size,
                          prefill_kv_dtype=prefill_kv_dtype, disable_radix_cache=not radix),
        hicache=hicache or HiCacheConfig(), scheduler=SchedulerConfig(**sched),
        device=device or DeviceConfig(attention_backend=backend))


def tiered_config(kv: str) -> NibbleConfig:
    """32 L1 pages, 64 in L2, write-through, prefetch waits; the L3 store is injected."""
    hicache = HiCacheConfig(enable_hierarchical_cache=True, hicache_ratio=2.0,
                            hicache_write_policy="write_through",
                            hicache_prefetch_policy="wait_complete")
    return engine_config(kv, 32, hicache=hicache,
                         max_running_requests=SchedulerConfig().max_running_requests)


def make_engine(model: CausalLM, kv="bf16", num_pages=64, page_size=16, prefill_kv_dtype="auto",
                radix=True, overlap=False, **sched) -> EngineCore:
    """A real EngineCore through the server's builder: torch attention, no tier manager;
    ``overlap``: overlap scheduling (on the CPU too, where its steps simply run in order)."""
    cfg = engine_config(kv, num_pages, page_size, prefill_kv_dtype, radix, **sched)
    return build_engine_core(model, CharTokenizer(), cfg, inject=Injected(
        calibrate=False, use_l1_tiers=False, overlap=overlap))


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_model(tiny_arch(), torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_model():
    return tiny_model(tiny_arch("qwen3"), torch.float32)
