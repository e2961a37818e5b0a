"""Overlap scheduling (services/engine/overlap.py) through a real EngineCore, on the CPU.

On the CPU a launched step has finished when ``launch`` returns, but the bookkeeping is
the GPU's: placeholders, input ids read from the previous step's tensor, stop conditions
one step late with the extra token dropped, faults rolled back. Every scenario must give
exactly what the synchronous engine gives, leak no page, and really overlap.
"""

from __future__ import annotations

import pytest

from nibble.services.engine.types import FinishReason, GenerateRequest, SamplingParams

from .conftest import make_engine
from .faulty import inject, pages_balance, run_outputs
from .test_engine import PROMPT, greedy, run_all


def both(model, reqs_fn, **kw):
    """``run_all`` of the same requests without and with overlap; the overlapped engine."""
    ref = run_all(make_engine(model, **kw), reqs_fn())
    eng = make_engine(model, overlap=True, **kw)
    got = run_all(eng, reqs_fn())
    return ref, got, eng


def mixed():
    """Different lengths, a stop token, a stop string, EOS honoured, seeded sampling."""
    sp = SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    return [greedy("a", PROMPT[:21], n=12), greedy("b", PROMPT[5:45], n=3),
            greedy("c", PROMPT[:21], n=7, stop_token_ids=(PROMPT[3],)),
            GenerateRequest("d", PROMPT[9:30], sp),
            GenerateRequest("e", PROMPT[2:19], SamplingParams(max_tokens=10, temperature=0.0)),
            greedy("f", PROMPT[1:18], n=1)]


def test_overlapped_steps_give_what_synchronous_steps_give(fp32_model):
    ref, got, eng = both(fp32_model, mixed, chunked_prefill_size=16, max_prefill_tokens=40)
    assert got == ref
    assert eng.overlap.launches >= 6          # the decode steps really were launched ahead
    pages_balance(eng)


def test_stop_strings_and_token_stops_one_step_late(fp32_model):
    base = run_all(make_engine(fp32_model), [greedy("g", n=10)])["g"]
    stop_tok, stop_str = base[0][4], base[1][3:5]

    def reqs():
        return [greedy("t", n=10, stop_token_ids=(stop_tok,)), greedy("s", n=10, stop=(stop_str,)),
                greedy("long", PROMPT[3:40], n=16)]
    ref, got, eng = both(fp32_model, reqs)
    assert got == ref
    assert got["t"][2] is FinishReason.STOP and got["s"][2] is FinishReason.STOP
    assert got["t"][3].completion_tokens == 5     # the extra token in flight was dropped
    pages_balance(eng)


def test_preemption_with_tokens_in_flight(fp32_model):
    def reqs():
        return [greedy(f"p{i}", PROMPT[i:i + 24 + 3 * (i % 4)], n=20) for i in range(4)]
    ref, got, eng = both(fp32_model, reqs, num_pages=6, schedule_conservativeness=0.0)
    assert eng.scheduler.num_preemptions > 0
    assert got == ref
    pages_balance(eng)


def test_abort_while_a_step_is_in_flight(fp32_model):
    ref = run_all(make_engine(fp32_model), [greedy("b", n=8)])["b"]
    eng = make_engine(fp32_model, overlap=True)
    eng.add_request(greedy("a", n=50))
    eng.add_request(greedy("b", n=8))
    tokens = {"a": [], "b": []}
    for _ in range(3):
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
    assert eng.overlap.inflight is not None
    out = eng.abort("a")
    assert out.finished and out.finish_reason is FinishReason.ABORT
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == "b"            # a's landed token is stale: dropped
            tokens["b"] += o.new_token_ids
    assert tokens["b"] == ref[0]
    pages_balance(eng)


@pytest.mark.parametrize("at", [3, 5])
def test_nan_logits_in_a_launched_step_fail_only_that_request(fp32_model, at):
    prompts = {f"r{i}": PROMPT[4 * i:4 * i + 21 + 5 * i] for i in range(4)}

    def run(overlap):
        eng = make_engine(fp32_model, overlap=overlap)
        runner = inject(eng)
        got = run_outputs(eng, [greedy(r, p, n=10) for r, p in prompts.items()],
                          on_step=lambda i: runner.nan_for.symmetric_difference_update(
                              {"r1"} if i in (at, at + 1) else ()))
        return got, eng
    ref, _ = run(False)
    got, eng = run(True)
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == ref[rid], rid
    tokens, reason, error, etype = got["r1"]
    assert (reason, etype) == (FinishReason.ABORT, "RequestFaultError") and "non-finite" in error
    assert tokens == ref["r1"][0][:len(tokens)] and len(tokens) >= at - 2
    assert eng.overlap.launches > 0
    pages_balance(eng)


