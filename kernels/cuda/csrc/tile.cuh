// Device code, part 1: loads, E2M1/E4M3 conversions, MMA helpers, the per-tile math, Q
// fragments and the register ping-pong tile loop (with its diagnostic modes).
// The kernel design is described at the top of decode.cu.
#pragma once
#include "params.cuh"

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <type_traits>

namespace nibble_nvfp4 {

constexpr int kD = 128, kWarps = 4, kMaxGroup = 8;
// The in-CTA combine's shared memory: O [4][8][128] fp32, m and l [4][8], then the fused
// combine's last-CTA flag.
constexpr int kCombineO = kWarps * kMaxGroup * kD * 4, kFlagOff = kCombineO + 256,
              kCombineBytes = kFlagOff + 16;
// The fused split combine: splits per group, and int32 counters per (sequence, KV head)
// (one for the groups, one per group; decode.py sizes the buffer).
constexpr int kSplitGroup = 16, kMaxSplitGroups = 16, kCtrStride = 1 + kMaxSplitGroups;
constexpr float kLazy = 8.0f;
constexpr unsigned kFull = 0xffffffffu;
// The loader (../_sources.py) passes decode.py's copies of these as -D defines; they must agree.
#ifdef NIBBLE_HEAD_DIM
static_assert(NIBBLE_HEAD_DIM == kD && NIBBLE_WARPS_PER_CTA == kWarps &&
              NIBBLE_MAX_GROUP == kMaxGroup && NIBBLE_COUNTER_STRIDE == kCtrStride &&
              NIBBLE_FUSED_CAPACITY == kSplitGroup * kMaxSplitGroups,
              "kernels/cuda/decode.py constants differ");
#endif

struct Tile {           // one 16-token tile as one lane holds it
  uint4 k[2];           // K codes: tokens g, 8+g; head-dim [32t, 32t+32)
  uint32_t ks[2];       // K scales: bytes 2t, 2t+1 of those tokens' scale rows
  uint2 v[4];           // V codes: tokens 2t, 2t+1, 8+2t, 9+2t; head-dim [16g, 16g+16)
  uint32_t vs[4];       // V scales: byte g of those tokens' scale rows
};

__device__ __forceinline__ uint4 ld_v4(const uint8_t* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ld_v2(const uint8_t* p) {
  uint2 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];"
      : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) {
  unsigned short r;
  asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t ld_u8(const uint8_t* p) {
  uint32_t r;
  asm("ld.global.nc.u8 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Two E4M3 bytes (low 16 bits) -> fp16x2 (low byte -> low half), exact.
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t v) {
  uint32_t r;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}"
      : "=r"(r) : "r"(v));
  return r;
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  __half2 x = *reinterpret_cast<__half2*>(&a), y = *reinterpret_cast<__half2*>(&b);
  __half2 z = __hmul2(x, y);
  return *reinterpret_cast<uint32_t*>(&z);
}
__device__ __forceinline__ uint32_t bcast_lo(uint32_t a) { return __byte_perm(a, 0, 0x1010); }
__device__ __forceinline__ uint32_t bcast_hi(uint32_t a) { return __byte_perm(a, 0, 0x3232); }
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  __half2 z = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&z);
}

