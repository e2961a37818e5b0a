"""Engines and pools for comparing attention backends on the tiny random models.

The model, tokenizer and scheduler settings come from the engine tests'
conftest; only the backend (and the device) differ here.
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.services.config import DeviceConfig
from nibble.services.engine.builder import Injected, build_engine_core
from nibble.services.engine.engine import EngineCore
from nibble.services.engine.types import GenerateRequest, SamplingParams

from ..engine.conftest import CharTokenizer, engine_config, tiny_arch, tiny_model

__all__ = ["compare_greedy_runs", "make_engine_with", "mixed_arrivals", "run_scenario", "tiny_arch",
           "tiny_model"]


def make_engine_with(model, backend: str, kv: str = "bf16", device: str = "cpu",
                     num_pages: int = 64, page_size: int = 16, prefill_kv_dtype: str = "auto",
                     graph_max_bs: int | None = None, use_graphs: bool = False,
                     disable_fused_kernels: bool = True, overlap: bool = False,
                     disable_pdl: bool = False,
                     **sched) -> EngineCore:
    """A real EngineCore (through the server's builder) with the named attention backend;
    pool and runner on ``device``; no tier manager, the K recipe left to the test; the
    model's fused layer kernels off unless ``disable_fused_kernels=False`` (on CUDA);
    overlap scheduling off unless ``overlap`` (the logits hook sees synchronous steps only).

    ``graph_max_bs`` adds a DecodeGraphRunner (real CUDA graphs with ``use_graphs``,
    else its eager static-buffer path)."""
    dev = DeviceConfig(device=device, attention_backend=backend,
                       disable_cuda_graph=not use_graphs, cuda_graph_max_bs=graph_max_bs or 1,
                       disable_fused_kernels=disable_fused_kernels, disable_pdl=disable_pdl)
    cfg = engine_config(kv, num_pages, page_size, prefill_kv_dtype, device=dev, **sched)
    inject = Injected(calibrate=False, use_l1_tiers=False, overlap=overlap,
                      static_decode_path=graph_max_bs is not None)
    return build_engine_core(model, CharTokenizer(), cfg, device=torch.device(device),
                             inject=inject)


def greedy(rid: str, prompt: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0.0,
                                                             ignore_eos=True))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 90 + 1 for i in range(n)]


def run_scenario(engine, arrivals: dict[int, list[GenerateRequest]]
                 ) -> tuple[list[torch.Tensor], dict[str, list[int]], set[str]]:
    """Step ``engine`` to completion, adding ``arrivals[step]`` before each step.

    Returns the logits ``[N, V]`` of every step that samples (fp32, on CPU),
    each request's generated tokens, and the attention paths the steps took
    ("prefill", "extend", "decode", and "mixed" for a step with decode and
    another path); checks that no page leaks.
    """
    seen: list[torch.Tensor] = []
    paths: set[str] = set()
    runner, backend = engine.runner, engine.runner.backend
    orig = runner._sample           # sees the logits of every step, CUDA-graph replays too
    orig_plan = backend.plan

    def plan(meta):
        kinds = {k for k in ("prefill", "extend", "decode") if getattr(meta, k)}
        paths.update(kinds | ({"mixed"} if "decode" in kinds and len(kinds) > 1 else set()))
        orig_plan(meta)

    def hook(picked, logits):
        seen.append(logits.detach().float().cpu())
        return orig(picked, logits)

    runner.__dict__["_sample"], backend.plan = hook, plan
    tokens: dict[str, list[int]] = {}
    step = 0
    try:
        while step <= max(arrivals) or engine.has_unfinished():
            for r in arrivals.get(step, []):
                engine.add_request(r)
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            step += 1
    finally:
        del runner.__dict__["_sample"], backend.plan
    assert engine.pool.allocator.num_free == engine.pool.num_pages, "pages leaked"
    return seen, tokens, paths


def compare_greedy_runs(ref: list[torch.Tensor], got: list[torch.Tensor], tol: float) -> int:
    """Two runs of one greedy scenario whose numerics differ (``run_scenario``'s per-step
    logits): every step's logits within ``tol`` until the first step whose greedy tokens
    differ, and there only at a near tie of the reference (the tokens' logits less than
    ``tol`` apart); later steps had other inputs and are not compared. Returns how many
    steps were compared."""
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape, f"step {i}: {tuple(g.shape)} against {tuple(r.shape)}"
        worst = float((g.float() - r.float()).abs().max())
        assert worst <= tol, f"step {i}: logits {worst} apart"
        want, have = r.float().argmax(-1), g.float().argmax(-1)
        flips = (want != have).nonzero().flatten().tolist()
        for row in flips:
            gap = float(r[row, want[row]] - r[row, have[row]])
            assert gap <= tol, f"step {i}, row {row}: tokens part at a {gap} margin"
        if flips:
            return i + 1
    assert len(got) == len(ref)
    return len(ref)


def mixed_arrivals(n_a: int = 21, n_b: int = 40, n_c: int = 21) -> dict[int, list]:
    """A decodes while B's prompt runs in chunks; C repeats A's prompt (a cached prefix).

    With ``chunked_prefill_size=16`` the steps mix prefill, extend and decode.
    """
    return {0: [greedy("a", prompt(n_a), 6)],
            1: [greedy("b", prompt(n_b, 1), 4)],
            3: [greedy("c", prompt(n_c), 3)]}


# ---------------------------------------------------------------- kernel choice (no GPU needed)

def kv_layout(kv="nvfp4", head_dim=128, page_size=16, kv_heads=2):
    """A two-layer page layout for the kernel-choice tests."""
    return PageLayout(kv, num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim,
                      page_size=page_size)


@pytest.fixture
def fake_cap(monkeypatch):
    """Set the capability every CUDA device reports; the env overrides start unset."""
    from nibble.services.attention import decode_select as ds
    monkeypatch.delenv(ds.ENV_VAR, raising=False)
    monkeypatch.delenv(ds.STORE_ENV_VAR, raising=False)

    def set_cap(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    set_cap((9, 0))
    return set_cap


@pytest.fixture
def no_compile(monkeypatch):
    """Any attempt to build the CUDA extension fails the test."""
    import torch.utils.cpp_extension as cpp_extension

    from nibble.kernels import cuda as kcuda

    def refuse(*a, **kw):
        raise AssertionError("the CUDA extension must not be built here")
    monkeypatch.setattr(cpp_extension, "load", refuse)
    monkeypatch.setattr(cpp_extension, "load_inline", refuse)
    yield
    assert not kcuda.is_built()
