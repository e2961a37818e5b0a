"""The fused decoder-layer kernels against the torch ops they replace (CUDA, graph replay).

Per decode step of the Qwen3-8B shape (hidden 4096, MLP 12288, 32 query / 8 KV heads,
head_dim 128, bf16) at batch sizes 16 and 64 (and prompt sizes with ``--batch``: from
``qkv.LONG_INPUT`` tokens the qkv kernel runs as a prefill step calls it, at each tile size,
see ``_prompt_cases``), each variant captured in a CUDA graph
and timed over replays (median, ``triton.testing.do_bench_cudagraph``):

* ``qkv``: QK-norm + RoPE + the K recipe (``(k - c) @ M``, ``q @ M^-T``) + the NVFP4
  (or FP8) store: the unfused torch ops and the Triton store, against
  :func:`~nibble.kernels.triton.qkv_rope_store`;
* ``add_norm``: residual add + RMSNorm, against :func:`~nibble.kernels.triton.add_rms_norm`;
* ``silu_mul``: ``silu(gate) * up``, against :func:`~nibble.kernels.triton.silu_mul`.

    python -m nibble.bench.fused_layers --out out/fused_layers.json
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import triton

from nibble.kernels import PageLayout
from nibble.kernels.recipes import RecipeParams
from nibble.kernels.formats import DEFAULT_K_RECIPE
from nibble.kernels.triton import add_rms_norm, qkv_rope_store, silu_mul, store_kv
from nibble.kernels.triton.qkv import LONG_INPUT
from nibble.services.models.llama import rms_norm
from nibble.services.models.rope import apply_rope

HQ, H, D, HIDDEN, INTER, EPS = 32, 8, 128, 4096, 12288, 1e-6


def _recipe(dev) -> RecipeParams:
    gen = torch.Generator().manual_seed(0)
    qr = torch.linalg.qr(torch.randn(1, H, D, D, generator=gen, dtype=torch.float64))[0]
    return RecipeParams.create(DEFAULT_K_RECIPE, torch.randn(1, H, D, generator=gen) * 0.3,
                               qr.float(), None).to(dev)


def _qkv_cases(b: int, fmt: str, dev) -> dict:
    layout = PageLayout(fmt, 1, H, D, 64)
    pool = layout.allocate(4 * b, dev)
    pages = layout.layer_view(pool, 0)
    qkv = torch.randn(b, (HQ + 2 * H) * D, device=dev, dtype=torch.bfloat16)
    cos, sin = (torch.rand(b, 1, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(4 * b * 64, device=dev)[:b]
    qn, kn = (torch.rand(D, device=dev, dtype=torch.bfloat16) + 0.5 for _ in range(2))
    gs = torch.ones(1, device=dev)
    p32 = _recipe(dev)
    p16 = p32.to(dev, torch.bfloat16)

    def unfused():
        q, k, v = qkv.split([HQ * D, H * D, H * D], dim=-1)
        q = rms_norm(q.view(b, HQ, D), qn, EPS)
        k = rms_norm(k.view(b, H, D), kn, EPS)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = p16.apply(0, q, k, v.reshape(b, H, D).contiguous())
        store_kv(layout, pages, k, v, slots, gs, gs)
        return q

    def fused(tiles=None, split=None, maps=p16):
        """As served: fp32 shifts, bf16 maps (RecipeHook.layer_params on a GPU)."""
        return qkv_rope_store(layout, pages, qkv, HQ, cos, sin, slots, gs, gs, qn, kn, EPS,
                              k_shift=p32.k_shift[0], k_map=maps.k_map[0], q_map=maps.q_map[0],
                              tokens_per_program=tiles, split_halves=split)
    cases = {"unfused": unfused, "fused": fused}
    if b >= LONG_INPUT:
        cases = {"unfused": unfused, **_prompt_cases(layout, pages, qkv, cos, sin, slots, gs,
                                                     qn, kn, p32, p16, fmt)}
    else:                        # one program per head (no split), then also fp32 maps
        cases["fused_unsplit"] = lambda: fused(split=False)
        cases["fused_unsplit_f32maps"] = lambda: fused(split=False, maps=p32)
    return cases


def _prompt_cases(layout, pages, qkv, cos, sin, slots, gs, qn, kn, p32, p16, fmt) -> dict:
    """A prompt's QKV kernel as a prefill step calls it (writing the fresh K/V rows for the
    attention too), at each tile size: ``fused`` is the default tile. NVFP4 with its recipe
    (``recipe_t*``: q' and K' out) and as fresh prompts take it (``raw_t*``: q unmapped, the
    rows before the recipe out, see ``qkv_rope_store(raw_kv_out=)``); FP8 as served (no
    recipe, ``plain_t*``)."""
    t = qkv.shape[0]
    kv = [torch.empty(t, H, D, device=qkv.device, dtype=qkv.dtype) for _ in range(2)]

    def call(tiles, **kw):
        return qkv_rope_store(layout, pages, qkv, HQ, cos, sin, slots, gs, gs, qn, kn, EPS,
                              k_out=kv[0], v_out=kv[1], tokens_per_program=tiles, **kw)
    recipe = dict(k_shift=p32.k_shift[0], k_map=p16.k_map[0], q_map=p16.q_map[0])
    kinds = {"recipe": recipe, "raw": {**recipe, "q_map": None, "raw_kv_out": True}} \
        if fmt == "nvfp4" else {"plain": {}}
    cases = {"fused": lambda: call(None, **kinds.get("raw", {}))}
    for name, kw in kinds.items():
        for tiles in (16, 32, 64):
            cases[f"{name}_t{tiles}"] = lambda tiles=tiles, kw=kw: call(tiles, **kw)
    return cases


def _elementwise_cases(b: int, dev) -> dict:
    x, r = (torch.randn(b, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(HIDDEN, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(b, 2 * INTER, device=dev, dtype=torch.bfloat16)

    def silu_torch():
        gate, up = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return {"add_norm": {"unfused": lambda: rms_norm(x + r, w, EPS),
                         "fused": lambda: add_rms_norm(x, r, w, EPS)},
            "silu_mul": {"unfused": silu_torch, "fused": lambda: silu_mul(gu)}}


def _time(fn) -> float:
    fn()                                  # compile outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--out", default="out/fused_layers.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for b in args.batch:
        groups = {f"qkv_{f}": _qkv_cases(b, f, dev) for f in ("nvfp4", "fp8_e4m3")}
        groups.update(_elementwise_cases(b, dev))
        for name, variants in groups.items():
            us = {k: _time(fn) for k, fn in variants.items()}
            rows.append({"batch": b, "op": name, **{f"{k}_us": v for k, v in us.items()}})
            extra = "".join(f"   {k} {v:.1f} us" for k, v in us.items()
                            if k not in ("unfused", "fused"))
            print(f"B={b:<3} {name:<14} unfused {us['unfused']:7.1f} us   fused "
                  f"{us['fused']:6.1f} us   x{us['unfused'] / us['fused']:.1f}{extra}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