// (b & c) | (a & ~c) in one LOP3 (inline PTX: written in C, the compiler re-derives the
// masks of the sign word and emits two LOP3 again).
__device__ __forceinline__ uint32_t lop3_sel(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xD8;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ uint32_t and_b32(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("and.b32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// 8 E2M1 codes (4 bytes, low nibble first) -> 4 fp16x2 (c_i = nibble i):
// r0 = {c0, c2}, r1 = {c4, c6}, r2 = {c1, c3}, r3 = {c5, c7}. Each code's fp16 high byte is
// built (s << 7 | m << 1, exactly value * 2^-14 with the subnormal code 1) and placed over a
// zero low byte with a byte permute. DQ 0: 4 LOP3 + 3 shifts + 4 PRMT per 8 codes (as the
// compiler emits the plain expression); DQ 2: 3 LOP3 + 3 shifts + 4 PRMT, one sign word
// shared by both nibble halves. (An E4M3-byte form widened by cvt.rn.f16x2.e4m3x2 was 1-2%
// slower and was removed.)
template <int DQ>
__device__ __forceinline__ void dq8(uint32_t w, uint32_t (&r)[4]) {
  uint32_t l, h;
  if (DQ == 0) {
    l = ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
    h = (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
  } else {
    // One sign word serves both halves: bits 1-3 of each byte come from the shifted
    // magnitudes, every other bit from the sign word, whose only set bits are 3 and 7 (bit 3
    // falls under the magnitude field and is dropped).
    const uint32_t s8 = and_b32(w, 0x88888888u);
    l = lop3_sel(s8 << 4, w << 1, 0x0E0E0E0Eu);
    h = lop3_sel(s8, w >> 3, 0x0E0E0E0Eu);
  }
  r[0] = __byte_perm(l, 0, 0x1404);
  r[1] = __byte_perm(l, 0, 0x3424);
  r[2] = __byte_perm(h, 0, 0x1404);
  r[3] = __byte_perm(h, 0, 0x3424);
}

// fp16x2 factor on the block scales so that code * scale = value * scale * 2^-7 (exact).
template <int DQ> struct ScaleMul {
  static constexpr uint32_t kH2 = 0x58005800u;   // 2^7
};

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct Lane {           // per-lane byte offsets from the K code section of page 0, tile 0
  uint32_t k, ks, v, vs;
};

struct PageCursor {     // block-table entries, 32 pages per lane-wide register, one chunk ahead
  const int* row; int n_pages, chunk, cur, nxt;
  __device__ __forceinline__ int fetch(int i, int lane) const {
    return (i + lane < n_pages) ? __ldg(row + i + lane) : 0;
  }
  __device__ __forceinline__ void init(int first, int lane) {
    chunk = first; cur = fetch(first, lane); nxt = fetch(first + 32, lane);
  }
  __device__ __forceinline__ int page(int pi, int lane) {  // pi grows by at most 1 per call
    if (pi - chunk >= 32) { chunk += 32; cur = nxt; nxt = fetch(chunk + 32, lane); }
    return __shfl_sync(kFull, cur, pi - chunk);
  }
};

// Start of a page's bytes: one IMAD.WIDE.U32 (the wrapper checks that the page stride fits
// 32 bits; block-table entries are non-negative), and 64-bit pointer + 32-bit offset as one
// add pair. Inline PTX keeps the compiler from re-deriving each copy's address with its own
// signed 64-bit multiply (about 60 integer instructions per tile's copy issue before).
__device__ __forceinline__ const uint8_t* page_base(const Params& p, int page) {
  const uint8_t* r;
  asm("mad.wide.u32 %0, %1, %2, %3;"
      : "=l"(r) : "r"((uint32_t)page), "r"((uint32_t)p.page_stride), "l"(p.kd));
  return r;
}
__device__ __forceinline__ const uint8_t* ptr_add(const uint8_t* base, uint32_t off) {
  const uint8_t* r;
  asm("{.reg .u64 t;\n cvt.u64.u32 t, %2;\n add.u64 %0, %1, t;\n}" : "=l"(r) : "l"(base), "r"(off));
  return r;
}

__device__ __forceinline__ void load_tile(Tile& x, const Params& p, PageCursor& pc,
                                          const Lane& ln, int tile, int lane) {
  const int page = pc.page(tile >> p.tpp_log2, lane);
  const int off = tile & ((1 << p.tpp_log2) - 1);              // tile index in the page
  const uint8_t* base = page_base(p, page) + off * (16 * 64);
  const uint8_t* kp = base + ln.k;
  const uint8_t* vp = base + ln.v;
  const uint8_t* ksp = base + (ln.ks - off * (16 * 64 - 16 * 8));
  const uint8_t* vsp = base + (ln.vs - off * (16 * 64 - 16 * 8));
  x.k[0] = ld_v4(kp);
  x.k[1] = ld_v4(kp + 8 * 64);
  x.ks[0] = ld_u16(ksp);
  x.ks[1] = ld_u16(ksp + 8 * 8);
  x.v[0] = ld_v2(vp);
  x.v[1] = ld_v2(vp + 64);
  x.v[2] = ld_v2(vp + 8 * 64);
  x.v[3] = ld_v2(vp + 9 * 64);
  x.vs[0] = ld_u8(vsp);
  x.vs[1] = ld_u8(vsp + 8);
  x.vs[2] = ld_u8(vsp + 8 * 8);
  x.vs[3] = ld_u8(vsp + 9 * 8);
}

struct State {
  float acc[8][4];      // O^T fragment: m-tile i, rows d = 16g+2i (+1), cols heads 2t, 2t+1
  float m0, m1, l0, l1; // running max (log2 domain) and partial sums, heads 2t and 2t+1
};

__device__ __forceinline__ uint32_t movm_trans(uint32_t a) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(a));
  return r;
}

// S^T = K Q^T for one tile (swap-AB: tokens on M). s[0..1] = token g, heads 2t, 2t+1;
// s[2..3] = token 8+g. The head-dim order of k-step 2m (+1) is that of dq8's r0/r2 (r1/r3).
template <int DQ>
__device__ __forceinline__ void tile_scores(const Tile& x, const uint32_t (&qf)[8][2],
                                            float (&s)[4]) {
  const uint32_t k128 = ScaleMul<DQ>::kH2;
  const uint32_t sa = hmul2(e4m3x2_f16x2(x.ks[0]), k128), sb = hmul2(e4m3x2_f16x2(x.ks[1]), k128);
  const uint32_t sa0 = bcast_lo(sa), sa1 = bcast_hi(sa), sb0 = bcast_lo(sb), sb1 = bcast_hi(sb);
  const uint32_t wa[4] = {x.k[0].x, x.k[0].y, x.k[0].z, x.k[0].w};
  const uint32_t wb[4] = {x.k[1].x, x.k[1].y, x.k[1].z, x.k[1].w};
  float e[4] = {0.f, 0.f, 0.f, 0.f}, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    uint32_t ra[4], rb[4];
    dq8<DQ>(wa[m], ra);
    dq8<DQ>(wb[m], rb);
    const uint32_t sca = m < 2 ? sa0 : sa1, scb = m < 2 ? sb0 : sb1;
#pragma unroll
    for (int i = 0; i < 4; ++i) { ra[i] = hmul2(ra[i], sca); rb[i] = hmul2(rb[i], scb); }
    mma16816(e, ra[0], rb[0], ra[2], rb[2], qf[2 * m][0], qf[2 * m][1]);
    mma16816(o, ra[1], rb[1], ra[3], rb[3], qf[2 * m + 1][0], qf[2 * m + 1][1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = e[i] + o[i];
}

// V^T fragments of one tile (scaled), then O^T += V^T P^T. Lane (g, t) holds head-dim
// d = 16g + j; m-tile i takes rows j = 2i (row g) and 2i + 1 (row g + 8).
template <int DQ>
__device__ __forceinline__ void tile_pv(const Tile& x, uint32_t pb0, uint32_t pb1,
                                        uint32_t vmask0, uint32_t vmask1, State& st) {
  const uint32_t k128 = ScaleMul<DQ>::kH2;
  const uint32_t sc0 = hmul2(e4m3x2_f16x2(x.vs[0] | (x.vs[1] << 8)), k128) & vmask0;
  const uint32_t sc1 = hmul2(e4m3x2_f16x2(x.vs[2] | (x.vs[3] << 8)), k128) & vmask1;
#pragma unroll
  for (int wi = 0; wi < 2; ++wi) {
#pragma unroll
    for (int zs = 0; zs < 2; ++zs) {
      // token pairs (2t, 2t+1) and (8+2t, 9+2t) interleaved byte-wise: {A.b, B.b, A.b', B.b'}
      const uint32_t sel = zs ? 0x7362 : 0x5140;
      uint32_t ra[4], rb[4];
      dq8<DQ>(__byte_perm(wi ? x.v[0].y : x.v[0].x, wi ? x.v[1].y : x.v[1].x, sel), ra);
      dq8<DQ>(__byte_perm(wi ? x.v[2].y : x.v[2].x, wi ? x.v[3].y : x.v[3].x, sel), rb);
#pragma unroll
      for (int i = 0; i < 4; ++i) { ra[i] = hmul2(ra[i], sc0); rb[i] = hmul2(rb[i], sc1); }
      const int i0 = 4 * wi + 2 * zs;     // r0/r2 = d j, j+1 (j = 8wi + 4zs); r1/r3 = j+2, j+3
      mma16816(st.acc[i0], ra[0], ra[2], rb[0], rb[2], pb0, pb1);
      mma16816(st.acc[i0 + 1], ra[1], ra[3], rb[1], rb[3], pb0, pb1);
    }
  }
}

// Lazy max: only when some score of this lane (maxima mx0, mx1 for heads 2t, 2t+1) exceeds
// its head's running max by > kLazy (rare after the first tiles) does the warp reduce the
// maxima, move the running max and rescale the sums and accumulators.
__device__ __forceinline__ void lazy_rescale(float mx0, float mx1, State& st) {
  const bool upd = mx0 > st.m0 + kLazy || mx1 > st.m1 + kLazy;
  if (!__any_sync(kFull, upd)) return;
#pragma unroll
  for (int sh = 4; sh < 32; sh <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(kFull, mx0, sh));
    mx1 = fmaxf(mx1, __shfl_xor_sync(kFull, mx1, sh));
  }
  mx0 = fmaxf(mx0, st.m0);
  mx1 = fmaxf(mx1, st.m1);
  const float a0 = ex2(st.m0 - mx0), a1 = ex2(st.m1 - mx1);
  st.m0 = mx0; st.m1 = mx1; st.l0 *= a0; st.l1 *= a1;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    st.acc[i][0] *= a0; st.acc[i][1] *= a1; st.acc[i][2] *= a0; st.acc[i][3] *= a1;
  }
}

template <int DQ, bool MASK>
__device__ __forceinline__ void compute_tile(const Tile& x, const uint32_t (&qf)[8][2],
                                             float qk, int rem, int lane, State& st) {
  const int g = lane >> 2, t = lane & 3;
  float s[4];
  tile_scores<DQ>(x, qf, s);
  float x0 = s[0] * qk, x1 = s[1] * qk, x2 = s[2] * qk, x3 = s[3] * qk;
  uint32_t vm0 = 0xffffffffu, vm1 = 0xffffffffu;
  if (MASK) {
    x0 = g < rem ? x0 : -INFINITY;
    x1 = g < rem ? x1 : -INFINITY;
    x2 = 8 + g < rem ? x2 : -INFINITY;
    x3 = 8 + g < rem ? x3 : -INFINITY;
    vm0 = (2 * t < rem ? 0x0000ffffu : 0u) | (2 * t + 1 < rem ? 0xffff0000u : 0u);
    vm1 = (8 + 2 * t < rem ? 0x0000ffffu : 0u) | (9 + 2 * t < rem ? 0xffff0000u : 0u);
  }
  lazy_rescale(fmaxf(x0, x2), fmaxf(x1, x3), st);
  const float p0 = ex2(x0 - st.m0), p1 = ex2(x1 - st.m1);
  const float p2 = ex2(x2 - st.m0), p3 = ex2(x3 - st.m1);
  st.l0 += p0 + p2;
  st.l1 += p1 + p3;
  // P as 8x8 fp16 blocks (tokens 0-7, 8-15) x heads, transposed into P^T B fragments.
  tile_pv<DQ>(x, movm_trans(pack_h2(p0, p1)), movm_trans(pack_h2(p2, p3)), vm0, vm1, st);
}

// Query fragment: head h*G + g (zero when g >= G), head-dim order of the K fragments.
__device__ __forceinline__ void load_q(const Params& p, int b, int h, int lane,
                                       uint32_t (&qf)[8][2]) {
  const int g = lane >> 2, t = lane & 3;
  float v[32];
  if (g < p.group) {
    const long long row = (long long)b * p.q_b + (long long)(h * p.group + g) * p.q_h + 32 * t;
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      if (p.q_dtype == 0)
        v[e] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p.q)[row + e]);
      else if (p.q_dtype == 1)
        v[e] = __half2float(reinterpret_cast<const __half*>(p.q)[row + e]);
      else
        v[e] = reinterpret_cast<const float*>(p.q)[row + e];
    }
  } else {
#pragma unroll
    for (int e = 0; e < 32; ++e) v[e] = 0.f;
  }
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    qf[2 * m][0] = pack_h2(v[8 * m + 0], v[8 * m + 2]);
    qf[2 * m][1] = pack_h2(v[8 * m + 1], v[8 * m + 3]);
    qf[2 * m + 1][0] = pack_h2(v[8 * m + 4], v[8 * m + 6]);
    qf[2 * m + 1][1] = pack_h2(v[8 * m + 5], v[8 * m + 7]);
  }
}

