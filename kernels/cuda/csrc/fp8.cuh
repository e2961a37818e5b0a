// Device code, part 3: the FP8 E4M3 format policy (Fp8Fmt) of the decode kernel.
//
// Same CTA/warp structure, ring, softmax and combine as NVFP4 (see decode.cu); only the tile
// data and its conversion differ. FP8 pages have no block scales: the layer's K scale folds
// into the softmax scale and its V scale into the partial output.
//
// * Copies: a tile's K (and V) rows are 2 KB contiguous in the page; each warp-wide 16-byte
//   cp.async moves 512 contiguous bytes, so every L2 request is a whole 128-byte line
//   (copies along the fragment layout asked for half lines, and L2 tag lookups, not DRAM,
//   capped the kernel at 62% of bandwidth). In the stage, 16-byte chunk u of row r sits at
//   r * 128 + 16 * (u ^ f(r)), f(r) = 2 * ((r >> 1) & 3) ^ 4 * (r & 1), which makes both
//   fragment reads below conflict-free.
// * Scores (swap-AB, tokens on M): lane (g, t) reads bytes [16t, 16t + 16) and
//   [64 + 16t, 64 + 16t + 16) of tokens g and 8 + g. Word w of chunk c is k-step 4c + w:
//   cvt.rn.f16x2.e4m3x2 of its low half is A fragment register a0 (a1 for token 8 + g), of
//   its high half a2 (a3). Q uses the same head-dim order.
// * Output (O^T = V^T P^T): lane (g, t) reads head-dim bytes [16g, 16g + 16) of tokens
//   2t, 2t + 1, 8 + 2t, 9 + 2t; one byte permute pairs two tokens' bytes, and one cvt per
//   fp16x2 register gives the A fragment (head dims 16g + 2i and 16g + 2i + 1 of m-tile i,
//   the accumulator layout NVFP4 uses).
// * Masked tiles clear V of tokens past the end (E4M3 0x7f is NaN, and stale ring bytes may
//   hold it): P is zero there, but 0 * NaN is not.
#pragma once
#include "pipe.cuh"

namespace nibble_nvfp4 {

// ---- FP8 E4M3 ring stage (4 KB per tile): K rows [16][128 B] then V rows, swizzled.
constexpr int kStage8 = 4096, kV8Off = 2048;

// Stage offset of 16-byte chunk u of row r (see the module notes).
__device__ __forceinline__ uint32_t swz8(int r, int u) {
  return (uint32_t)(r * 128 + ((u ^ ((((r >> 1) & 3) << 1) ^ ((r & 1) << 2))) << 4));
}

struct LaneCp8 {
  uint32_t k, v;        // global: byte 16 * lane of the tile's K / V rows (page 0, tile 0)
  uint32_t dst[4];      // stage: where copy i (rows 4i .. 4i+3) puts this lane's chunk
  uint32_t rk[4], rv[4];  // stage: this lane's fragment chunks (scores8 / pv8 order)
};

// Four E4M3 bytes -> two fp16x2: lo = bytes {0, 1}, hi = bytes {2, 3} (exact).
__device__ __forceinline__ void e4m3x4_f16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n"
      " cvt.rn.f16x2.e4m3x2 %1, b;\n}" : "=r"(lo), "=r"(hi) : "r"(w));
}

__device__ __forceinline__ uint4 lds16(const uint8_t* s) {
  return *reinterpret_cast<const uint4*>(s);
}

