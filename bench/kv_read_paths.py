"""How fast can the paged NVFP4 KV be read at all, by each way of loading it (issue 17)?

The decode kernel (``kernels/cuda``) reaches 74-77% of the read ceiling at (8, 32K) and
(32, 32K); a loads-only variant of its older register path reached 87%. This benchmark
reads the same pages with no math, in the decode kernel's grid (one CTA of 4 warps per
(sequence, KV head, split), each warp a contiguous range of 16-token tiles: K and V codes,
1,024 bytes each, and their two 128-byte scale blocks), three ways:

* ``cp_async``: the decode kernel's way: every lane copies 16-byte pieces into a per-warp
  shared-memory ring of 4 stages (``cp.async.cg ... L2::256B``);
* ``bulk``: one lane per warp issues the tile as four bulk copies (``cp.async.bulk``, the
  TMA's 1-D form) into the same ring, completion counted by an mbarrier per stage;
* ``ldg``: plain 16-byte loads into registers, four tiles in flight per warp.

Each reads every byte once (the XOR of what it read is checked against torch's) at 4 and 8
CTAs per SM; GB/s against the read ceiling of the same run.

    python -m nibble.bench.kv_read_paths --out out/kv_read_paths.json
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

import torch
import triton

from . import kernels as tk
from ._plots import grouped_bars

_SRC = r"""
#include <cuda_runtime.h>
#include <stdint.h>
#include <ATen/cuda/CUDAContext.h>
struct A { const uint8_t *kd, *vd, *ks, *vs; long long ps; const int* bt; int bt_b;
           int page_size, tpp_log2, nsplit, seq_len; unsigned* out; };
constexpr int kStage = 2304, kPipe = 4;

__device__ __forceinline__ const uint8_t* tile_ptr(const A& a, const uint8_t* sec, int b, int h,
                                             int tile, int row_bytes) {
  const int page = __ldg(a.bt + (long long)b * a.bt_b + (tile >> a.tpp_log2));
  const int off = tile & ((1 << a.tpp_log2) - 1);
  return sec + page * a.ps + ((long long)h * a.page_size + off * 16) * row_bytes;
}
__device__ __forceinline__ void cp16(uint32_t dst, const uint8_t* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void bulk(uint32_t dst, const uint8_t* src, int n, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(n), "r"(bar) : "memory");
}
__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra W;\n}" :: "r"(bar), "r"(parity) : "memory");
}

// MODE 0 cp.async ring, 1 bulk-copy ring, 2 registers. MINB: CTAs per SM.
template <int MODE, int MINB>
__global__ void __launch_bounds__(128, MINB) read_kernel(const A a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int n_tiles = (a.seq_len + 15) >> 4, nw = a.nsplit * 4;
  const int per = (n_tiles + nw - 1) / nw;
  const int lo = min((c * 4 + warp) * per, n_tiles), hi = min(lo + per, n_tiles);
  unsigned x = 0;
  uint8_t* ring = smem + warp * kPipe * kStage;
  const uint32_t rs = (uint32_t)__cvta_generic_to_shared(ring);
  if (MODE == 2) {
    for (int t = lo; t < hi; t += 4) {
      uint4 r[4][3];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int tt = min(t + u, hi - 1);
        const uint8_t* kp = tile_ptr(a, a.kd, b, h, tt, 64);
        const uint8_t* vp = tile_ptr(a, a.vd, b, h, tt, 64);
        const uint8_t* sp = tile_ptr(a, lane < 8 ? a.ks : a.vs, b, h, tt, 8);
        asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r[u][0].x), "=r"(r[u][0].y),
                     "=r"(r[u][0].z), "=r"(r[u][0].w) : "l"(kp + 32 * lane));
        asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r[u][1].x), "=r"(r[u][1].y),
                     "=r"(r[u][1].z), "=r"(r[u][1].w) : "l"(vp + 32 * lane));
        r[u][2] = make_uint4(0, 0, 0, 0);
        if (lane < 16)
          asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r[u][2].x), "=r"(r[u][2].y),
                       "=r"(r[u][2].z), "=r"(r[u][2].w) : "l"(sp + 16 * (lane & 7)));
        const uint4 k2 = *reinterpret_cast<const uint4*>(kp + 32 * lane + 16);
        const uint4 v2 = *reinterpret_cast<const uint4*>(vp + 32 * lane + 16);
        if (t + u < hi) x ^= k2.x ^ k2.y ^ k2.z ^ k2.w ^ v2.x ^ v2.y ^ v2.z ^ v2.w;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (t + u < hi)
