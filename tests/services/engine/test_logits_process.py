"""Logit processing and log-probabilities (services/engine/logits_process.py), against
straight per-token reference loops; and through a real EngineCore, against the model's own
logits."""

from __future__ import annotations

import math

import pytest
import torch

from nibble.services.engine.logits_process import logprobs_of, process_logits
from nibble.services.engine.sampling import sample
from nibble.services.engine.types import GenerateRequest, SamplingParams, ScheduledSeq

from .conftest import make_engine
from .test_engine import PROMPT, run_all

V = 12


def entry(sp: SamplingParams, history=None, num_output=0) -> ScheduledSeq:
    return ScheduledSeq("r", [1], 0, 0, [0], True, sp, num_output,
                        None if history is None else tuple(history))


def reference(row: list[float], sp: SamplingParams, history: list[int], num_output: int,
              eos: set[int]) -> list[float]:
    """The rules, one token at a time."""
    out = list(row)
    gen = history[len(history) - num_output:]
    for t in range(V):
        if t in history and sp.repetition_penalty != 1.0:
            out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
        c = gen.count(t)
        out[t] -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0)
    for t, b in sp.logit_bias:
        out[t] += b
    if num_output < sp.min_tokens:
        for t in set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos):
            out[t] = -math.inf
    return out


@pytest.mark.parametrize("sp", [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
    SamplingParams(logit_bias=((3, 5.0), (7, -100.0))),
    SamplingParams(min_tokens=4, stop_token_ids=(5,)),
    SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=(5,)),
    SamplingParams(repetition_penalty=0.8, presence_penalty=1.0, logit_bias=((0, 2.0),),
                   min_tokens=1),
])
def test_processing_matches_the_rules(sp):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=g)
    history = [3, 3, 9, 1, 4, 4, 4, 11]          # the last 5 generated
    picked = [entry(sp, history, 5 if sp.min_tokens <= 1 else 2), entry(SamplingParams())]
    got = process_logits(logits, picked, frozenset({0}))
    want = reference(logits[0].tolist(), sp, history, picked[0].num_output, {0})
    assert torch.allclose(got[0], torch.tensor(want), atol=1e-6)
    assert torch.equal(got[1], logits[1])          # a row asking nothing is untouched


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sp = SamplingParams(temperature=1.0, min_p=0.4, seed=0)
    seen = {int(sample(logits, [sp], [torch.Generator().manual_seed(s)])[0]) for s in range(200)}
    assert seen == {0, 1}                          # 0.15 < 0.4 * 0.5


def test_logprobs_are_log_softmax_after_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g)
    picked = [entry(SamplingParams(temperature=0.5, logprobs=3)), entry(SamplingParams()),
              entry(SamplingParams(temperature=0.0, logprobs=0))]
    tokens = torch.tensor([4, 2, 7])
    lps = logprobs_of(logits, picked, tokens).to_host(tokens.tolist())
    ref0 = torch.log_softmax(logits[0] / 0.5, -1)
    assert set(lps) == {0, 2}
    assert abs(lps[0].logprob - float(ref0[4])) < 1e-6 and lps[0].token_id == 4
    top = ref0.topk(3)
    assert [t for t, _ in lps[0].top] == top.indices.tolist()
    assert lps[2].top == () and abs(lps[2].logprob - float(torch.log_softmax(logits[2], -1)[7])) < 1e-6


def test_engine_logprobs_equal_the_model_logits(fp32_model):
    """Through a real engine (fp32, CPU): every streamed token's logprob is log_softmax of
    the logits the torch reference computed for that step, within 1e-4."""
    eng = make_engine(fp32_model)
    seen = []
    orig = eng.runner._sample
    eng.runner._sample = lambda picked, logits: (seen.append(logits.clone()), orig(picked, logits))[1]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    eng.add_request(GenerateRequest("x", PROMPT[:20], sp))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(lps) == len(tokens) == 6 == len(seen)
    for lp, tok, logits in zip(lps, tokens, seen):
        ref = torch.log_softmax(logits[0].double(), -1)
        assert lp.token_id == tok and abs(lp.logprob - float(ref[tok])) < 1e-4
        assert lp.top[0][0] == tok                                  # greedy: the top token
        assert all(abs(v - float(ref[t])) < 1e-4 for t, v in lp.top) and len(lp.top) == 5


