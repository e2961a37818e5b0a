"""Ragged bottom-right causal attention against its fp32 reference (CPU; CUDA under ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from nibble.kernels.errors import KernelInputError
from nibble.kernels.ragged import (flash_applies, ragged_causal_attention,
                                   ragged_causal_attention_ref)

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
