"""Sliding-window attention: the torch backend's three paths against a dense reference,
and backend selection for models with windows.

K/V are drawn bf16-representable and the pool is bf16, so a token reads back from
its page exactly as it was written: prefill, extend and decode must all equal plain
windowed causal attention over the whole history, to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from nibble.kernels import PageLayout
from nibble.services.attention import ATTENTION_BACKENDS, AttentionMetadata, TorchAttentionBackend
from nibble.services.attention.base import AttentionBackend
from nibble.services.engine.builder import select_attention_backend
from nibble.services.errors import ConfigError
from nibble.tiering import KVPool

HQ, HKV, D, PS = 4, 2, 16, 4
SCALE = D ** -0.5
CPU, CUDA = torch.device("cpu"), torch.device("cuda")   # no CUDA needed to name a device


def reference(q, k, v, q_pos, window):
    """Dense fp32 attention of queries at ``q_pos`` over keys at positions 0..len(k)-1."""
    k_pos = torch.arange(k.shape[0])
    rel = q_pos[:, None] - k_pos[None, :]
    mask = (rel >= 0) & (rel < window if window is not None else True)
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(HQ // HKV, 1)) * SCALE
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(HQ // HKV, 1))


def kv(n, g):
    return (torch.randn(n, HKV, D, generator=g).bfloat16().float(),
            torch.randn(n, HKV, D, generator=g).bfloat16().float())


def run_steps(windows, steps, seed=0):
    """Run ``steps`` (list of {seq: new_tokens}) through one backend; return per-step outputs and
    the references. Sequences own disjoint pages; their history grows across steps."""
    g = torch.Generator().manual_seed(seed)
    layout = PageLayout("bf16", len(windows), HKV, D, PS)
    pool = KVPool(layout, 64)
    backend = TorchAttentionBackend(pool, SCALE, sliding_windows=windows)
    hist = {}                      # seq -> per layer (k, v) history
    pages_of = {s: list(range(1 + 12 * s, 13 + 12 * s)) for s in range(4)}
    results = []
    for step in steps:
        seqs = sorted(step)
        starts, lens, cached, slots = [], [], [], []
        pos = 0
        for s in seqs:
            c, n = (hist[s][0][0].shape[0] if s in hist else 0), step[s]
            starts.append(pos)
            lens.append(n)
            cached.append(c)
            pos += n
            p = torch.arange(c, c + n)
            slots.append(torch.tensor(pages_of[s])[p // PS] * PS + p % PS)
        for s in seqs:
            hist.setdefault(s, [(torch.empty(0, HKV, D), torch.empty(0, HKV, D))] * len(windows))
        tables = torch.tensor([pages_of[s] for s in seqs], dtype=torch.int32)
        meta = AttentionMetadata(starts, lens, cached, torch.cat(slots), tables)
        backend.plan(meta)
        for layer, w in enumerate(windows):
            q = torch.randn(pos, HQ, D, generator=g)
            k, v = kv(pos, g)
            out = backend.forward(layer, q, k, v, meta)
            for s, st, n, c in zip(seqs, starts, lens, cached):
                hk, hv = hist[s][layer]
                hk, hv = torch.cat([hk, k[st:st + n]]), torch.cat([hv, v[st:st + n]])
                hist[s][layer] = (hk, hv)
                ref = reference(q[st:st + n], hk, hv, torch.arange(c, c + n), w)
                results.append((layer, s, c, n, out[st:st + n], ref))
    return results


@pytest.mark.parametrize("windows", [(6, None), (1, 3), (None, None), (100, 6)])
def test_prefill_extend_decode_match_dense_windowed_reference(windows):
    # seq 0: prefill 20 (> window) then decode; seq 1: prefill 9, extend 7, extend 5; seq 2 decodes
    # from a 13-token prefill while the others extend; every step mixes paths.
    steps = [{0: 20, 1: 9, 2: 13}, {0: 1, 1: 7, 2: 1}, {0: 1, 1: 5, 2: 1}, {0: 1, 1: 1, 2: 1},
             {3: 3}, {3: 1}]
    paths = set()
    for layer, s, c, n, got, ref in run_steps(windows, steps):
        paths.add("prefill" if c == 0 else "decode" if n == 1 else "extend")
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0,
                                   msg=f"layer {layer} seq {s} cached {c} new {n}")
    assert paths == {"prefill", "extend", "decode"}


def test_window_changes_the_result():
    """Guard against a vacuous comparison: a window shorter than the history must matter."""
    full = run_steps((None,), [{0: 12}, {0: 1}], seed=3)
    win = run_steps((4,), [{0: 12}, {0: 1}], seed=3)
    for (_, _, _, _, a, _), (_, _, _, _, b, _) in zip(full, win):
        assert (a[-1] - b[-1]).abs().max() > 1e-2


def test_sliding_windows_setter():
    layout = PageLayout("bf16", 2, HKV, D, PS)
    backend = TorchAttentionBackend(KVPool(layout, 4), SCALE)
    assert backend.window(0) is None
    backend.set_sliding_windows([8, None])
    assert (backend.window(0), backend.window(1)) == (8, None)

    class NoWindows(AttentionBackend):
        name = "nowin"

        def plan(self, meta):
            pass

        def forward(self, layer, q, k, v, meta):
            return q

    NoWindows().set_sliding_windows([None, None])   # all full: fine
    with pytest.raises(ConfigError, match="sliding-window"):
        NoWindows().set_sliding_windows([8, None])


def layout(head_dim=64):
    return PageLayout("nvfp4", num_layers=2, num_kv_heads=2, head_dim=head_dim, page_size=16)


def test_selection_falls_back_to_torch_for_sliding_windows():
    # on CPU the fast path's batched decode masks the windows
    assert select_attention_backend("auto", layout(), CPU, sliding_window=True) == "torch_fast"
    assert select_attention_backend("auto", layout(), CUDA, sliding_window=True) == "torch"
    assert select_attention_backend("torch", layout(), CUDA, sliding_window=True) == "torch"


@pytest.mark.skipif("triton" not in ATTENTION_BACKENDS, reason="Triton does not import here")
def test_forced_triton_with_sliding_windows_explains():
    assert select_attention_backend("triton", layout(), CUDA) == "triton"
    with pytest.raises(ConfigError, match="sliding-window attention layers.*--attention-backend torch"):
        select_attention_backend("triton", layout(), CUDA, sliding_window=True)
