"""CUDA C++ sources of the NVFP4 decode kernel, kept as strings (built on first use).

``PARAMS`` is shared by the device code (``CUDA_SRC``) and the torch binding
(``CPP_SRC``). The device code includes no torch header, so nvcc compiles it
quickly and it can also be compiled alone (``nvcc -cubin``) to read registers
and SASS.

Kernel design (one CTA = 4 warps for one (sequence, KV head, split); each warp
runs its own online softmax over a contiguous range of 16-token tiles, then the
4 warps combine through shared memory and write one partial):

* S = Q K^T with ``mma.sync.m16n8k16`` fp16 -> fp32: A = the query group (rows
  = query heads, up to 8 real of 16), B = K^T (n = 8 tokens). The head dim of
  each k-step is permuted so that lane ``(g, t)`` (``g = lane / 4``,
  ``t = lane % 4``) needs exactly head-dim elements ``[32t, 32t + 32)`` of token
  ``g`` (and ``8 + g``): one 16-byte load per token row, no shuffles. Q uses the
  same permutation.
* O^T = V^T P^T with swap-AB: A = V^T (rows = head dim, 8 m-tiles), B = P^T
  (k = 16 tokens, n = 8 query heads). The S accumulator of lane ``(g, t)`` is
  exactly its P^T fragment (head ``g``, tokens ``2t, 2t+1, 8+2t, 9+2t``), so P
  never leaves registers. Lane ``(g, t)`` owns head-dim block ``g``
  (``d = 16g .. 16g+15``) of those 4 tokens: one 8-byte load per token row.
* E2M1 -> fp16 by bit placement: ``s << 15 | m << 9`` is exactly value * 2^-14
  (7 logic ops + 4 byte permutes per 8 codes). Block scales are converted with
  ``cvt.rn.f16x2.e4m3x2``, times 2^7 (so every product is an exact normal-range
  fp16), and applied with one ``HMUL2`` per 2 elements. The 2^7 * 2^-14 and the
  global scales fold into the softmax scale (K) and the partial output (V).
* Online softmax in the log2 domain with a lazy rescale: the running max moves
  only when a tile's max exceeds it by more than 8, so ``p <= 256`` and the
  accumulator is rescaled rarely (a warp vote skips it otherwise).
* The next tile's codes and scales are loaded into registers while the current
  one is computed (ping-pong buffers, ``ld.global.nc.L1::no_allocate``).
"""

PARAMS = r"""
#include <stdint.h>
namespace nibble_nvfp4 {
struct Params {
  const void* q; long long q_b, q_h; int q_dtype;      // dtype 0 bf16, 1 fp16, 2 fp32
  const int* bt; long long bt_b;                        // block tables [B, M] int32
  const void* seq_lens; int seq_i64;                    // [B] int32 or int64
  const uint8_t* kd; const uint8_t* vd;                 // code sections of layer 0 of page 0
  const uint8_t* ks; const uint8_t* vs;                 // scale sections
  long long page_stride;                                // bytes between pages
  int page_size, tpp_log2, num_kv_heads, group, nsplit; // tpp = page_size / 16 tiles per page
  const float* k_gs; const float* v_gs;                 // global scales (1 fp32 each)
  float qk_scale;                                       // sm_scale * log2(e) * 2^7
  float* part_o; float* part_ml;                        // [B, Hq, nsplit, 128], [.., 2]
};
void launch_decode(const Params& p, int batch, int variant, void* stream);
void launch_reduce(const float* part_o, const float* part_ml, void* out, long long o_b,
                   long long o_h, int out_dtype, int batch, int hq, int nsplit, void* stream);
int decode_occupancy(int variant);
}  // namespace nibble_nvfp4
"""

