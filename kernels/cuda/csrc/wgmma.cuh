// Device code, part 4: the NVFP4 scores by wgmma, with K staged in shared memory (the route
// "wgmma with K staged in shared memory" of the kernels issue; variants PAIR 3 and 4).
//
// The 4 warps of the CTA are one warpgroup. Each warp keeps its own token range, ring and
// online softmax, as in pipe.cuh; only S^T = K Q^T changes:
// * every step, each warp dequantizes its tile's K (codes times block scales, fp16, value *
//   2^-7 as in tile.cuh) and stores it into a [64 tokens x 128] A tile in shared memory
//   (rows 16w .. 16w + 15 for warp w), no swizzle, K-major core matrices of 8 rows x 16 bytes:
//   core matrix (kc, rg) at kc * 1024 + rg * 128 (LBO 1024 along K, SBO 128 along M);
// * Q^T (B, 128 x 8 heads, loaded once) sits in the same form: core matrix kc at kc * 128;
// * a fence.proxy.async and a CTA barrier publish the stores, and 8 wgmma.m64n8k16 per tile
//   (one per 16 head dims) run asynchronously while the warps read V from the ring; the
//   accumulator rows of warp w are its tokens in the mma.sync C layout, so the softmax and
//   O^T += V^T P^T of pipe.cuh / tile.cuh apply unchanged.
// Lane L dequantizes token row r = L % 16, head dims [64h, 64h + 64) (h = L / 16): 8 words of
// 8 codes. dq8's output order puts head dim 8kc + perm[p] at position p of core-matrix row
// (kc), perm = {0, 2, 4, 6, 1, 3, 5, 7}; Q is stored in the same order. The ring's K rows are
// swizzled (chunk u of row r at r * 64 + 16 * (u ^ ((r >> 1) & 3))) so the 16-byte reads
// are conflict-free; the A stores are conflict-free by construction (8 lanes of a phase
// write 8 rows of one core matrix).
// Warps run a uniform number of steps (wgmma is warpgroup-wide); a step past a warp's range
// skips its staging, softmax and PV but still joins the barrier and the wgmma.
#pragma once
#include "pipe.cuh"

namespace nibble_nvfp4 {

constexpr int kATile = 64 * kD * 2;        // one 16-token tile per warp: 16 KB
constexpr int kQSmem = kD * kMaxGroup * 2; // Q^T: 2 KB

__device__ __forceinline__ uint32_t k_swz(int r, int u) {
  return (uint32_t)(r * 64 + 16 * (u ^ ((r >> 1) & 3)));
}

// Matrix descriptor, no swizzle: start, LBO (K direction), SBO (M/N direction), all in bytes.
template <int LBO, int SBO>
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(LBO >> 4) << 16) |
         ((uint64_t)(SBO >> 4) << 32);
}

__device__ __forceinline__ void wgmma_m64n8k16(float (&d)[4], uint64_t da, uint64_t db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// Keeps the compiler from moving accumulator reads across the wait (the asm above already
// "wrote" them at issue).
__device__ __forceinline__ void pin(float (&d)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void sts128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                       uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};" :: "r"(addr), "r"(a), "r"(b), "r"(c),
               "r"(d) : "memory");
}

// Q^T into shared memory (thread i: head n = i / 16, core matrix kc = i % 16), fp16, the
// head-dim order of stage_k; heads past the group are zero.
__device__ __forceinline__ void store_q(const Params& p, int b, int h, uint32_t q_s) {
  const int n = threadIdx.x >> 4, kc = threadIdx.x & 15;
  float v[8];
  const int perm[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  const long long row = (long long)b * p.q_b + (long long)(h * p.group + n) * p.q_h + 8 * kc;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const long long i = row + perm[e];
    if (n >= p.group) v[e] = 0.f;
    else if (p.q_dtype == 0) v[e] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p.q)[i]);
    else if (p.q_dtype == 1) v[e] = __half2float(reinterpret_cast<const __half*>(p.q)[i]);
    else v[e] = reinterpret_cast<const float*>(p.q)[i];
  }
  sts128(q_s + kc * 128 + n * 16, pack_h2(v[0], v[1]), pack_h2(v[2], v[3]), pack_h2(v[4], v[5]),
         pack_h2(v[6], v[7]));
}

// The ring's K copies land swizzled (k_swz); V and the scales as in issue_tile.
__device__ __forceinline__ void issue_tile_w(uint32_t stage, const Params& p, PageCursor& pc,
                                             const LaneCp& ln, int tile, int lane) {
  const uint8_t* pg = page_base(p, pc.page(tile >> p.tpp_log2, lane));
  const uint32_t off = (uint32_t)tile & ((1u << p.tpp_log2) - 1u);
  const uint8_t* kp = ptr_add(pg, off * (16 * 64) + ln.k);
  const uint8_t* vp = ptr_add(pg, off * (16 * 64) + ln.v);
  const uint32_t kd = kKOff + k_swz(lane >> 2, lane & 3);
  cp16(stage + kd, kp);
  cp16(stage + kd + 512, kp + 8 * 64);
  cp16(stage + ln.vd, vp);
  cp16(stage + ln.vd + 512, vp + 512);
  cp16_if(stage + kKsOff + lane * 16, ptr_add(pg, off * (16 * 8) + ln.sc), lane < 16);
}