def test_penalties_and_min_tokens_run_synchronously_under_overlap(fp32_model):
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
                        min_tokens=3, logprobs=2)
    ref = run_all(make_engine(fp32_model), [GenerateRequest("p", PROMPT[:15], sp)])["p"]
    eng = make_engine(fp32_model, overlap=True)
    got = run_all(eng, [GenerateRequest("p", PROMPT[:15], sp)])["p"]
    assert got == ref and eng.overlap.launches == 0


def test_logprobs_of_launched_steps_equal_synchronous_ones(fp32_model):
    """Overlapped decode steps carry logprobs through their host copy: same values."""
    def run(overlap):
        eng = make_engine(fp32_model, overlap=overlap)
        for i in range(3):
            eng.add_request(GenerateRequest(f"q{i}", PROMPT[i:i + 17], SamplingParams(
                max_tokens=7, temperature=0.7, seed=i, ignore_eos=True, logprobs=2, min_p=0.05)))
        got = {}
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(
                    (lp.token_id, round(lp.logprob, 5), lp.top) for lp in o.logprobs or [])
        return got, eng
    ref, _ = run(False)
    got, eng = run(True)
    assert eng.overlap.launches > 0 and all(len(v) == 7 for v in got.values())
    assert {k: [(t, lp) for t, lp, _ in v] for k, v in got.items()} == \
        {k: [(t, lp) for t, lp, _ in v] for k, v in ref.items()}


def _last_logits(fp32_model, prompt: list[int]) -> torch.Tensor:
    """The logits a fresh engine samples the first token of ``prompt`` from."""
    eng = make_engine(fp32_model, radix=False)
    seen = []
    orig = eng.runner._sample
    eng.runner._sample = lambda picked, logits: (seen.append(logits.clone()), orig(picked, logits))[1]
    run_all(eng, [GenerateRequest("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))])
    return seen[0][0]


def _prompt_logprobs(eng, rid: str, prompt: list[int]):
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, logprobs=1)
    eng.add_request(GenerateRequest(rid, prompt, sp))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert outs[0].usage.cached_tokens == 0       # a cached prompt is computed again, scored
    plp = outs[0].prompt_logprobs
    assert [lp.token_id for lp in plp] == prompt and plp[0].logprob is None
    return plp


def test_prompt_logprobs_score_every_prompt_token(fp32_model):
    """echo with logprobs: each prompt token's logprob equals log_softmax of the logits a
    request ending just before it samples from (fp32, CPU, within 1e-4)."""
    prompt = PROMPT[:13]
    eng = make_engine(fp32_model)
    for rid in ("first", "again"):
        plp = _prompt_logprobs(eng, rid, prompt)
    for p in range(1, len(prompt)):
        ref = torch.log_softmax(_last_logits(fp32_model, prompt[:p]).double(), -1)
        assert abs(plp[p].logprob - float(ref[prompt[p]])) < 1e-4, p
        assert len(plp[p].top) == 3
        assert all(abs(v - float(ref[t])) < 1e-4 for t, v in plp[p].top)


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_prompt_logprobs_across_prefill_chunks(fp32_model, kv):
    """Chunks of 5 score the same tokens as one chunk; the later chunks read the earlier
    ones' K/V from the cache, so they agree to the KV format's rounding."""
    prompt = PROMPT[:13]
    whole = _prompt_logprobs(make_engine(fp32_model, kv=kv), "w", prompt)
    chunked = _prompt_logprobs(make_engine(fp32_model, kv=kv, chunked_prefill_size=5), "c",
                               prompt)
    tol = 0.02 if kv == "bf16" else 0.3
    for a, b in zip(whole[1:], chunked[1:]):
        assert abs(a.logprob - b.logprob) < tol
    for a, b in zip(whole[1:6], chunked[1:6]):   # the first chunk reads no cache: the same
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
