"""bench/skinny_gemm.py: the Triton GEMM it sweeps (interpreted on CPU), its configs and plots."""

from __future__ import annotations

import json

import pytest
import torch

from nibble.bench import skinny_gemm as sg


@pytest.mark.parametrize("cfg", [(32, 128, 1, 4, 3), (32, 128, 2, 4, 3), (64, 256, 2, 4, 3)])
def test_triton_linear_matches_torch(cfg):
    # fp16: the interpreter's bf16 loads are not numpy-exact; the GPU run checks bf16 itself
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 512, generator=gen).half()
    w = torch.randn(64, 512, generator=gen).half()
    ws = torch.empty(5, 64)
    got = sg.triton_linear(x, w, cfg, ws).float()
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert (got - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


def test_linear_into_writes_a_strided_input():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(16, 768, generator=gen).half()
    x = base[:, :512]                                # a row stride of 768, as the chain's O input
    w = torch.randn(64, 512, generator=gen).half()
    y = torch.full((16, 64), float("nan"), dtype=torch.float16)
    sg.linear_into(x, w, y, (32, 128, 1, 4, 3))
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert (y.float() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


def test_configs_divide_the_shapes():
    for n, k in sg.SHAPES.values():
        cfgs = list(sg._configs(n, k))
        assert cfgs
        for bn, bk, split, _, _ in cfgs:
            assert n % bn == 0 and (k // split) % bk == 0


def test_plots_of_both_kinds(tmp_path):
    sweep = {"read_tbs": 4.47, "results": [
        {"name": "qkv", "m": 16, "cublas_share": 0.67, "triton_share": 0.66}]}
    chain = {"read_tbs": 4.47, "results": [
        {"layers": 8, "variants": {"cublas": {"share": 0.8}, "pdl2": {"share": 0.78}}}]}
    for name, data in (("sweep", sweep), ("chain", chain)):
        path = tmp_path / f"{name}.png"
        sg.plot(json.loads(json.dumps(data)), path)
        assert path.stat().st_size > 1000

