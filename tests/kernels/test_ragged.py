"""Ragged bottom-right causal attention against its fp32 reference (CPU; CUDA under ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels.errors import KernelInputError
from nibble.kernels.ragged import (choose_kernel, flash_applies, ragged_causal_attention,
                                   ragged_causal_attention_ref)
from nibble.kernels.ragged_cudnn import (dense_attention_ref, merge_by_lse, split_attention,
                                         split_plan, warm_plans)

# (cached prefix, new rows) per sequence: a prefill, extends, a one-row chunk, an empty chunk.
SEQS = [(0, 9), (24, 7), (5, 1), (40, 16), (3, 0)]


def _case(seqs, hq=8, h=2, d=64, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    nq = sum(n for _, n in seqs)
    nk = sum(c + n for c, n in seqs)
    q = torch.randn((nq, hq, d), generator=g).to(device, dtype)
    k = torch.randn((nk, h, d), generator=g).to(device, dtype)
    v = torch.randn((nk, h, d), generator=g).to(device, dtype)
    cq, ck = [0], [0]
    for c, n in seqs:
        cq.append(cq[-1] + n)
        ck.append(ck[-1] + c + n)
    cu = [torch.tensor(x, dtype=torch.int32, device=device) for x in (cq, ck)]
    return q, k, v, cu[0], cu[1], max(n for _, n in seqs), max(c + n for c, n in seqs)


@pytest.mark.parametrize("hq,h", [(8, 2), (4, 4), (6, 1)])
def test_matches_reference_on_cpu(hq, h):
    q, k, v, cq, ck, mq, mk = _case(SEQS, hq, h)
    got = ragged_causal_attention(q, k, v, cq, ck, mq, mk, 0.125)
    want = ragged_causal_attention_ref(q, k, v, cq, ck, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_causal_alignment_is_bottom_right():
    """The last query row sees every key; the first sees the prefix and itself only."""
    q, k, v, cq, ck, mq, mk = _case([(10, 4)], 2, 2, d=16)
    out = ragged_causal_attention(q, k, v, cq, ck, mq, mk, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[11:], v2[11:] = 100.0, 100.0        # keys after the first query's position
    out2 = ragged_causal_attention(q, k2, v2, cq, ck, mq, mk, 0.25)
    torch.testing.assert_close(out2[0], out[0])
    assert not torch.allclose(out2[3], out[3])


def test_refuses_bad_inputs():
    q, k, v, cq, ck, mq, mk = _case(SEQS)
    with pytest.raises(KernelInputError, match="multiple"):
        ragged_causal_attention(q[:, :7], k, v, cq, ck, mq, mk, 1.0)
    with pytest.raises(KernelInputError, match="int32"):
        ragged_causal_attention(q, k, v, cq.long(), ck, mq, mk, 1.0)
    with pytest.raises(KernelInputError, match="dtype"):
        ragged_causal_attention(q.half(), k, v, cq, ck, mq, mk, 1.0)
    bad = ck.clone()
    bad[1] = 3                              # 3 keys for 9 queries
    with pytest.raises(KernelInputError, match="keys for"):
        ragged_causal_attention(q, k, v, cq, bad, mq, mk, 1.0)
    assert not flash_applies(q)
    with pytest.raises(KernelInputError, match="cuDNN"):
        ragged_causal_attention(q, k, v, cq, ck, mq, mk, 1.0, kernel="cudnn")
    with pytest.raises(KernelInputError, match="one of"):
        ragged_causal_attention(q, k, v, cq, ck, mq, mk, 1.0, kernel="fa3")


def _spans(cq, ck):
    a, b = cq.tolist(), ck.tolist()
    return [(a[i], a[i + 1] - a[i], b[i], b[i + 1] - b[i]) for i in range(len(a) - 1)]


@pytest.mark.parametrize("hq,h", [(8, 2), (4, 4)])
@pytest.mark.parametrize("q_bucket,key_block,mid_block", [
    (1, 1, 0), (4, 8, 0), (16, 16, 0), (3, 64, 0), (4, 32, 8), (1, 16, 4), (3, 64, 9)])
def test_split_and_merge_match_reference(hq, h, q_bucket, key_block, mid_block):
    """The cuDNN route's composition (whole key blocks of the prefix without mask, whole mid
    blocks of the rest without mask, the rest through a causal square with dummy leading rows,
    rows padded to buckets, merged by log-sum-exp) with a torch dense attention in cuDNN's
    place."""
    seqs = SEQS + [(37, 5), (29, 3)]            # two and three parts with mid blocks of 8
    q, k, v, cq, ck, _, _ = _case(seqs, hq, h)
    got = split_attention(q, k, v, _spans(cq, ck), 0.125, dense_attention_ref, q_bucket,
                          key_block, mid_block=mid_block)
    want = ragged_causal_attention_ref(q, k, v, cq, ck, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mid_block", [0, 1024])
def test_split_plan_covers_every_key_once_with_few_dummy_rows(mid_block):
    """The calls read keys [0, c + n) once each, in order; the square's dummy rows stay below
    the mid block (below the key block without one); the square is the only masked call."""
    qb, kb = 512, 4096
    for c in list(range(0, 40000, 2040)) + [4095, 4096, 5119, 5120, 8191]:
        for n in (1, 128, 2040, 2048):
            calls = split_plan(c, n, qb, kb, mid_block)
            assert [x.key0 for x in calls] == [sum(x.keys for x in calls[:i])
                                              for i in range(len(calls))]
            assert sum(x.keys for x in calls) == c + n
            assert [x.causal for x in calls] == [False] * (len(calls) - 1) + [True]
            assert calls[-1].lead < (mid_block or kb) and calls[-1].rows % qb == 0
            for x in calls[:-1]:            # whole key blocks, then whole mid blocks
                assert x.lead == 0 and x.rows == -(-n // qb) * qb
                assert x.keys % kb == 0 or (mid_block and x.key0 % kb == 0
                                            and x.keys % mid_block == 0 and x.keys < kb)
    # a 2040-token chunk 8 chunks into a prompt (c = 16320): 4032 dummy rows without the
    # middle part, 960 with it
    assert split_plan(16320, 2040, qb, kb)[-1].lead == 4032
    assert split_plan(16320, 2040, qb, kb, 1024)[-1].lead == 960


def test_warm_plans_cover_every_shape_a_chunk_takes():
    """Each dense call split_attention makes, for any chunk up to the warmed size over any
    prefix inside the context, has a shape, stride pattern and mask warm_plans ran first."""
    def recorder(seen):
        def dense(q, k, v, causal, scale):
            seen.add((q.shape, k.shape, q.stride()[1:], k.stride()[1:], causal))
            return dense_attention_ref(q, k, v, causal, scale)
        return dense

    for mid in (0, 3, 5):
        warmed, used = set(), set()
        hq, h, d, chunk, context, qb, kb = 4, 2, 8, 10, 40, 4, 8
        assert warm_plans(hq, h, d, torch.float32, torch.device("cpu"), chunk, context, qb, kb,
                          recorder(warmed), mid_block=mid) == len(warmed)
        for n in range(1, chunk + 1):
            for c in range(0, context - n + 1, 3):
                q, k, v, cq, ck, _, _ = _case([(c, n)], hq, h, d)
                split_attention(q, k, v, _spans(cq, ck), 0.1, recorder(used), qb, kb,
                                mid_block=mid)
        assert used <= warmed, (mid, sorted(used - warmed)[:3])


def test_merge_by_lse_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 8, generator=g)
    k, v = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    o1, l1 = dense_attention_ref(q, k[:, :, :7], v[:, :, :7], False, 0.3)
    o2, l2 = dense_attention_ref(q, k[:, :, 7:], v[:, :, 7:], False, 0.3)
    whole, lse = dense_attention_ref(q, k, v, False, 0.3)
    torch.testing.assert_close(merge_by_lse(o1, l1, o2, l2), whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.logaddexp(l1, l2), lse)
    # a part whose keys are all far below the other's contributes nothing
    far = merge_by_lse(o1, l1 - 200.0, o2, l2)
    torch.testing.assert_close(far, o2)
    # three parts
    o3, l3 = dense_attention_ref(q, k[:, :, 7:10], v[:, :, 7:10], False, 0.3)
    o4, l4 = dense_attention_ref(q, k[:, :, 10:], v[:, :, 10:], False, 0.3)
    torch.testing.assert_close(merge_by_lse(o1, l1, o3, l3, o4, l4), whole, atol=1e-6, rtol=1e-5)


def test_choose_kernel_on_cpu():
    q = torch.zeros(300, 4, 64)
    assert choose_kernel(q, 1) == "sdpa"
    assert choose_kernel(q, 1, "fa2") == "sdpa"       # nothing fused to take on the CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
def test_flash_path_matches_reference(dtype, d):
    seqs = SEQS + [(1000, 300), (0, 513)]
    q, k, v, cq, ck, mq, mk = _case(seqs, 32, 8, d, dtype, "cuda")
    assert flash_applies(q)
    got = ragged_causal_attention(q, k, v, cq, ck, mq, mk, d ** -0.5)
    want = ragged_causal_attention_ref(q, k, v, cq, ck, d ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
def test_cudnn_path_matches_reference(dtype, d):
    seqs = SEQS + [(1000, 300), (0, 513), (9000, 700), (8192, 2048)]   # prefixes past KEY_BLOCK
    q, k, v, cq, ck, mq, mk = _case(seqs, 32, 8, d, dtype, "cuda")
    got = ragged_causal_attention(q, k, v, cq, ck, mq, mk, d ** -0.5, kernel="cudnn")
    want = ragged_causal_attention_ref(q, k, v, cq, ck, d ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_takes_cudnn_for_few_long_sequences_on_hopper():
    q = torch.zeros(2048, 32, 128, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert choose_kernel(q, 1) == ("cudnn" if hopper else "fa2")
    assert choose_kernel(q, 16) == "fa2"               # many sequences: one varlen launch
    assert choose_kernel(q, None) == "fa2"             # layout not on the host
    assert choose_kernel(q[:100], 1) == "fa2"          # short
