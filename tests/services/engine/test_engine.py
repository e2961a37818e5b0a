"""EngineCore end to end on a tiny random model: paths agree, batching is exact, nothing leaks."""

from __future__ import annotations

import torch

from nibble.services.engine.types import FinishReason, GenerateRequest, SamplingParams

from .conftest import make_engine, tiny_arch, tiny_model

TIE = 0.045  # twice the largest logit difference seen between paths (0.021)
PROMPT = [(7 * i + 3) % 90 + 1 for i in range(70)]


def run_all(engine, reqs):
    """Run requests to completion; return {rid: (token_ids, text, finish_reason, usage)}."""
    for r in reqs:
        engine.add_request(r)
    acc = {r.request_id: ([], "") for r in reqs}
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            ids, text = acc.setdefault(o.request_id, ([], ""))
            acc[o.request_id] = (ids + o.new_token_ids, text + o.text_delta)
            if o.finished:
                done[o.request_id] = (*acc[o.request_id], o.finish_reason, o.usage)
    if engine.tiers is not None:
        assert engine.tiers.drain(), "tier jobs did not finish"   # backups pin pages briefly
    assert engine.pool.allocator.num_free == engine.pool.num_pages, "pages leaked"
    return done


def greedy(rid, prompt=PROMPT, n=12, **kw):
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0.0,
                                                             ignore_eos=True, **kw))


def alone(model, req, **kw):
    """Run ``req`` alone; return its greedy tokens and the tie-free horizon.

    bf16 hidden states carry 2**-8 relative rounding; where the top-2 margin is
    below ``TIE``, a different summation order may flip the choice
    legitimately, so comparisons stop at the first such tie.
    """
    eng = make_engine(model, **kw)
    seen = capture_logits(eng)
    tokens = run_all(eng, [req])[req.request_id][0]
    tops = [l[0].topk(2).values for l in seen]
    ties = [i for i, t in enumerate(tops) if t[0] - t[1] <= TIE]
    return tokens, (ties[0] if ties else len(tokens))


def test_prefill_extend_and_decode_paths_give_identical_greedy_bf16(bf16_model):
    full, horizon = alone(bf16_model, greedy("a", n=16))
    assert horizon >= 8, f"the test model is too indecisive: first tie at {horizon}"
    for chunk in (16, 5, 1):                        # extend chunks; 1 = every prompt token decoded
        got = run_all(make_engine(bf16_model, chunked_prefill_size=chunk), [greedy("a", n=16)])
        assert got["a"][0][:horizon] == full[:horizon], chunk


def capture_logits(engine):
    seen = []
    orig = engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
    return seen


def first_logits(model, kv, **kw):
    eng = make_engine(model, kv=kv, **kw)
    seen = capture_logits(eng)
    run_all(eng, [greedy("a", n=1)])
    return seen[0][0]


def test_nvfp4_paths_agree_within_quantization_tolerance(fp32_model):
    ref = first_logits(fp32_model, "bf16")
    for kv in ("nvfp4", "fp8_e4m3"):
        full = first_logits(fp32_model, kv)
        chunked = first_logits(fp32_model, kv, chunked_prefill_size=16)
        stepwise = first_logits(fp32_model, kv, chunked_prefill_size=1)
        # Full prefill never reads the cache; the others read the quantized prefix.
        assert torch.allclose(full, ref, atol=2e-2, rtol=0)
        for other in (chunked, stepwise):
            rel = (other - ref).norm() / ref.norm()
            assert rel < (0.08 if kv == "nvfp4" else 0.03), (kv, rel)
            assert other.argmax() == ref.argmax()
    # The quantized cache really is used: NVFP4 differs from BF16 on the extend path.
    assert not torch.equal(first_logits(fp32_model, "nvfp4", chunked_prefill_size=16), ref)


def test_fp8_prefill_kv_dtype_runs_all_paths(fp32_model):
    ref = first_logits(fp32_model, "bf16")
    for chunk in (512, 16, 1):
        got = first_logits(fp32_model, "nvfp4", prefill_kv_dtype="fp8_e4m3", chunked_prefill_size=chunk)
        assert (got - ref).norm() / ref.norm() < 0.1