#pragma unroll
          for (int j = 0; j < 3; ++j) x ^= r[u][j].x ^ r[u][j].y ^ r[u][j].z ^ r[u][j].w;
    }
  } else {
    const uint32_t bars = (uint32_t)__cvta_generic_to_shared(smem + 4 * kPipe * kStage) + warp * kPipe * 8;
    if (MODE == 1 && lane == 0) {
      for (int s = 0; s < kPipe; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bars + 8 * s));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    const auto issue = [&](int tile, int s) {
      const uint32_t st = rs + s * kStage;
      if (tile >= hi) { if (MODE == 0) asm volatile("cp.async.commit_group;"); return; }
      const uint8_t* kp = tile_ptr(a, a.kd, b, h, tile, 64);
      const uint8_t* vp = tile_ptr(a, a.vd, b, h, tile, 64);
      if (MODE == 0) {
        cp16(st + 16 * lane, kp + 16 * lane); cp16(st + 512 + 16 * lane, kp + 512 + 16 * lane);
        cp16(st + 1024 + 16 * lane, vp + 16 * lane); cp16(st + 1536 + 16 * lane, vp + 512 + 16 * lane);
        if (lane < 16) cp16(st + 2048 + 16 * lane, tile_ptr(a, lane < 8 ? a.ks : a.vs, b, h, tile, 8) + 16 * (lane & 7));
        asm volatile("cp.async.commit_group;");
      } else if (lane == 0) {
        const uint32_t bar = bars + 8 * s;
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(kStage) : "memory");
        bulk(st, kp, 1024, bar);
        bulk(st + 1024, vp, 1024, bar);
        bulk(st + 2048, tile_ptr(a, a.ks, b, h, tile, 8), 128, bar);
        bulk(st + 2176, tile_ptr(a, a.vs, b, h, tile, 8), 128, bar);
      }
    };
    for (int i = 0; i < kPipe - 1; ++i) issue(lo + i, i);
    int s = 0;
    for (int t = lo; t < hi; ++t) {
      if (MODE == 0) asm volatile("cp.async.wait_group %0;" :: "n"(kPipe - 2) : "memory");
      else wait_parity(bars + 8 * s, ((t - lo) / kPipe) & 1);
      __syncwarp();
      const uint4* p = reinterpret_cast<const uint4*>(ring + s * kStage);
      const uint4 u = p[lane], w = p[32 + lane], y = p[64 + lane], z = p[96 + lane];
      x ^= u.x ^ u.y ^ u.z ^ u.w ^ w.x ^ w.y ^ w.z ^ w.w ^ y.x ^ y.y ^ y.z ^ y.w ^ z.x ^ z.y ^ z.z ^ z.w;
      if (lane < 16) { const uint4 q = p[128 + lane]; x ^= q.x ^ q.y ^ q.z ^ q.w; }
      __syncwarp();
      issue(t + kPipe - 1, s == 0 ? kPipe - 1 : s - 1);
      s = s == kPipe - 1 ? 0 : s + 1;
    }
    if (MODE == 0) asm volatile("cp.async.wait_group 0;" ::: "memory");
  }
#pragma unroll
  for (int sh = 16; sh > 0; sh >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, sh);
  if (lane == 0) atomicXor(a.out, x);
}