__device__ __forceinline__ int seq_len_of(const Params& p, int b) {
  return p.seq_i64 ? (int)reinterpret_cast<const long long*>(p.seq_lens)[b]
                   : reinterpret_cast<const int*>(p.seq_lens)[b];
}

// Diagnostic modes (bench only): 1 = loads without compute, 2 = compute without loads.
template <int MODE>
__device__ __forceinline__ void tile_or_fake(Tile& x, const Params& p, PageCursor& pc,
                                             const Lane& ln, int tile, int lane) {
  if (MODE != 2) { load_tile(x, p, pc, ln, tile, lane); return; }
  const uint32_t z = (uint32_t)(tile * 977 + lane) * 0x9E3779B9u;
  x.k[0] = make_uint4(z, z ^ 1u, z ^ 2u, z ^ 3u); x.k[1] = make_uint4(z ^ 4u, z ^ 5u, z ^ 6u, z);
  x.v[0] = make_uint2(z ^ 7u, z); x.v[1] = make_uint2(z, z ^ 8u);
  x.v[2] = make_uint2(z ^ 9u, z); x.v[3] = make_uint2(z, z ^ 10u);
  x.ks[0] = x.ks[1] = 0x3838u; x.vs[0] = x.vs[1] = x.vs[2] = x.vs[3] = 0x38u;
}