CUDA_SRC = PARAMS + r"""
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>

namespace nibble_nvfp4 {

constexpr int kD = 128, kWarps = 4, kMaxGroup = 8;
constexpr int kCombineO = kWarps * kMaxGroup * kD * 4, kCombineBytes = kCombineO + 256;
constexpr float kLazy = 8.0f;
constexpr unsigned kFull = 0xffffffffu;

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

// 8 E2M1 codes (4 bytes, low nibble first) -> 4 fp16x2 (c_i = nibble i):
// r0 = {c0, c2}, r1 = {c4, c6}, r2 = {c1, c3}, r3 = {c5, c7}.
// DQ 0: each code's fp16 high byte is built (s << 7 | m << 1) and placed over a zero low
//       byte with a byte permute: value * 2^-14.
// DQ 1: each code becomes an E4M3 byte (s << 7 | m << 2) and cvt.rn.f16x2.e4m3x2 widens
//       two at a time: value * 2^-6.
template <int DQ>
__device__ __forceinline__ void dq8(uint32_t w, uint32_t (&r)[4]) {
  if (DQ == 0) {
    const uint32_t l = ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
    const uint32_t h = (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
    r[0] = __byte_perm(l, 0, 0x1404);
    r[1] = __byte_perm(l, 0, 0x3424);
    r[2] = __byte_perm(h, 0, 0x1404);
    r[3] = __byte_perm(h, 0, 0x3424);
  } else {
    const uint32_t l = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
    const uint32_t h = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
    asm("{.reg .b16 a, b, c, d;\n mov.b32 {a, b}, %4;\n mov.b32 {c, d}, %5;\n"
        " cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n"
        " cvt.rn.f16x2.e4m3x2 %2, c;\n cvt.rn.f16x2.e4m3x2 %3, d;\n}"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(l), "r"(h));
  }
}

// fp16x2 factor on the block scales so that code * scale = value * scale * 2^-7 (exact).
template <int DQ> struct ScaleMul { static constexpr uint32_t kH2 = DQ ? 0x38003800u : 0x58005800u; };

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

__device__ __forceinline__ void load_tile(Tile& x, const Params& p, PageCursor& pc,
                                          const Lane& ln, int tile, int lane) {
  const int page = pc.page(tile >> p.tpp_log2, lane);
  const int off = tile & ((1 << p.tpp_log2) - 1);              // tile index in the page
  const uint8_t* base = p.kd + (long long)page * p.page_stride + off * (16 * 64);
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
  // Lazy max: only when some score exceeds its head's max by > kLazy (rare after the
  // first tiles) does the warp reduce the tile max and rescale.
  const bool upd = fmaxf(x0, x2) > st.m0 + kLazy || fmaxf(x1, x3) > st.m1 + kLazy;
  if (__any_sync(kFull, upd)) {
    float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
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

// Runs one warp over tiles [t_lo, t_hi) of sequence b, KV head h.
template <int DQ>
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
  if (tt < full_hi) load_tile(A, p, pc, ln, tt, lane);
  while (tt < full_hi) {
    const bool more = tt + 1 < full_hi;
    if (more) load_tile(B, p, pc, ln, tt + 1, lane);
    compute_tile<DQ, false>(A, qf, qk, 16, lane, st);
    if (!more) { ++tt; break; }
    if (tt + 2 < full_hi) load_tile(A, p, pc, ln, tt + 2, lane);
    compute_tile<DQ, false>(B, qf, qk, 16, lane, st);
    tt += 2;
  }
  if (full_hi < t_hi) {
    load_tile(A, p, pc, ln, full_hi, lane);
    compute_tile<DQ, true>(A, qf, qk, seq_len - full_hi * 16, lane, st);
  }
}

// ---- cp.async pipeline (PIPE stages per warp, shared memory): per stage, lane-private
// code chunks [chunk][lane] (conflict-free 16/8-byte accesses) and the tile's two
// 128-byte scale blocks copied by lanes 0-15.
constexpr int kStageBytes = 2304, kKOff = 0, kVOff = 1024, kKsOff = 2048, kVsOff = 2176;

__device__ __forceinline__ void cp16(uint32_t dst, const uint8_t* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp8(uint32_t dst, const uint8_t* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

struct LaneCp {         // per-lane byte offsets from the K code section of page 0, tile 0
  uint32_t k, v, sc;    // sc: this lane's 16-byte piece of a scale block (lanes 0-15)
};

__device__ __forceinline__ void issue_tile(uint32_t stage, const Params& p, PageCursor& pc,
                                           const LaneCp& ln, int tile, int lane) {
  const int page = pc.page(tile >> p.tpp_log2, lane);
  const int off = tile & ((1 << p.tpp_log2) - 1);
  const uint8_t* pg = p.kd + (long long)page * p.page_stride;
  const uint8_t* kp = pg + off * (16 * 64) + ln.k;
  const uint8_t* vp = pg + off * (16 * 64) + ln.v;
  cp16(stage + kKOff + lane * 16, kp);
  cp16(stage + kKOff + 512 + lane * 16, kp + 8 * 64);
  cp8(stage + kVOff + lane * 8, vp);
  cp8(stage + kVOff + 256 + lane * 8, vp + 64);
  cp8(stage + kVOff + 512 + lane * 8, vp + 8 * 64);
  cp8(stage + kVOff + 768 + lane * 8, vp + 9 * 64);
  if (lane < 16) cp16(stage + kKsOff + lane * 16, pg + off * (16 * 8) + ln.sc);
}

__device__ __forceinline__ void read_tile(Tile& x, const uint8_t* st, int lane) {
  const int g = lane >> 2, t = lane & 3;
  x.k[0] = *reinterpret_cast<const uint4*>(st + kKOff + lane * 16);
  x.k[1] = *reinterpret_cast<const uint4*>(st + kKOff + 512 + lane * 16);
#pragma unroll
  for (int j = 0; j < 4; ++j) x.v[j] = *reinterpret_cast<const uint2*>(st + kVOff + j * 256 + lane * 8);
  x.ks[0] = *reinterpret_cast<const unsigned short*>(st + kKsOff + g * 8 + 2 * t);
  x.ks[1] = *reinterpret_cast<const unsigned short*>(st + kKsOff + (8 + g) * 8 + 2 * t);
  x.vs[0] = st[kVsOff + (2 * t) * 8 + g];
  x.vs[1] = st[kVsOff + (2 * t + 1) * 8 + g];
  x.vs[2] = st[kVsOff + (8 + 2 * t) * 8 + g];
  x.vs[3] = st[kVsOff + (9 + 2 * t) * 8 + g];
}

// Runs one warp over tiles [t_lo, t_hi) with a PIPE-stage cp.async ring in `ring`.
template <int DQ, int PIPE>
__device__ __forceinline__ void warp_tiles_pipe(const Params& p, int b, int h, int seq_len,
                                                int t_lo, int t_hi, int lane, uint8_t* ring,
                                                const uint32_t (&qf)[8][2], float qk, State& st) {
  const int g = lane >> 2, t = lane & 3;
  const uint32_t row0 = (uint32_t)(h * p.page_size);
  const uint32_t ks0 = (uint32_t)(p.ks - p.kd), vd0 = (uint32_t)(p.vd - p.kd);
  const uint32_t vs0 = (uint32_t)(p.vs - p.kd);
  const LaneCp ln = {(row0 + g) * 64 + 16 * t, vd0 + (row0 + 2 * t) * 64 + 8 * g,
                     (lane < 8 ? ks0 : vs0) + row0 * 8 + (lane & 7) * 16};
  PageCursor pc;
  pc.row = p.bt + (long long)b * p.bt_b;
  pc.n_pages = (seq_len + p.page_size - 1) / p.page_size;
  pc.init(t_lo >> p.tpp_log2, lane);
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
#pragma unroll
  for (int i = 0; i < PIPE - 1; ++i) {
    if (t_lo + i < t_hi) issue_tile(ring_s + i * kStageBytes, p, pc, ln, t_lo + i, lane);
    cp_commit();
  }
  int slot = 0;
  for (int tt = t_lo; tt < t_hi; ++tt) {
    cp_wait<PIPE - 2>();
    __syncwarp();
    Tile x;
    read_tile(x, ring + slot * kStageBytes, lane);
    const int nslot = slot == 0 ? PIPE - 1 : slot - 1;       // the stage read last iteration
    if (tt + PIPE - 1 < t_hi) issue_tile(ring_s + nslot * kStageBytes, p, pc, ln, tt + PIPE - 1, lane);
    cp_commit();
    slot = slot == PIPE - 1 ? 0 : slot + 1;
    const int rem = seq_len - tt * 16;
    if (rem >= 16) compute_tile<DQ, false>(x, qf, qk, 16, lane, st);
    else compute_tile<DQ, true>(x, qf, qk, rem, lane, st);
  }
  cp_wait<0>();
}

// The 4 warps' (m, l, O) -> one partial per query head of the group.
__device__ __forceinline__ void combine_warps(const Params& p, int b, int h, int c, int lane,
                                             int warp, uint8_t* smem, State& st) {
  float (*s_o)[kMaxGroup][kD] = reinterpret_cast<float (*)[kMaxGroup][kD]>(smem);
  float (*s_m)[kMaxGroup] = reinterpret_cast<float (*)[kMaxGroup]>(smem + kCombineO);
  float (*s_l)[kMaxGroup] = reinterpret_cast<float (*)[kMaxGroup]>(smem + kCombineO + 128);
  __syncthreads();                                // every warp is done with the ring
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int sh = 4; sh < 32; sh <<= 1) {
    st.l0 += __shfl_xor_sync(kFull, st.l0, sh);
    st.l1 += __shfl_xor_sync(kFull, st.l1, sh);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    s_o[warp][2 * t][16 * g + 2 * i] = st.acc[i][0];
    s_o[warp][2 * t + 1][16 * g + 2 * i] = st.acc[i][1];
    s_o[warp][2 * t][16 * g + 2 * i + 1] = st.acc[i][2];
    s_o[warp][2 * t + 1][16 * g + 2 * i + 1] = st.acc[i][3];
  }
  if (g == 0) {
    s_m[warp][2 * t] = st.m0; s_m[warp][2 * t + 1] = st.m1;
    s_l[warp][2 * t] = st.l0; s_l[warp][2 * t + 1] = st.l1;
  }
  __syncthreads();
  const int d = threadIdx.x;
  const float vfac = 128.f * __ldg(p.v_gs);
  const int hq_total = p.num_kv_heads * p.group;
  for (int hh = 0; hh < p.group; ++hh) {
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][hh]);
    float o = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = s_m[w][hh] == -INFINITY ? 0.f : ex2(s_m[w][hh] - mx);
      o += wt * s_o[w][hh][d];
      l += wt * s_l[w][hh];
    }
    const long long idx = ((long long)b * hq_total + h * p.group + hh) * p.nsplit + c;
    p.part_o[idx * kD + d] = o * vfac;
    if (d == 0) { p.part_ml[idx * 2] = mx; p.part_ml[idx * 2 + 1] = l; }
  }
}

template <int MINB, int DQ, int PIPE>
__global__ void __launch_bounds__(128, MINB) decode_kernel(const Params p) {
  extern __shared__ uint4 smem_u4[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(smem_u4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int seq_len = seq_len_of(p, b);
  const int n_tiles = (seq_len + 15) >> 4;
  const int nw = p.nsplit * kWarps;
  const int per = (n_tiles + nw - 1) / nw;
  const int t_lo = min((c * kWarps + warp) * per, n_tiles);
  const int t_hi = min(t_lo + per, n_tiles);
  uint32_t qf[8][2];
  load_q(p, b, h, lane, qf);
  State st;
#pragma unroll
  for (int i = 0; i < 8; ++i) st.acc[i][0] = st.acc[i][1] = st.acc[i][2] = st.acc[i][3] = 0.f;
  st.m0 = st.m1 = -INFINITY;
  st.l0 = st.l1 = 0.f;
  const float qk = p.qk_scale * __ldg(p.k_gs);
  if (PIPE == 0) {
    if (t_lo < t_hi) warp_tiles<DQ>(p, b, h, seq_len, t_lo, t_hi, lane, qf, qk, st);
  } else {
    warp_tiles_pipe<DQ, PIPE>(p, b, h, seq_len, t_lo, t_hi, lane,
                              smem + warp * PIPE * kStageBytes, qf, qk, st);
  }
  combine_warps(p, b, h, c, lane, warp, smem, st);
}

// out[b, hq, :] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s; one CTA of 128 per (b, hq).
__global__ void __launch_bounds__(128) reduce_kernel(const float* __restrict__ po,
                                                     const float* __restrict__ pml, void* out,
                                                     long long o_b, long long o_h, int out_dtype,
                                                     int hq, int nsplit) {
  const int bq = blockIdx.x, d = threadIdx.x;
  const long long base = (long long)bq * nsplit;
  float mx = -INFINITY;
  for (int s = 0; s < nsplit; ++s) mx = fmaxf(mx, pml[(base + s) * 2]);
  float o = 0.f, l = 0.f;
  for (int s = 0; s < nsplit; ++s) {
    const float m = pml[(base + s) * 2];
    const float wt = m == -INFINITY ? 0.f : ex2(m - mx);
    o += wt * po[(base + s) * kD + d];
    l += wt * pml[(base + s) * 2 + 1];
  }
  const float r = l > 0.f ? o / l : 0.f;
  const long long oi = (long long)(bq / hq) * o_b + (long long)(bq % hq) * o_h + d;
  if (out_dtype == 0) reinterpret_cast<__nv_bfloat16*>(out)[oi] = __float2bfloat16_rn(r);
  else if (out_dtype == 1) reinterpret_cast<__half*>(out)[oi] = __float2half_rn(r);
  else reinterpret_cast<float*>(out)[oi] = r;
}

// variant = 100 * PIPE + 10 * DQ + MINB: PIPE = cp.async stages per warp (0: register
// ping-pong), DQ = dequant form, MINB = CTAs per SM the register cap allows (4 -> 128 regs).
#define NIBBLE_VARIANTS(X) X(4, 0, 0) X(3, 0, 0) X(4, 1, 0) X(4, 0, 4) X(5, 0, 4) X(4, 0, 3) \
  X(4, 1, 4) X(5, 1, 4)

static int smem_bytes(int pipe) {
  const int ring = kWarps * pipe * kStageBytes;
  return ring > kCombineBytes ? ring : kCombineBytes;
}

void launch_decode(const Params& p, int batch, int variant, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  dim3 grid(p.nsplit, p.num_kv_heads, batch);
#define NIBBLE_LAUNCH(M, Q, P) \
  if (variant == 100 * P + 10 * Q + M) { \
    decode_kernel<M, Q, P><<<grid, kWarps * 32, smem_bytes(P), s>>>(p); return; }
  NIBBLE_VARIANTS(NIBBLE_LAUNCH)
#undef NIBBLE_LAUNCH
  decode_kernel<4, 0, 0><<<grid, kWarps * 32, smem_bytes(0), s>>>(p);
}

void launch_reduce(const float* part_o, const float* part_ml, void* out, long long o_b,
                   long long o_h, int out_dtype, int batch, int hq, int nsplit, void* stream) {
  reduce_kernel<<<batch * hq, kD, 0, static_cast<cudaStream_t>(stream)>>>(
      part_o, part_ml, out, o_b, o_h, out_dtype, hq, nsplit);
}

int decode_occupancy(int variant) {
  int n = 0;
#define NIBBLE_FN(M, Q, P) \
  if (variant == 100 * P + 10 * Q + M) \
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_kernel<M, Q, P>, kWarps * 32, \
                                                  smem_bytes(P));
  NIBBLE_VARIANTS(NIBBLE_FN)
#undef NIBBLE_FN
  return n;
}

}  // namespace nibble_nvfp4
"""