template <int MODE, int MINB> void launch_one(const A& a, int batch, int heads) {
  const int smem = 4 * kPipe * kStage + 4 * kPipe * 8;
  cudaFuncSetAttribute(read_kernel<MODE, MINB>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  read_kernel<MODE, MINB><<<dim3(a.nsplit, heads, batch), 128, MODE == 2 ? 0 : smem,
                             at::cuda::getCurrentCUDAStream()>>>(a);
}

void read_paths(torch::Tensor kd, torch::Tensor vd, torch::Tensor ks, torch::Tensor vs,
                torch::Tensor bt, torch::Tensor out, int64_t page_size, int64_t seq_len,
                int64_t nsplit, int64_t mode, int64_t minb) {
  A a{kd.data_ptr<uint8_t>(), vd.data_ptr<uint8_t>(), ks.data_ptr<uint8_t>(),
      vs.data_ptr<uint8_t>(), kd.stride(0), bt.data_ptr<int>(), (int)bt.stride(0),
      (int)page_size, __builtin_ctz((unsigned)(page_size / 16)), (int)nsplit, (int)seq_len,
      reinterpret_cast<unsigned*>(out.data_ptr<int>())};
  const int batch = (int)bt.size(0), heads = (int)kd.size(1);
  if (mode == 0) { if (minb == 4) launch_one<0, 4>(a, batch, heads); else launch_one<0, 8>(a, batch, heads); }
  if (mode == 1) { if (minb == 4) launch_one<1, 4>(a, batch, heads); else launch_one<1, 8>(a, batch, heads); }
  if (mode == 2) { if (minb == 4) launch_one<2, 4>(a, batch, heads); else launch_one<2, 8>(a, batch, heads); }
}
"""
MODES = {"cp_async": 0, "bulk": 1, "ldg": 2}


@functools.lru_cache(maxsize=1)
def _module():
    from torch.utils import cpp_extension
    return cpp_extension.load_inline(
        "nibble_kv_read_paths", cpp_sources="void read_paths(torch::Tensor kd, torch::Tensor vd, "
        "torch::Tensor ks, torch::Tensor vs, torch::Tensor bt, torch::Tensor out, int64_t "
        "page_size, int64_t seq_len, int64_t nsplit, int64_t mode, int64_t minb);",
        cuda_sources="#include <torch/extension.h>\n" + _SRC, functions=["read_paths"],
        extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"])


def _expected(view, tables: torch.Tensor, seq_len: int) -> int:
    """XOR of every 32-bit word the kernels read (codes and scales of every tile)."""
    acc = 0
    b, w = tables.shape
    for sec in (view.k_data, view.v_data, view.k_scale, view.v_scale):
        rows = sec[tables.flatten().long()]                      # [B * W, H, S, row]
        rows = rows.view(b, w, *rows.shape[1:]).permute(0, 2, 1, 3, 4)
        rows = rows.reshape(b, sec.shape[1], w * sec.shape[2], sec.shape[3])[:, :, :seq_len]
        acc ^= _xor_all(rows.contiguous().view(torch.int32).flatten())
    return acc & 0xFFFFFFFF


def _xor_all(w: torch.Tensor) -> int:
    while w.numel() > 1:
        if w.numel() % 2:
            w = torch.cat([w, torch.zeros(1, dtype=w.dtype, device=w.device)])
        w = torch.bitwise_xor(w[0::2], w[1::2])
    return int(w.item())


def run(cases: list[tuple[int, int, int, int]]) -> dict:
    mod = _module()
    ceiling = tk.read_ceiling()
    out: dict = {"read_tbs": ceiling / 1e12, "cases": []}
    for b, ctx, s, nsplit in cases:
        tables, _, pages = tk.tables_for([ctx] * b, s, seed=ctx + b)
        layout, pool, view = tk.filled_pool("nvfp4", 8, 128, s, pages, seed=b)
        want = _expected(view, tables, ctx)
        nbytes = tk.kv_bytes(layout, b * ctx)
        rec = {"batch": b, "ctx": ctx, "page_size": s, "splits": nsplit, "bytes": nbytes, "paths": {}}
        for name, mode in MODES.items():
            for minb in (4, 8):
                acc = torch.zeros(1, dtype=torch.int32, device="cuda")

                def call():
                    mod.read_paths(view.k_data, view.v_data, view.k_scale, view.v_scale, tables,
                                   acc, s, ctx, nsplit, mode, minb)
                call()
                torch.cuda.synchronize()
                got = int(acc.item()) & 0xFFFFFFFF
                if got != want:
                    raise AssertionError(f"{name} x{minb}: read XOR {got:#x}, expected {want:#x}")
                ms = triton.testing.do_bench_cudagraph(call, rep=100)
                gbs = nbytes / (ms * 1e-3) / 1e9
                rec["paths"][f"{name}_x{minb}"] = {"us": ms * 1e3, "gb_s": gbs,
                                                  "share": gbs * 1e9 / ceiling}
                print(f"({b}, {ctx}) page {s} {name:>8} {minb} CTAs/SM: {ms * 1e3:7.1f} us "
                      f"{100 * gbs * 1e9 / ceiling:5.1f}%", flush=True)
        out["cases"].append(rec)
        del pool, view
        torch.cuda.empty_cache()
    return out


def plot(data: dict, path: pathlib.Path) -> None:
    """Share of the read ceiling per case, one bar per path (4 CTAs per SM)."""
    cases = data["cases"]
    grouped_bars([f"{c['batch']} x {c['ctx']}\npage {c['page_size']}" for c in cases],
                 {name: [100 * c["paths"][f"{name}_x4"]["share"] for c in cases]
                  for name in MODES}, path, f"% of {data['read_tbs']:.2f} TB/s",
                 "NVFP4 pages read with no math, decode grid, 4 CTAs/SM")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/kv_read_paths.json")
    a = ap.parse_args()
    tk.ONE = torch.ones(1, dtype=torch.float32, device="cuda")
    res = run([(8, 32768, 16, 8), (32, 32768, 16, 2), (1, 131072, 16, 66), (8, 32768, 64, 8)])
    path = pathlib.Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    plot(res, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