// One tile's K from ring stage `st` -> warp `warp`'s 16 rows of the A tile at a_s (see top).
template <int DQ>
__device__ __forceinline__ void stage_k(const uint8_t* st, uint32_t a_s, int lane, int warp) {
  const int r = lane & 15, hh = lane >> 4;
  const uint4 c0 = *reinterpret_cast<const uint4*>(st + kKOff + k_swz(r, 2 * hh));
  const uint4 c1 = *reinterpret_cast<const uint4*>(st + kKOff + k_swz(r, 2 * hh + 1));
  const uint32_t sw = *reinterpret_cast<const uint32_t*>(st + kKsOff + r * 8 + 4 * hh);
  const uint32_t k128 = ScaleMul<DQ>::kH2;
  const uint32_t s01 = hmul2(e4m3x2_f16x2(sw), k128), s23 = hmul2(e4m3x2_f16x2(sw >> 16), k128);
  const uint32_t sc[4] = {bcast_lo(s01), bcast_hi(s01), bcast_lo(s23), bcast_hi(s23)};
  const uint32_t w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
  const uint32_t row = a_s + (2 * warp + (r >> 3)) * 128 + (r & 7) * 16 + 8 * hh * 1024;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    uint32_t x[4];
    dq8<DQ>(w[m], x);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = hmul2(x[i], sc[m >> 1]);
    sts128(row + m * 1024, x[0], x[1], x[2], x[3]);
  }
}

// S^T of the A tile at a_s: 8 wgmma (k-steps of 16 head dims), committed as one group.
// SWAP (diagnostic) exchanges the descriptor's LBO and SBO.
template <int SWAP>
__device__ __forceinline__ void issue_scores(float (&s)[4], uint32_t a_s, uint32_t q_s) {
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const uint64_t da = SWAP ? smem_desc<128, 1024>(a_s + ks * 2048)
                             : smem_desc<1024, 128>(a_s + ks * 2048);
    wgmma_m64n8k16(s, da, smem_desc<128, 128>(q_s + ks * 256), ks > 0);
  }
}

// One warp's tiles [t_lo, t_hi) in TPS-tile steps (TPS 1 or 2) over a PIPE-stage ring, the
// scores by wgmma; `steps` is the same for the 4 warps of the CTA.
template <int DQ, int PIPE, int TPS, int SWAP>
__device__ __forceinline__ void warpgroup_pipe(const Params& p, int b, int h, int seq_len,
                                               int t_lo, int t_hi, int steps, int lane, int warp,
                                               uint8_t* ring, uint32_t a_s, uint32_t q_s,
                                               float qk, State& st) {
  const LaneCp ln = Nvfp4Fmt<DQ>::lane_of(p, h, lane);
  PageCursor pc;
  cursor_init(pc, p, b, seq_len, t_lo, lane);
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
#pragma unroll
  for (int i = 0; i < PIPE - TPS; ++i) {
    if (t_lo + i < t_hi) issue_tile_w(ring_s + i * kStageBytes, p, pc, ln, t_lo + i, lane);
    cp_commit();
  }
  store_q(p, b, h, q_s);
  const int end = min(seq_len, t_hi * 16);
  int slot = 0;
  for (int i = 0, tt = t_lo; i < steps; ++i, tt += TPS) {
    cp_wait<PIPE - 2 * TPS>();
    __syncwarp();
    const int ns = (slot + PIPE - TPS) % PIPE;               // slots read last step
#pragma unroll
    for (int j = 0; j < TPS; ++j) {
      const int tn = tt + PIPE - TPS + j;
      if (tn < t_hi) issue_tile_w(ring_s + ((ns + j) % PIPE) * kStageBytes, p, pc, ln, tn, lane);
      cp_commit();
    }
    const bool live = tt < t_hi;                             // warp-uniform
    const uint8_t* sa = ring + slot * kStageBytes;
    const uint8_t* sb = ring + ((slot + 1) % PIPE) * kStageBytes;
    if (live) {
      stage_k<DQ>(sa, a_s, lane, warp);
      if (TPS == 2) stage_k<DQ>(sb, a_s + kATile, lane, warp);
    }
    fence_async_smem();
    __syncthreads();
    float x[2][4];
    wgmma_fence();
    issue_scores<SWAP>(x[0], a_s, q_s);
    if (TPS == 2) issue_scores<SWAP>(x[1], a_s + kATile, q_s);
    wgmma_commit();
    Tile ta, tb;
    if (live) {
      read_v(ta, sa, lane);
      if (TPS == 2) read_v(tb, sb, lane);
    }
    wgmma_wait0();
    pin(x[0]);
    if (TPS == 2) pin(x[1]);
    slot = (slot + TPS) % PIPE;
    if (!live) continue;
    const int rem = end - tt * 16;
    if (TPS == 1) {
      if (rem >= 16) scores_pv<DQ, false>(x[0], ta, qk, 16, lane, st);
      else scores_pv<DQ, true>(x[0], ta, qk, rem, lane, st);
    } else {
      uint32_t pb[2][2], vm[2][2];
      if (rem >= 32) softmax_pair<false>(x, qk, 32, lane, st, pb, vm);
      else softmax_pair<true>(x, qk, rem, lane, st, pb, vm);
      tile_pv<DQ>(ta, pb[0][0], pb[0][1], vm[0][0], vm[0][1], st);
      tile_pv<DQ>(tb, pb[1][0], pb[1][1], vm[1][0], vm[1][1], st);
    }
  }
  cp_wait<0>();
}

}  // namespace nibble_nvfp4