CPP_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
""" + PARAMS + r"""
using namespace nibble_nvfp4;

static int dtype_code(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kBFloat16) return 0;
  if (t.scalar_type() == torch::kFloat16) return 1;
  return 2;
}

// Arguments are checked by the Python wrapper; this only packs pointers and launches.
void decode(torch::Tensor q, torch::Tensor bt, torch::Tensor seq_lens, torch::Tensor kd,
            torch::Tensor vd, torch::Tensor ks, torch::Tensor vs, int64_t page_stride,
            int64_t page_size, int64_t tpp_log2, int64_t group, torch::Tensor k_gs,
            torch::Tensor v_gs, double qk_scale, torch::Tensor part_o, torch::Tensor part_ml,
            torch::Tensor out, int64_t nsplit, int64_t variant) {
  TORCH_CHECK(q.is_cuda() && kd.is_cuda(), "decode: CUDA tensors expected");
  const c10::cuda::CUDAGuard guard(q.device());
  Params p;
  p.q = q.data_ptr(); p.q_b = q.stride(0); p.q_h = q.stride(1); p.q_dtype = dtype_code(q);
  p.bt = bt.data_ptr<int>(); p.bt_b = bt.stride(0);
  p.seq_lens = seq_lens.data_ptr(); p.seq_i64 = seq_lens.scalar_type() == torch::kInt64;
  p.kd = kd.data_ptr<uint8_t>(); p.vd = vd.data_ptr<uint8_t>();
  p.ks = ks.data_ptr<uint8_t>(); p.vs = vs.data_ptr<uint8_t>();
  p.page_stride = page_stride; p.page_size = (int)page_size; p.tpp_log2 = (int)tpp_log2;
  p.num_kv_heads = (int)kd.size(1); p.group = (int)group; p.nsplit = (int)nsplit;
  p.k_gs = k_gs.data_ptr<float>(); p.v_gs = v_gs.data_ptr<float>();
  p.qk_scale = (float)qk_scale;
  p.part_o = part_o.data_ptr<float>(); p.part_ml = part_ml.data_ptr<float>();
  const int batch = (int)q.size(0), hq = (int)q.size(1);
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  launch_decode(p, batch, (int)variant, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_reduce(p.part_o, p.part_ml, out.data_ptr(), out.stride(0), out.stride(1),
                dtype_code(out), batch, hq, (int)nsplit, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t occupancy(int64_t variant) { return decode_occupancy((int)variant); }
"""