template <int DQ, int MODE, bool MASK>
__device__ __forceinline__ void tile_or_sink(const Tile& x, const uint32_t (&qf)[8][2], float qk,
                                             int rem, int lane, State& st) {
  if (MODE != 1) { compute_tile<DQ, MASK>(x, qf, qk, rem, lane, st); return; }
  const uint32_t v = x.k[0].x ^ x.k[0].y ^ x.k[0].z ^ x.k[0].w ^ x.k[1].x ^ x.k[1].y ^ x.k[1].z ^
                     x.k[1].w ^ x.v[0].x ^ x.v[0].y ^ x.v[1].x ^ x.v[1].y ^ x.v[2].x ^ x.v[2].y ^
                     x.v[3].x ^ x.v[3].y ^ x.ks[0] ^ x.ks[1] ^ x.vs[0] ^ x.vs[1] ^ x.vs[2] ^
                     x.vs[3];
  st.l0 += __uint_as_float(v & 0x3u);
}

// Runs one warp over tiles [t_lo, t_hi) of sequence b, KV head h.
template <int DQ, int MODE>
__device__ __forceinline__ void warp_tiles(const Params& p, int b, int h, int seq_len, int t_lo,
                                           int t_hi, int lane, const uint32_t (&qf)[8][2],
                                           float qk, State& st) {
  const int g = lane >> 2, t = lane & 3;
  const uint32_t row0 = (uint32_t)(h * p.page_size);
  const uint32_t ks0 = (uint32_t)(p.ks - p.kd), vd0 = (uint32_t)(p.vd - p.kd);
  const uint32_t vs0 = (uint32_t)(p.vs - p.kd);
  const Lane ln = {(row0 + g) * 64 + 16 * t, ks0 + (row0 + g) * 8 + 2 * t,
                   vd0 + (row0 + 2 * t) * 64 + 8 * g, vs0 + (row0 + 2 * t) * 8 + g};
  PageCursor pc;
  pc.row = p.bt + (long long)b * p.bt_b;
  pc.n_pages = (seq_len + p.page_size - 1) / p.page_size;
  pc.init(t_lo >> p.tpp_log2, lane);
  const int full_hi = (t_hi * 16 > seq_len) ? t_hi - 1 : t_hi;   // last tile partial?
  Tile A, B;
  int tt = t_lo;
  if (tt < full_hi) tile_or_fake<MODE>(A, p, pc, ln, tt, lane);
  while (tt < full_hi) {
    const bool more = tt + 1 < full_hi;
    if (more) tile_or_fake<MODE>(B, p, pc, ln, tt + 1, lane);
    tile_or_sink<DQ, MODE, false>(A, qf, qk, 16, lane, st);
    if (!more) { ++tt; break; }
    if (tt + 2 < full_hi) tile_or_fake<MODE>(A, p, pc, ln, tt + 2, lane);
    tile_or_sink<DQ, MODE, false>(B, qf, qk, 16, lane, st);
    tt += 2;
  }
  if (full_hi < t_hi) {
    tile_or_fake<MODE>(A, p, pc, ln, full_hi, lane);
    tile_or_sink<DQ, MODE, true>(A, qf, qk, seq_len - full_hi * 16, lane, st);
  }
}

}  // namespace nibble_nvfp4
