"""Running a loaded model through a real EngineCore (torch backend, paged KV) and
recording every step's hidden states, for comparisons against transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nibble.kernels import PageLayout
from nibble.services.attention import TorchAttentionBackend
from nibble.services.config import SchedulerConfig
from nibble.services.engine.engine import EngineCore
from nibble.services.engine.model_runner import ModelRunner
from nibble.services.engine.types import GenerateRequest, SamplingParams
from nibble.tiering import KVPool


@dataclass
class Step:
    """One engine step of one sequence: ``n`` tokens from position ``start``; hidden ``[n, H]`` fp32."""

    start: int
    n: int
    hidden: torch.Tensor

    @property
    def kind(self) -> str:
        return "prefill" if self.start == 0 else "decode" if self.n == 1 else "extend"


class _Tap:
    """Wraps the model; records ``Step``s (single-sequence batches only)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.steps: list[Step] = []

    def __call__(self, ids, positions, attn):
        hidden = self.model(ids, positions, attn)
        self.steps.append(Step(int(positions[0]), len(ids), hidden.detach().float().clone()))
        return hidden

    def __getattr__(self, name):
        return getattr(self.model, name)


def run_engine(lm, prompt: list[int], gen: int, chunk: int = 512, kv: str = "bf16",
               windows=None, page_size: int = 4) -> tuple[list[Step], list[int]]:
    """Greedy ``gen`` tokens after ``prompt`` (EOS ignored), prompt run in ``chunk``-token steps.

    ``windows``: the backend's sliding windows (default: the model's own).
    Returns every step and the generated tokens.
    """
    a = lm.arch
    total = len(prompt) + gen
    layout = PageLayout(kv, a.num_layers, a.num_kv_heads, a.head_dim, page_size)
    pool = KVPool(layout, -(-total // page_size) + 2)
    backend = TorchAttentionBackend(pool, a.sm_scale, sliding_windows=(
        a.sliding_windows if windows is None else windows))
    tap = _Tap(lm.model)
    cfg = SchedulerConfig(max_running_requests=1, chunked_prefill_size=chunk,
                          max_prefill_tokens=max(chunk, 64))
    core = EngineCore(ModelRunner(tap, backend, torch.device("cpu")), pool, lm.tokenizer, cfg,
                      total + 8, None)
    core.add_request(GenerateRequest("r", list(prompt), SamplingParams(
        max_tokens=gen, temperature=0.0, ignore_eos=True)))
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            tokens.extend(out.new_token_ids)
    return tap.steps, tokens
