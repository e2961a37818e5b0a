"""Running a loaded model through a real EngineCore (torch backend, paged KV) and
recording every step's hidden states, for comparisons against transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nibble.services.engine.builder import Injected, build_engine_core
from nibble.services.engine.types import GenerateRequest, SamplingParams

from ..engine.conftest import engine_config


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

    def __call__(self, ids, positions, attn, num_positions=None):
        hidden = self.model(ids, positions, attn, num_positions)
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
    total = len(prompt) + gen
    tap = _Tap(lm.model)
    cfg = engine_config(kv, -(-total // page_size) + 2, page_size, radix=False, context=total + 8,
                        max_running_requests=1, chunked_prefill_size=chunk,
                        max_prefill_tokens=max(chunk, 64))
    core = build_engine_core(tap, lm.tokenizer, cfg, inject=Injected(
        calibrate=False, sliding_windows=windows))
    core.add_request(GenerateRequest("r", list(prompt), SamplingParams(
        max_tokens=gen, temperature=0.0, ignore_eos=True)))
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            tokens.extend(out.new_token_ids)
    return tap.steps, tokens