def test_continuous_batching_matches_running_alone(bf16_model):
    prompts = [PROMPT[:n] for n in (5, 33, 17, 64)]
    ref = {f"r{i}": alone(bf16_model, greedy(f"r{i}", p, n=6 + i)) for i, p in enumerate(prompts)}
    eng = make_engine(bf16_model, chunked_prefill_size=16, max_prefill_tokens=24)
    eng.add_request(greedy("r0", prompts[0], n=6))
    early = [t for _ in range(2) for o in eng.step() for t in o.new_token_ids]
    assert len(early) == 2                           # r0 is decoding when the others join
    got = run_all(eng, [greedy(f"r{i}", p, n=6 + i) for i, p in enumerate(prompts) if i])
    got["r0"] = (early + got["r0"][0],)
    for rid, (tokens, horizon) in ref.items():
        assert len(got[rid][0]) == len(tokens) and got[rid][0][:horizon] == tokens[:horizon], rid


def test_preemption_under_a_tiny_pool_changes_nothing(bf16_model):
    # The four most decisive of twelve candidate prompts (fewest early near-ties).
    cands = [greedy(f"p{i}", PROMPT[i:i + 24 + 3 * (i % 4)], n=20) for i in range(12)]
    ref = {r.request_id: alone(bf16_model, r) for r in cands}
    reqs = sorted(cands, key=lambda r: -ref[r.request_id][1])[:4]
    tight = make_engine(bf16_model, num_pages=6,    # 96 tokens for 4 requests of 44-53 tokens
                        schedule_conservativeness=0.0)
    got = run_all(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    for r in reqs:
        tokens, horizon = ref[r.request_id]
        assert horizon >= 6, "too many rounding ties for a meaningful test"
        assert len(got[r.request_id][0]) == 20
        assert got[r.request_id][0][:horizon] == tokens[:horizon], r.request_id


def test_stop_conditions_and_usage(bf16_model):
    eng = make_engine(bf16_model)
    base = run_all(eng, [greedy("g", n=10)])["g"]
    text = base[1]
    stop = text[3:5]
    got = run_all(eng, [greedy("s", n=10, stop=(stop,))])["s"]
    assert got[1] == text[:text.index(stop)] and got[2] is FinishReason.STOP
    tok = base[0][4]
    got = run_all(eng, [greedy("t", n=10, stop_token_ids=(tok,))])["t"]
    assert got[0] == base[0][:base[0].index(tok) + 1] and got[2] is FinishReason.STOP
    assert base[2] is FinishReason.LENGTH
    assert (base[3].prompt_tokens, base[3].completion_tokens, base[3].cached_tokens) == (70, 10, 0)


def test_seeded_sampling_is_reproducible(fp32_model):
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a = run_all(make_engine(fp32_model), [GenerateRequest("x", PROMPT[:9], sp)])["x"][0]
    b = run_all(make_engine(fp32_model), [GenerateRequest("x", PROMPT[:9], sp),
                                          greedy("other", PROMPT[:30])])["x"][0]
    assert a == b


def test_abort_frees_pages_mid_stream(bf16_model):
    eng = make_engine(bf16_model)
    eng.add_request(greedy("a", n=50))
    eng.add_request(greedy("b", n=50))
    for _ in range(3):
        eng.step()
    assert eng.pool.allocator.num_free < eng.pool.num_pages
    out = eng.abort("a")
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert eng.abort("a") is None
    eng.abort("b")
    assert eng.pool.allocator.num_free == eng.pool.num_pages and not eng.has_unfinished()


def test_eos_stops_unless_ignored():
    model = tiny_model(tiny_arch(), torch.float32, seed=3)
    with torch.no_grad():
        model.lm_head[0].mul_(0).add_(model.norm.new_ones(()) * 0)   # logits for EOS = bias 0 ...
        model.lm_head[0] += 50.0                                     # ... then always the top token
    eng = make_engine(model)
    r = run_all(eng, [GenerateRequest("e", PROMPT[:8], SamplingParams(max_tokens=5, temperature=0))])["e"]
    assert r[0] == [0] and r[1] == "" and r[2] is FinishReason.STOP
    r = run_all(eng, [greedy("i", PROMPT[:8], n=5)])["i"]
    assert r[0] == [0] * 5 and r[2] is FinishReason.LENGTH
