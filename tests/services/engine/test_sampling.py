"""Tests for nibble.services.engine.sampling."""

from __future__ import annotations

import pytest
import torch

from nibble.services.engine.sampling import make_generator, sample
from nibble.services.engine.types import SamplingParams
from nibble.services.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0)


def _logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=gen, dtype=torch.float32) * 3.0


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one [V] row, as one batch sharing a seeded generator."""
    gen = make_generator(seed, "cpu")
    batch = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return sample(batch, [params] * n, [gen] * n)


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    a, b = make_generator(7, "cpu"), make_generator(7, "cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_greedy_is_argmax() -> None:
    logits = _logits(6, 50)
    out = sample(logits, [GREEDY] * 6, [None] * 6)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_top_k_one_is_greedy() -> None:
    logits = _logits(6, 50, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 6
    out = sample(logits, params, [make_generator(i, "cpu") for i in range(6)])
    assert torch.equal(out, logits.argmax(dim=-1))


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every draw is pure RNG
    params = [SamplingParams(temperature=1.0)]

    def run(seed: int) -> list[int]:
        gen = make_generator(seed, "cpu")
        return [int(sample(logits, params, [gen])[0]) for _ in range(20)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_seeded_row_independent_of_batch() -> None:
    logits = _logits(4, 200, seed=2)
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    alone = sample(logits[2:3], [p], [make_generator(5, "cpu")])
    others = [SamplingParams(temperature=1.0), GREEDY, p, SamplingParams(top_k=3)]
    gens = [None, None, make_generator(5, "cpu"), make_generator(9, "cpu")]
    batched = sample(logits, others, gens)
    assert int(batched[2]) == int(alone[0])


def test_top_k_restricts_support() -> None:
    logits = _logits(1, 100, seed=3)[0]
    top5 = set(torch.topk(logits, 5).indices.tolist())
    out = _draw_many(logits, SamplingParams(temperature=5.0, top_k=5), 3000)
    assert set(out.tolist()) == top5  # within the top 5, and (flat at T=5) all of them seen


def test_top_k_on_full_sort_path() -> None:
    # a row without top_k forces a full sort; the top_k row must still be cut
    logits = _logits(1, 100, seed=4)[0]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    n = 1000
    batch = logits.unsqueeze(0).expand(2 * n, -1).contiguous()
    params = [SamplingParams(temperature=5.0, top_k=3), SamplingParams(top_p=0.99)] * n
    gen = make_generator(0, "cpu")
    out = sample(batch, params, [gen] * (2 * n))
    assert set(out[0::2].tolist()) == top3
    assert len(set(out[1::2].tolist())) > 3


def test_top_p_restricts_support_and_renormalizes() -> None:
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = probs.log()
    n = 8000
    out = _draw_many(logits, SamplingParams(top_p=0.75), n)
    assert set(out.tolist()) == {1, 3}  # 0.5 + 0.3 is the smallest set reaching 0.75
    frac = (out == 1).float().mean().item()
    assert abs(frac - 0.5 / 0.8) < 0.03
    out = _draw_many(logits, SamplingParams(top_p=0.85), n)
    assert set(out.tolist()) == {1, 2, 3}


def test_tiny_top_p_keeps_top_token() -> None:
    logits = _logits(1, 100, seed=5)[0]
    out = _draw_many(logits, SamplingParams(temperature=3.0, top_p=1e-6), 200)
    assert set(out.tolist()) == {int(logits.argmax())}


def test_top_k_then_top_p() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=3 renormalizes to 4/9, 3/9, 2/9; top_p=0.7 then needs 4/9 + 3/9
    out = _draw_many(probs.log(), SamplingParams(top_k=3, top_p=0.7), 3000)
    assert set(out.tolist()) == {0, 1}


def test_masked_tokens_never_sampled() -> None:
    logits = torch.zeros(1, 10)
    logits[0, ::2] = float("-inf")
    out = _draw_many(logits[0], SamplingParams(), 2000)
    assert set(out.tolist()) == {1, 3, 5, 7, 9}


def test_temperature_to_zero_limit() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.5, 0.0, 2.4]])
    out = _draw_many(logits[0], SamplingParams(temperature=1e-3), 500)
    assert set(out.tolist()) == {2}
    # lower temperature concentrates mass on the argmax
    hits = [(_draw_many(logits[0], SamplingParams(temperature=t), 4000) == 2).float().mean().item()
            for t in (2.0, 1.0, 0.3)]
    assert hits[0] < hits[1] < hits[2]


def test_mixed_batch() -> None:
    logits = _logits(4, 300, seed=6)
    params = [GREEDY, SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=1.2, seed=11)]
    gens = [None, make_generator(1, "cpu"), None, make_generator(11, "cpu")]
    out = sample(logits, params, gens)
    assert int(out[0]) == int(logits[0].argmax())
    assert int(out[1]) in set(torch.topk(logits[1], 3).indices.tolist())
    assert int(out[2]) == int(logits[2].argmax())
    alone = sample(logits[3:4], [params[3]], [make_generator(11, "cpu")])
    assert int(out[3]) == int(alone[0])


def _chi_square(out: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(out, minlength=probs.numel()).double()
    expected = probs.double() * out.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 1.5, -0.5, 0.2])
    probs = torch.softmax(logits / temperature, dim=-1)
    out = _draw_many(logits, SamplingParams(temperature=temperature), 20000, seed=123)
    # df = 7; the 0.999 quantile of chi2(7) is about 24.3
    assert _chi_square(out, probs) < 24.3
    # and it fails for the wrong distribution (e.g. temperature ignored)
    wrong = torch.softmax(logits / (3.0 - temperature), dim=-1)
    assert _chi_square(out, wrong) > 100.0


@pytest.mark.parametrize("bad", [
    SamplingParams(temperature=-0.1), SamplingParams(top_p=0.0), SamplingParams(top_p=1.5),
    SamplingParams(top_k=0), SamplingParams(top_k=-2),
])
def test_invalid_params_rejected(bad: SamplingParams) -> None:
    with pytest.raises(InvalidRequestError):     # checked once, where requests enter
        bad.check()


def test_shape_mismatch_rejected() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 4), [GREEDY], [None])
