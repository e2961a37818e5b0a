"""Attention-backend time per decode step on CPU: the reference ``torch`` backend against
``torch_fast``, 30 layers of SmolLM2's shape (3 KV heads, 9 query heads, head_dim 64),
``B`` sequences of ``CTX`` cached tokens (no model: store + attention only).

    python -m nibble.bench.cpu_attention 8 100 nvfp4
"""

from __future__ import annotations

import sys
import time

import torch

from nibble.kernels import PageLayout, store_kv_ref
from nibble.kernels.recipes import RecipeParams
from nibble.services.attention import (AttentionMetadata, FastTorchAttentionBackend,
                                       TorchAttentionBackend)
from nibble.tiering import KVPool

L, H, HQ, D, S = 30, 3, 9, 64, 16


def main(argv=None) -> None:
    args = (argv if argv is not None else sys.argv[1:]) or ["8", "100", "nvfp4"]
    b, ctx, kv = int(args[0]), int(args[1]), args[2]
    lay = PageLayout(kv, L, H, D, S)
    m = ctx // S + 1
    pool = KVPool(lay, b * m + 1)
    if lay.fmt.k_recipe is not None:          # what calibration installs (identity values)
        pool.set_recipe_params(RecipeParams.identity(lay.fmt.k_recipe, L, H, D))
    tables = torch.arange(b * m, dtype=torch.int32).view(b, m)
    slots = (tables.long()[:, :, None] * S + torch.arange(S)).flatten(1)[:, :ctx + 1]
    for layer in range(L):
        store_kv_ref(lay, pool.layer(layer), torch.randn(b * ctx, H, D),
                     torch.randn(b * ctx, H, D), slots[:, :ctx].flatten(), 1.0, 1.0)
    meta = AttentionMetadata(list(range(b)), [1] * b, [ctx] * b, slots[:, ctx].contiguous(),
                             tables)
    q, k, v = torch.randn(b, HQ, D), torch.randn(b, H, D), torch.randn(b, H, D)
    for cls in (TorchAttentionBackend, FastTorchAttentionBackend):
        backend = cls(pool, D ** -0.5)
        with torch.inference_mode():
            for i in range(11):               # the first step warms up
                if i == 1:
                    t0 = time.perf_counter()
                backend.plan(meta)
                for layer in range(L):
                    backend.forward(layer, q, k, v, meta)
        print(f"{cls.name:<11} B={b} ctx={ctx} {kv}: "
              f"{(time.perf_counter() - t0) / 10 * 1e3:.1f} ms per decode step")


if __name__ == "__main__":
    main()
