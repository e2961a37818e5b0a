"""bench/prefill_profile.py's decode riders, on a scripted engine core (no model)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from nibble.bench.prefill_profile import start_riders


class ScriptedCore:
    """Records requests; request ``rider{i}`` gets its first token at step ``i + 2``."""

    def __init__(self):
        self.requests, self.steps = [], 0

    def add_request(self, req):
        self.requests.append(req)

    def step(self):
        self.steps += 1
        return [SimpleNamespace(request_id=r.request_id, new_token_ids=[1])
                for i, r in enumerate(self.requests) if self.steps == i + 2]


def test_riders_are_added_and_run_until_each_decodes():
    core = ScriptedCore()
    args = argparse.Namespace(decode_riders=3, rider_len=7)
    start_riders(core, args, steps=40, gen=torch.Generator().manual_seed(0), vocab=100)
    assert [r.request_id for r in core.requests] == ["rider0", "rider1", "rider2"]
    assert all(len(r.prompt_token_ids) == 7 for r in core.requests)
    assert {r.sampling.max_tokens for r in core.requests} == {40}
    assert all(r.sampling.ignore_eos for r in core.requests)
    assert core.steps == 4                     # rider2's first token came at step 4


def test_no_riders_runs_no_step():
    core = ScriptedCore()
    start_riders(core, argparse.Namespace(decode_riders=0, rider_len=7), 10,
                 torch.Generator().manual_seed(0), 100)
    assert core.requests == [] and core.steps == 0
