"""The fused log-sum-exp merge of the cuDNN prefill route against its torch form."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import KernelInputError
from nibble.kernels.ragged import ragged_causal_attention_ref
from nibble.kernels.ragged_cudnn import dense_attention_ref, merge_into, split_attention
from nibble.kernels.triton.lse_merge import merge_lse_into

HAS_CUDA = torch.cuda.is_available()
CPU = pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA,
                                                  reason="interpreter only without CUDA"))
GPU = pytest.param("cuda", marks=pytest.mark.gpu)
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _parts(hq, s, d, dtype, device, gen, bshd):
    """Two partial outputs [1, Hq, S, D] (heads-first views of [S, Hq, D] storage when bshd,
    as cuDNN returns them for token-major inputs) and their fp32 lse [1, Hq, S]."""
    def one(scale):
        if bshd:
            o = torch.randn(s, hq, d, generator=gen).transpose(0, 1).unsqueeze(0)
        else:
            o = torch.randn(1, hq, s, d, generator=gen)
        lse = torch.randn(1, hq, s, generator=gen) * scale
        return o.to(dtype).to(device), lse.to(device)
    return one(3.0), one(30.0)       # the second part's lse spans a far wider range


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bshd", [True, False])
def test_merge_matches_torch_form(device, dtype, bshd):
    gen = torch.Generator().manual_seed(3)
    hq, d, s, n = (32, 128, 2100, 2048) if device == "cuda" else (4, 16, 45, 37)
    (o1, l1), (o2, l2) = _parts(hq, s, d, dtype, device, gen, bshd)
    # out: rows [5, 5 + n) of a bigger step output, so its row stride is not n's
    big = torch.full((n + 9, hq, d), float("nan"), dtype=dtype, device=device)
    want = torch.full_like(big, float("nan"))
    merge_lse_into(big[5:5 + n], o1, l1, o2, l2)
    merge_into(want[5:5 + n], o1, l1, o2, l2)
    assert torch.isnan(big[:5]).all() and torch.isnan(big[5 + n:]).all()   # nothing else written
    got, ref = big[5:5 + n].double(), want[5:5 + n].double()
    assert torch.isfinite(got).all()
    assert float((got - ref).norm() / ref.norm()) < TOL[dtype]


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_three_part_merge_matches_torch_form(device, dtype):
    """The split's middle part (whole mid blocks of the prefix) makes three parts."""
    gen = torch.Generator().manual_seed(6)
    hq, d, s, n = (32, 128, 2100, 2048) if device == "cuda" else (4, 16, 45, 37)
    (o1, l1), (o2, l2) = _parts(hq, s, d, dtype, device, gen, True)
    (o3, l3), _ = _parts(hq, s, d, dtype, device, gen, False)
    got = torch.full((n, hq, d), float("nan"), dtype=dtype, device=device)
    want = torch.empty_like(got)
    merge_lse_into(got, o1, l1, o2, l2, o3, l3)
    merge_into(want, o1, l1, o2, l2, o3, l3)
    two = merge_into(torch.empty_like(got), o1, l1, o2, l2)
    assert torch.isfinite(got).all()
    assert float((got.double() - want.double()).norm() / want.double().norm()) < TOL[dtype]
    assert not torch.allclose(got.float(), two.float(), atol=1e-2)   # the third part counts


def test_merge_with_an_empty_part_is_the_other_part():
    """lse = -inf (a part with no visible keys) gives weight 0 to that part."""
    gen = torch.Generator().manual_seed(4)
    (o1, l1), (o2, l2) = _parts(2, 8, 16, torch.float32, "cpu", gen, False)
    l1[..., 3] = float("-inf")
    out = torch.empty(8, 2, 16)
    merge_lse_into(out, o1, l1, o2, l2)
    torch.testing.assert_close(out[3], o2[0, :, 3])


def test_split_attention_with_the_fused_merge_matches_reference():
    """The whole cuDNN-route composition with the Triton merge, cuDNN's dense call replaced
    by a torch one: two sequences with prefixes that split into whole key blocks."""
    gen = torch.Generator().manual_seed(5)
    hq, h, d = 4, 2, 16
    seqs = [(19, 7), (0, 5), (40, 11)]                  # (cached prefix c, chunk n)
    q = torch.randn(sum(n for _, n in seqs), hq, d, generator=gen)
    k = torch.randn(sum(c + n for c, n in seqs), h, d, generator=gen)
    v = torch.randn_like(k)
    spans, qs, ks = [], 0, 0
    for c, n in seqs:
        spans.append((qs, n, ks, c + n))
        qs, ks = qs + n, ks + c + n
    cu_q = torch.tensor([0] + [s[0] + s[1] for s in spans], dtype=torch.int32)
    cu_k = torch.tensor([0] + [s[2] + s[3] for s in spans], dtype=torch.int32)
    want = ragged_causal_attention_ref(q, k, v, cu_q, cu_k, 0.25)
    for mid in (0, 2, 3):                   # mid blocks: two and three parts to merge
        got = split_attention(q, k, v, spans, 0.25, dense_attention_ref, 4, 8,
                              merge=merge_lse_into, mid_block=mid)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case,message", [
    (dict(out=torch.empty(4, 2, 12)), "power of two"),
    (dict(o1=torch.empty(1, 3, 8, 16)), "o1 must be"),
    (dict(o2=torch.empty(1, 2, 3, 16)), "o2 must be"),
    (dict(lse1=torch.empty(1, 2, 8, dtype=torch.float16)), "lse1 must be"),
    (dict(out=torch.empty(4, 2, 32)[..., ::2]), "unit inner stride"),
    (dict(o3=torch.empty(1, 2, 8, 16)), "come together"),
    (dict(o3=torch.empty(1, 2, 3, 16), lse3=torch.empty(1, 2, 8)), "o3 must be"),
])
def test_rejects_bad_inputs(case, message):
    args = dict(out=torch.empty(4, 2, 16), o1=torch.empty(1, 2, 8, 16),
                lse1=torch.empty(1, 2, 8), o2=torch.empty(1, 2, 8, 16),
                lse2=torch.empty(1, 2, 8))
    args.update(case)
    with pytest.raises(KernelInputError, match=message):
        merge_lse_into(**args)