// S^T = K Q^T for one tile from its ring stage: s[0..1] token g, s[2..3] token 8+g.
__device__ __forceinline__ void scores8(const uint8_t* st, const LaneCp8& ln,
                                        const uint32_t (&qf)[8][2], float (&s)[4]) {
  const uint4 a0 = lds16(st + ln.rk[0]), a1 = lds16(st + ln.rk[1]);
  const uint4 b0 = lds16(st + ln.rk[2]), b1 = lds16(st + ln.rk[3]);
  const uint32_t wa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  const uint32_t wb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
  float e[4] = {0.f, 0.f, 0.f, 0.f}, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t al, ah, bl, bh;
    e4m3x4_f16x4(wa[j], al, ah);
    e4m3x4_f16x4(wb[j], bl, bh);
    if (j & 1) mma16816(o, al, bl, ah, bh, qf[j][0], qf[j][1]);
    else mma16816(e, al, bl, ah, bh, qf[j][0], qf[j][1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = e[i] + o[i];
}

// O^T += V^T P^T for one tile from its ring stage; vm0/vm1 clear tokens past the end.
template <bool MASK>
__device__ __forceinline__ void pv8(const uint8_t* st, const LaneCp8& ln, uint32_t pb0,
                                    uint32_t pb1, uint32_t vm0, uint32_t vm1, State& s) {
  const uint4 va = lds16(st + ln.rv[0]), vb = lds16(st + ln.rv[1]);
  const uint4 vc = lds16(st + ln.rv[2]), vd = lds16(st + ln.rv[3]);
  const uint32_t A[4] = {va.x, va.y, va.z, va.w}, B[4] = {vb.x, vb.y, vb.z, vb.w};
  const uint32_t C[4] = {vc.x, vc.y, vc.z, vc.w}, D[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int zs = 0; zs < 2; ++zs) {
      const uint32_t sel = zs ? 0x7362 : 0x5140;   // {A.b, B.b, A.b', B.b'}
      uint32_t x0, x1, y0, y1;
      e4m3x4_f16x4(__byte_perm(A[w], B[w], sel), x0, x1);
      e4m3x4_f16x4(__byte_perm(C[w], D[w], sel), y0, y1);
      if (MASK) { x0 &= vm0; x1 &= vm0; y0 &= vm1; y1 &= vm1; }
      mma16816(s.acc[2 * w + zs], x0, x1, y0, y1, pb0, pb1);
    }
  }
}

// Query fragment for FP8 K: head h*G + g (zero when g >= G), k-step j = 4c + w holds head
// dims d, d+1 (b0) and d+2, d+3 (b1) with d = 64c + 16t + 4w.
__device__ __forceinline__ void load_q8(const Params& p, int b, int h, int lane,
                                        uint32_t (&qf)[8][2]) {
  const int g = lane >> 2, t = lane & 3;
  float v[32];
  const long long row = (long long)b * p.q_b + (long long)(h * p.group + g) * p.q_h;
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    const long long d = row + 64 * (e >> 4) + 16 * t + (e & 15);
    if (g >= p.group) v[e] = 0.f;
    else if (p.q_dtype == 0) v[e] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p.q)[d]);
    else if (p.q_dtype == 1) v[e] = __half2float(reinterpret_cast<const __half*>(p.q)[d]);
    else v[e] = reinterpret_cast<const float*>(p.q)[d];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    qf[j][0] = pack_h2(v[4 * j], v[4 * j + 1]);
    qf[j][1] = pack_h2(v[4 * j + 2], v[4 * j + 3]);
  }
}

struct Fp8Fmt {
  static constexpr int kStage = kStage8;
  typedef LaneCp8 LaneT;
  __device__ static __forceinline__ LaneT lane_of(const Params& p, int h, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const uint32_t row0 = (uint32_t)(h * p.page_size);
    LaneT ln;
    ln.k = row0 * 128 + 16 * lane;
    ln.v = (uint32_t)(p.vd - p.kd) + row0 * 128 + 16 * lane;
#pragma unroll
    for (int i = 0; i < 4; ++i) ln.dst[i] = swz8(4 * i + (lane >> 3), lane & 7);
    ln.rk[0] = swz8(g, t); ln.rk[1] = swz8(g, 4 + t);
    ln.rk[2] = swz8(8 + g, t); ln.rk[3] = swz8(8 + g, 4 + t);
    ln.rv[0] = kV8Off + swz8(2 * t, g); ln.rv[1] = kV8Off + swz8(2 * t + 1, g);
    ln.rv[2] = kV8Off + swz8(8 + 2 * t, g); ln.rv[3] = kV8Off + swz8(9 + 2 * t, g);
    return ln;
  }
  __device__ static __forceinline__ void issue(uint32_t stage, const Params& p, PageCursor& pc,
                                               const LaneT& ln, int tile, int lane) {
    const uint32_t off = (uint32_t)tile & ((1u << p.tpp_log2) - 1u);
    const uint8_t* pg = page_base(p, pc.page(tile >> p.tpp_log2, lane));
    const uint8_t* kp = ptr_add(pg, off * (16 * 128) + ln.k);
    const uint8_t* vp = ptr_add(pg, off * (16 * 128) + ln.v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cp16(stage + ln.dst[i], kp + 512 * i);
      cp16(stage + kV8Off + ln.dst[i], vp + 512 * i);
    }
  }
  template <bool MASK>
  __device__ static __forceinline__ void one(const uint8_t* s, const LaneT& ln,
                                             const uint32_t (&qf)[8][2], float qk, int rem,
                                             int lane, State& st) {
    // The two-tile softmax step with tile b empty (all of it past `rem`).
    float x[2][4];
    scores8(s, ln, qf, x[0]);
    x[1][0] = x[1][1] = x[1][2] = x[1][3] = 0.f;
    uint32_t pb[2][2], vm[2][2];
    softmax_pair<true>(x, qk, MASK ? rem : 16, lane, st, pb, vm);
    pv8<MASK>(s, ln, pb[0][0], pb[0][1], vm[0][0], vm[0][1], st);
  }
  template <bool MASK>
  __device__ static __forceinline__ void pair(const uint8_t* sa, const uint8_t* sb,
                                              const LaneT& ln, const uint32_t (&qf)[8][2],
                                              float qk, int rem, int lane, State& st) {
    float x[2][4];
    scores8(sa, ln, qf, x[0]);
    scores8(sb, ln, qf, x[1]);
    uint32_t pb[2][2], vm[2][2];
    softmax_pair<MASK>(x, qk, rem, lane, st, pb, vm);
    pv8<MASK>(sa, ln, pb[0][0], pb[0][1], vm[0][0], vm[0][1], st);
    pv8<MASK>(sb, ln, pb[1][0], pb[1][1], vm[1][0], vm[1][1], st);
  }
};

}  // namespace nibble_nvfp4