def test_a_launch_that_raises_runs_the_step_synchronously(fp32_model):
    ref = run_outputs(make_engine(fp32_model), [greedy("x", n=6), greedy("y", PROMPT[7:30], n=6)])
    eng = make_engine(fp32_model, overlap=True)
    runner = inject(eng, raise_for={"y"})
    got = run_outputs(eng, [greedy("x", n=6), greedy("y", PROMPT[7:30], n=6)])
    assert got["x"] == ref["x"]
    assert got["y"][1] is FinishReason.ABORT and got["y"][3] == "RequestFaultError"
    assert runner.executions > 0                 # the isolator ran the synchronous path
    pages_balance(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["nvfp4", "fp8_e4m3"])
def test_overlap_on_the_gpu_with_cuda_graphs(kv):
    """The real thing: launched steps replay CUDA graphs whose input ids come from the
    previous step's device tensor; the tokens equal the synchronous engine's."""
    import torch
    from tests.services.attention.conftest import make_engine_with, tiny_arch, tiny_model
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_model(tiny_arch("qwen3", head_dim=64), torch.float32).cuda()

    def engine(overlap):
        return make_engine_with(model, "triton", kv=kv, device="cuda", graph_max_bs=8,
                                use_graphs=True, overlap=overlap, chunked_prefill_size=16,
                                max_prefill_tokens=40)
    ref = run_all(engine(False), mixed())
    eng = engine(True)
    got = run_all(eng, mixed())
    assert got == ref
    assert eng.overlap.launches >= 6 and eng.runner.graphs.replays >= 6
    pages_balance(eng)


def test_prompt_chunks_are_launched_ahead_beside_decodes(fp32_model):
    """A long prompt's chunks that sample nothing are launched like decode steps, beside the
    running decodes; its last chunk (which samples) runs synchronously. Same tokens."""
    def reqs():
        return [greedy("d", PROMPT[:9], n=14), greedy("long", PROMPT[2:60], n=4),
                greedy("late", PROMPT[11:50], n=5)]
    ref, got, eng = both(fp32_model, reqs, chunked_prefill_size=8, max_prefill_tokens=12)
    assert got == ref
    assert eng.overlap.chunk_launches >= 6
    pages_balance(eng)


def test_prompt_chunks_in_flight_survive_preemption(fp32_model):
    def reqs():
        return [greedy(f"q{i}", PROMPT[i:i + 30 + 4 * i], n=12) for i in range(4)]
    ref, got, eng = both(fp32_model, reqs, num_pages=7, schedule_conservativeness=0.0,
                         chunked_prefill_size=8, max_prefill_tokens=16)
    assert eng.scheduler.num_preemptions > 0 and eng.overlap.chunk_launches > 0
    assert got == ref
    pages_balance(eng)


def test_a_synchronous_step_never_hands_a_stream_two_tokens_at_once(fp32_model):
    """A prompt's last chunk runs synchronously after launched chunks: the launched step's
    tokens go out before it runs, so a decoding stream gets one token per step() and never
    waits two steps for one (the inter-token latency a user sees)."""
    eng = make_engine(fp32_model, overlap=True, chunked_prefill_size=16, max_prefill_tokens=40)
    eng.add_request(greedy("a", PROMPT[:10], n=30))
    got = []
    while len(got) < 3:
        got += [t for o in eng.step() if o.request_id == "a" for t in o.new_token_ids]
    eng.add_request(greedy("b", PROMPT[20:70], n=3))      # chunks of 16, 16, 16, then 2
    most = 0
    while eng.has_unfinished():
        outs = eng.step()
        most = max(most, sum(len(o.new_token_ids) for o in outs if o.request_id == "a"))
        got += [t for o in outs if o.request_id == "a" for t in o.new_token_ids]
    assert eng.overlap.chunk_launches >= 2             # b's middle chunks were launched
    assert most == 1
    ref = run_all(make_engine(fp32_model), [greedy("a", PROMPT[:10], n=30)])["a"][0]
    assert got == ref


