"""The decode graph runner: buckets, padding, and equality with eager decode.

On CPU the runner's static-buffer path (``use_graphs=False``) runs the same
copying and padding as a CUDA graph replay, through the Triton backend under
Triton's interpreter; on a GPU (``gpu`` marker) real graphs are captured.
"""

from __future__ import annotations

import pytest
import torch

from nibble.services.engine.cuda_graph import DecodeBuffers, DecodeGraphRunner, graph_buckets
from nibble.services.engine.types import SamplingParams, ScheduledSeq
from nibble.services.errors import ConfigError

from ..attention.conftest import greedy, make_engine_with, prompt, run_scenario, tiny_arch, tiny_model


def test_buckets():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(10) == (1, 2, 4, 8, 10)
    assert graph_buckets(64)[-3:] == (48, 56, 64)
    with pytest.raises(ConfigError):
        graph_buckets(0)


def test_torch_backend_refused():
    model = tiny_model(tiny_arch("qwen3", head_dim=64))
    eng = make_engine_with(model, "torch")
    with pytest.raises(ConfigError, match="CUDA graphs"):
        DecodeGraphRunner(model, eng.runner.backend, torch.device("cpu"), 4, 512, 16, False)


def _seq(rid, pos, table, tok=5, sample=True, n_tokens=1):
    return ScheduledSeq(rid, [tok] * n_tokens, pos, pos, table, sample, SamplingParams())


def test_fill_pads_rows_and_applies_only_to_pure_decode():
    model = tiny_model(tiny_arch("qwen3", head_dim=64))
    eng = make_engine_with(model, "triton")
    runner = DecodeGraphRunner(model, eng.runner.backend, torch.device("cpu"), 8, 512, 16, False)
    assert runner.max_pages == 32 and runner.bucket(3) == 4 and runner.bucket(5) == 8
    seqs = [_seq("a", 17, [4, 9], tok=11), _seq("b", 3, [7], tok=12), _seq("c", 40, [1, 2, 3])]
    assert runner.applies(seqs)
    assert not runner.applies(seqs + [_seq("d", 0, [5])])                  # a prefill
    assert not runner.applies([_seq("e", 8, [5], n_tokens=2)])             # an extend
    assert not runner.applies([_seq("f", 8, [5], sample=False)])
    assert not runner.applies([_seq(str(i), 3, [1]) for i in range(9)])    # above max_bs
    runner.buf.slots.fill_(123)
    runner._fill(seqs, 16, 4)
    b: DecodeBuffers = runner.buf
    assert b.input_ids[:4].tolist() == [11, 12, 5, 0]
    assert b.positions[:4].tolist() == [17, 3, 40, 0]
    assert b.seq_lens[:4].tolist() == [18, 4, 41, 1]
    assert b.slots[:4].tolist() == [9 * 16 + 1, 7 * 16 + 3, 3 * 16 + 8, -1]
    assert b.slots[4].item() == 123, "rows past the bucket are left alone"
    assert b.block_tables[0, :2].tolist() == [4, 9] and b.block_tables[2, :3].tolist() == [1, 2, 3]


def _arrivals():
    """Five sequences: decode batches of 1..5 rows, so bucket 4 pads and 5 > max_bs runs eagerly."""
    return {0: [greedy("a", prompt(21), 9), greedy("b", prompt(17, 1), 12)],
            2: [greedy("c", prompt(40, 2), 7)],
            4: [greedy("d", prompt(5, 3), 6), greedy("e", prompt(33, 4), 5)]}


@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_static_path_equals_eager(kv):
    model = tiny_model(tiny_arch("qwen3", head_dim=64))
    eager = make_engine_with(model, "triton", kv=kv)
    ref, ref_tok, _ = run_scenario(eager, _arrivals())
    graphed = make_engine_with(model, "triton", kv=kv, graph_max_bs=4)
    got, got_tok, _ = run_scenario(graphed, _arrivals())
    assert graphed.runner.graphs.replays >= 5
    assert got_tok == ref_tok
    assert len(got) == len(ref)
    # graph steps compute logits for the whole bucket; rows past the batch are padding
    worst = max(float((g[:r.shape[0]] - r).abs().max()) for g, r in zip(got, ref))
    assert worst < 1e-4, f"static decode path differs from eager by {worst:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "nvfp4"])
def test_cuda_graph_replay_equals_eager(kv):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_model(tiny_arch("qwen3", head_dim=128, num_heads=8, num_kv_heads=2),
                       torch.bfloat16).to("cuda")
    arrivals = dict(_arrivals())
    arrivals[1] = [greedy("long", prompt(300, 5), 8)]     # split-K over > 256 tokens
    eager = make_engine_with(model, "triton", kv=kv, device="cuda", num_pages=128)
    _, ref_tok, _ = run_scenario(eager, arrivals)
    graphed = make_engine_with(model, "triton", kv=kv, device="cuda", num_pages=128,
                               graph_max_bs=4, use_graphs=True)
    _, got_tok, _ = run_scenario(graphed, arrivals)
    assert graphed.runner.graphs.replays >= 3
    assert got_tok == ref_tok
