"""A tiny random Llama-family model wired into a real EngineCore (no mocks below the tokenizer)."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.services.attention import TorchAttentionBackend
from nibble.services.config import SchedulerConfig
from nibble.services.engine.engine import EngineCore
from nibble.services.engine.model_runner import ModelRunner
from nibble.services.models.config import ModelArchConfig
from nibble.services.models.llama import CausalLM
from nibble.tiering import KVPool
from nibble.tiering.radix_cache import RadixCache

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


def make_engine(model: CausalLM, kv="bf16", num_pages=64, page_size=16, prefill_kv_dtype="auto",
                radix=True, **sched) -> EngineCore:
    a = model.arch
    layout = PageLayout(kv, a.num_layers, a.num_kv_heads, a.head_dim, page_size)
    pool = KVPool(layout, num_pages)
    cache = RadixCache(page_size, pool) if radix else None
    backend = TorchAttentionBackend(pool, a.sm_scale, prefill_kv_dtype)
    cfg = SchedulerConfig(**{"max_running_requests": 8, "chunked_prefill_size": 512,
                             "max_prefill_tokens": 2048, **sched})
    return EngineCore(ModelRunner(model, backend, torch.device("cpu")), pool, CharTokenizer(),
                      cfg, a.max_position_embeddings, cache)


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_model(tiny_arch(), torch.bfloat16)


@pytest.fixture(scope="module")
def fp32_model():
    return tiny_model(tiny_arch("qwen3"), torch.float32)