def test_a_prompts_last_chunk_is_launched_and_its_pages_cached(fp32_model):
    """A prompt's last chunk is launched like a decode step (no synchronous step, so no
    pipeline gap at a prompt's end); its first token lands one step later, the prompt's
    pages go to the prefix cache then, so a request arriving while it decodes reuses
    them. Same tokens as the synchronous engine."""
    def reqs():
        return [greedy("d", PROMPT[:9], n=14), greedy("long", PROMPT[2:60], n=4),
                greedy("late", PROMPT[11:50], n=5), greedy("one", PROMPT[20:41], n=1)]
    ref, got, eng = both(fp32_model, reqs, chunked_prefill_size=8, max_prefill_tokens=12)
    assert got == ref
    assert eng.overlap.first_token_launches >= 3
    pages_balance(eng)
    eng = make_engine(fp32_model, overlap=True, chunked_prefill_size=8, max_prefill_tokens=12)
    eng.add_request(greedy("long", PROMPT[2:60], n=8))
    while not any(o.request_id == "long" and o.new_token_ids for o in eng.step()):
        pass
    assert eng.overlap.first_token_launches == 1
    eng.add_request(greedy("again", PROMPT[2:60], n=2))     # "long" is still decoding
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["again"].usage.cached_tokens >= 48, "the launched prompt's pages were not cached"
    pages_balance(eng)


def test_nan_in_a_launched_last_chunk_keeps_the_prompt(fp32_model):
    """The first token of a launched last chunk comes back NaN: the request fails alone;
    the roll-back keeps its prompt ids (a decode's roll-back cuts after one id)."""
    prompts = {"a": PROMPT[:30], "b": PROMPT[3:40]}

    def run(overlap):
        eng = make_engine(fp32_model, overlap=overlap, chunked_prefill_size=16,
                          max_prefill_tokens=40)
        runner = inject(eng, nan_for={"b"})
        seen = []
        orig = eng.overlap._roll_back if overlap else None
        if overlap:
            def spy(seq, entry):
                orig(seq, entry)
                seen.append((list(seq.token_ids), seq.num_computed))
            eng.overlap._roll_back = spy
        got = run_outputs(eng, [greedy(r, p, n=6) for r, p in prompts.items()])
        return got, eng, runner, seen
    ref, *_ = run(False)
    got, eng, _, seen = run(True)
    assert got["a"] == ref["a"]
    assert got["b"][1] is FinishReason.ABORT and got["b"][3] == "RequestFaultError"
    assert eng.overlap.first_token_launches >= 1
    assert seen and seen[0][0] == list(prompts["b"]) and 0 < seen[0][1] < len(prompts["b"])
    pages_balance(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_launched_steps_never_wait_for_the_device(fused):
    """A launched step (prompt chunks beside decodes, a prompt's last chunk, decodes) is
    planned and enqueued without one host sync, else the host would wait for the step still
    running and overlap scheduling would hide nothing: torch's sync debug mode raises on any
    (a blocking host copy, ``.item()``, ``.tolist()`` of a device tensor) inside the launch,
    and a launch that raised would have run synchronously instead (counted here)."""
    import torch
    from tests.services.attention.conftest import make_engine_with, tiny_arch, tiny_model
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_model(tiny_arch("qwen3", head_dim=64), torch.float32).cuda()

    def engine(overlap):
        return make_engine_with(model, "triton", kv="nvfp4", device="cuda", graph_max_bs=8,
                                use_graphs=True, overlap=overlap, chunked_prefill_size=16,
                                max_prefill_tokens=40, disable_fused_kernels=not fused)
    ref = run_all(engine(False), mixed())
    eng = engine(True)
    real, kinds = eng.overlap._launch, []

    def guarded(batch, prev):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = real(batch, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        chunks = any(len(e.token_ids) > 1 for e in batch.seqs)
        kinds.append("fell back" if launched is None else "chunks" if chunks else "decode")
        return launched
    eng.overlap._launch = guarded
    assert run_all(eng, mixed()) == ref
    assert "fell back" not in kinds, kinds
    assert kinds.count("chunks") >= 2 and kinds.count("decode") >= 4, kinds
