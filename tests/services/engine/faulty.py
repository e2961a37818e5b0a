"""Fault injection for a real EngineCore: a ModelRunner that fails chosen requests."""

from __future__ import annotations

import torch

from nibble.services.config import NibbleConfig, SchedulerConfig
from nibble.services.engine.async_engine import AsyncEngine
from nibble.services.engine.builder import EngineParts
from nibble.services.engine.model_runner import ModelRunner
from nibble.services.errors import NibbleError


class FaultyRunner(ModelRunner):
    """The engine's own runner, except that a step holding a request of ``raise_for`` raises
    ``exc``, and the logit rows of requests in ``nan_for`` come out NaN. Both sets may be
    changed between steps; ``executions`` counts model runs."""

    def __init__(self, base: ModelRunner, raise_for=(), nan_for=(),
                 exc: Exception | None = None):
        super().__init__(base.model, base.backend, base.device, base.graphs)
        self.eos_ids = base.eos_ids
        self.raise_for, self.nan_for = set(raise_for), set(nan_for)
        self.exc = exc or RuntimeError("injected fault")
        self.executions = 0

    def execute(self, batch, page_size):
        self.executions += 1
        return super().execute(batch, page_size)

    def _forward(self, seqs, page_size, rows, ids=None):
        if any(s.request_id in self.raise_for for s in seqs):
            raise self.exc
        logits = super()._forward(seqs, page_size, rows, ids)
        if logits is not None:
            for i, s in enumerate(s for s in seqs if s.sample):
                if s.request_id in self.nan_for:
                    logits[i] = float("nan")
        return logits


def inject(engine, **kw) -> FaultyRunner:
    """Swap ``engine``'s runner (and its isolator's) for a FaultyRunner."""
    runner = FaultyRunner(engine.runner, **kw)
    engine.runner = engine.isolator.runner = runner
    return runner


def run_outputs(engine, reqs, on_step=None):
    """Run requests to completion; ``{rid: (tokens, finish_reason, error, error_type)}``.

    ``on_step(step_index)`` is called before every step (to change the injected faults).
    """
    for r in reqs:
        engine.add_request(r)
    acc: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    done = {}
    step = 0
    while engine.has_unfinished():
        if on_step is not None:
            on_step(step)
        for o in engine.step():
            acc[o.request_id] += o.new_token_ids
            if o.finished:
                done[o.request_id] = (acc[o.request_id], o.finish_reason, o.error, o.error_type)
        step += 1
    return done


def pages_balance(engine) -> None:
    """Every page is free again (cached pages are free too: refcount 0), none is held or
    reserved, and the cache's bookkeeping agrees."""
    alloc, conn = engine.pool.allocator, engine.connector
    held = sum(h.num_pages for h, _ in conn.held.values()) if conn is not None else 0
    assert alloc.num_free + held == alloc.num_pages, (alloc.num_free, held, alloc.num_pages)
    assert conn is None or not conn.reservations
    engine.kv.check_integrity()


def async_engine(core, **sched) -> AsyncEngine:
    """An AsyncEngine (real engine thread) around ``core``; ``sched`` must match the core's."""
    cfg = NibbleConfig(scheduler=SchedulerConfig(**{"max_running_requests": 8,
                                                   "chunked_prefill_size": 512,
                                                   "max_prefill_tokens": 2048, **sched}))
    return AsyncEngine(EngineParts(core, core.tokenizer, "tiny", "test", "torch", {}), cfg)


async def collect(engine: AsyncEngine, req):
    """Every output of ``req``, or the NibbleError ``generate`` raised."""
    outs = []
    try:
        async for o in engine.generate(req):
            outs.append(o)
    except NibbleError as e:
        return e
    return outs


def no_grad_poison(pool, page: int) -> None:
    """Plant garbage in one page: 0xFF bytes are NaN in bf16 and NaN E4M3 block scales."""
    with torch.no_grad():
        pool.pages[page].fill_(0xFF)
