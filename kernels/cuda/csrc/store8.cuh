// NVFP4 quantize-and-store from FP8 E4M3 input without per-value floating point (store
// variant 1), included by store.cu. Bit-identical to variant 0 and to the reference
// (nibble.kernels.nvfp4.quantize_nvfp4):
//
// * The magnitude byte of an E4M3 value (its byte with the sign bit cleared, 0..126) orders
//   like the value. A block's scale and reciprocal depend only on its amax byte and the global
//   scale, so each CTA first builds a table in shared memory: 128 entries per tensor (K, V),
//   one thread per entry, with the reference arithmetic (two IEEE divisions and
//   cvt.rn.satfinite for the scale byte, inv = 1 / (scale * gs) clamped, 0 for a zero scale).
// * The E2M1 code of a value is the number of decision points P_j (0.25, 0.75, 1.25, 1.75,
//   2.5, 3.5, 5; '>' for P_1, P_3, P_5, P_7 and '>=' for the others, which is ties to even)
//   that fl(x * inv) passes. fl(x * inv) is monotone in x, so point j is passed exactly by the
//   magnitude bytes above a threshold byte th_j. The entry holds 127 - th_j in each of four
//   bytes: one 32-bit add to the word of four magnitude bytes sets bit 7 of each byte to
//   "passes P_j" (7-bit operands, no carry between bytes).
// * th_j: y = P_j * (scale * gs) rounded to E4M3 is the boundary's byte or the one above it
//   (the boundary is within 2^-22 of y relatively, E4M3 steps are >= 2^-4), so one check of the
//   reference comparison at that byte decides; tests/kernels/cuda/test_store8_emulation.py
//   checks this over every amax byte and many global scales.
// * The seven bits form a thermometer code: code = (p4, p2^p4^p6, p1^...^p7). They and the
//   sign bit go to the high nibble of each byte (3 shifts, 3 LOP3), and two byte permutes and
//   one shift put the even values' codes in the low nibbles.
//
// Per thread: NB consecutive 16-value blocks of one (token, head) row, of K and of V (all loads
// issued first); grid-stride over rows so that the table is built once per resident CTA.
#pragma once
#include "fp8.cuh"

namespace nibble_nvfp4 {

constexpr int kStore8Threads = 256;

// Decision point P_{j+1} between E2M1 magnitude codes j and j + 1.
__device__ __forceinline__ float e2m1_point(int j) {
  constexpr float kPoints[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
  return kPoints[j];
}

__device__ __forceinline__ float e4m3_value(uint32_t byte) {
  return __half2float(__ushort_as_half((unsigned short)(e4m3x2_f16x2(byte) & 0xffffu)));
}

__device__ __forceinline__ uint32_t e4m3_satfinite(float x) {
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(x));
  return pair & 0xffu;
}

// Largest magnitude byte m whose fl(value(m) * inv) does not pass point j (127: none passes).
__device__ __forceinline__ uint32_t threshold_byte(int j, float denom, float inv) {
  if (!(denom > 0.f)) return 127u;
  const float point = e2m1_point(j);
  const uint32_t c = e4m3_satfinite(__fmul_rn(point, denom));
  const float q = __fmul_rn(e4m3_value(c), inv);
  const bool pass = (j & 1) ? q >= point : q > point;
  return pass ? c - 1u : c;
}

// Table entry for amax byte m under global scale gs: word 0 the scale byte, words 1..7 the
// byte 127 - th_j in all four bytes.
__device__ __forceinline__ void build_entry(uint32_t m, float gs, uint4 (&e)[2]) {
  const float t = __fdiv_rn(__fdiv_rn(e4m3_value(m), 6.f), gs);
  const uint32_t sbyte = e4m3_satfinite(t);
  const float denom = __fmul_rn(e4m3_value(sbyte), gs);
  const float inv = denom > 0.f ? fminf(__fdiv_rn(1.f, denom), 3.402823466e38f) : 0.f;
  uint32_t w[8];
  w[0] = sbyte;
#pragma unroll
  for (int j = 0; j < 7; ++j) w[j + 1] = (127u - threshold_byte(j, denom, inv)) * 0x01010101u;
  e[0] = make_uint4(w[0], w[1], w[2], w[3]);
  e[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// (x & mask) | (y & ~mask) as one LOP3 (the compiler otherwise splits merges of shifted words).
__device__ __forceinline__ uint32_t bitsel(uint32_t x, uint32_t y, uint32_t mask) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(x), "r"(y), "r"(mask));
  return r;
}

// Largest byte of a[0..3] (bytes 0..127). As u16x2 lanes the high byte decides: a[i] has bytes
// 1 and 3 there, a[i] << 8 bytes 0 and 2, so one u16x2 max tree over the 8 words leaves the
// answer in the high byte of one lane, and a u32 max of (m << 16, m) in byte 3.
__device__ __forceinline__ uint32_t max_byte(const uint32_t (&a)[4]) {
  uint32_t e[4];                 // shifted in asm: the compiler would re-mask w << 8 instead
#pragma unroll
  for (int i = 0; i < 4; ++i) asm("shl.b32 %0, %1, 8;" : "=r"(e[i]) : "r"(a[i]));
  const uint32_t m = __vimax3_u16x2(__vimax3_u16x2(a[0], a[1], a[2]),
                                    __vimax3_u16x2(a[3], e[0], e[1]),
                                    __vimax3_u16x2(e[2], e[3], e[3]));
  return max(m << 16, m) >> 24;
}

// Four values (bytes of w, magnitudes a) -> their codes in the high nibble of each byte
// (bit 7 sign, 6..4 the E2M1 magnitude code); the low nibbles are garbage.
__device__ __forceinline__ uint32_t code_nibbles(uint32_t w, uint32_t a, const uint32_t (&c)[7]) {
  uint32_t s[7];
#pragma unroll
  for (int j = 0; j < 7; ++j) s[j] = a + c[j];
  const uint32_t b1 = s[1] ^ s[3] ^ s[5];
  const uint32_t b0 = s[0] ^ s[2] ^ s[4] ^ s[6] ^ b1;
  const uint32_t top = bitsel(w, s[3] >> 1, 0x80808080u);
  const uint32_t low = bitsel(b1 >> 2, b0 >> 3, 0x20202020u);
  return bitsel(top, low, 0xc0c0c0c0u);
}

// Codes of values 0..7 (high nibbles of h0 then h1) -> four bytes, even value in the low nibble.
__device__ __forceinline__ uint32_t pack_pairs(uint32_t h0, uint32_t h1) {
  return bitsel(__byte_perm(h0, h1, 0x6420) >> 4, __byte_perm(h0, h1, 0x7531), 0x0f0f0f0fu);
}

// One block (16 E4M3 bytes, value 4i + k in byte k of word i) -> 8 code bytes; sbyte its scale.
__device__ __forceinline__ uint2 quantize8(const uint4& x, const uint4 (*tab)[2], uint32_t& sbyte) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = w[i] & 0x7f7f7f7fu;
  const uint32_t m = max_byte(a);
  const uint4 e0 = tab[m][0], e1 = tab[m][1];
  sbyte = e0.x;
  const uint32_t c[7] = {e0.y, e0.z, e0.w, e1.x, e1.y, e1.z, e1.w};
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = code_nibbles(w[i], a[i], c);
  return make_uint2(pack_pairs(h[0], h[1]), pack_pairs(h[2], h[3]));
}

// NB blocks -> NB * 8 code bytes at `codes` and NB scale bytes at `scales` (one store each).
template <int NB>
__device__ __forceinline__ void quantize8_store(const uint4 (&x)[NB], const uint4 (*tab)[2],
                                                uint8_t* codes, uint8_t* scales) {
  uint2 q[NB];
  uint32_t sb[NB];
#pragma unroll
  for (int k = 0; k < NB; ++k) q[k] = quantize8(x[k], tab, sb[k]);
  if constexpr (NB == 1) {
    *reinterpret_cast<uint2*>(codes) = q[0];
    *scales = (uint8_t)sb[0];
  } else {
#pragma unroll
    for (int k = 0; k < NB; k += 2)
      *reinterpret_cast<uint4*>(codes + 8 * k) = make_uint4(q[k].x, q[k].y, q[k + 1].x, q[k + 1].y);
    const uint32_t s01 = __byte_perm(sb[0], sb[1], 0x0040);
    if constexpr (NB == 2) {
      *reinterpret_cast<unsigned short*>(scales) = (unsigned short)s01;
    } else {
      const uint32_t s23 = __byte_perm(sb[2], sb[3], 0x0040);
      *reinterpret_cast<uint32_t*>(scales) = __byte_perm(s01, s23, 0x5410);
    }
  }
}

// FP8 E4M3 K/V -> NVFP4 pages. Work item i: row i / tpr (token * H + head), blocks
// NB * (i % tpr) .. + NB - 1 of that row; n_items = T * H * tpr.
template <int NB>
__global__ void __launch_bounds__(kStore8Threads) store8_kernel(const StoreParams p, int tpr,
                                                                int n_items) {
  __shared__ uint4 tab[2][128][2];
  {
    const int t = threadIdx.x >> 7, m = threadIdx.x & 127;
    build_entry((uint32_t)m, __ldg(t ? p.v_gs : p.k_gs), tab[t][m]);
  }
  __syncthreads();
  for (int i = blockIdx.x * kStore8Threads + threadIdx.x; i < n_items;
       i += gridDim.x * kStore8Threads) {
    const int row = (int)((unsigned)i / (unsigned)tpr), part = i - row * tpr;
    const int tok = (int)((unsigned)row / (unsigned)p.num_heads), h = row - tok * p.num_heads;
    const long long slot = p.slot_i64 ? reinterpret_cast<const long long*>(p.slots)[tok]
                                      : reinterpret_cast<const int*>(p.slots)[tok];
    if (slot < 0) continue;
    const int b = part * NB;
    const uint8_t* kr = reinterpret_cast<const uint8_t*>(p.k) + tok * p.k_t + h * p.k_h + 16 * b;
    const uint8_t* vr = reinterpret_cast<const uint8_t*>(p.v) + tok * p.v_t + h * p.v_h + 16 * b;
    uint4 xk[NB], xv[NB];
#pragma unroll
    for (int k = 0; k < NB; ++k) xk[k] = __ldg(reinterpret_cast<const uint4*>(kr) + k);
#pragma unroll
    for (int k = 0; k < NB; ++k) xv[k] = __ldg(reinterpret_cast<const uint4*>(vr) + k);
    long long page, off;
    if (slot <= 0x7fffffffLL) {
      const unsigned pg = (unsigned)slot / (unsigned)p.page_size;
      page = pg;
      off = (unsigned)slot - pg * (unsigned)p.page_size;
    } else {
      page = slot / p.page_size;
      off = slot - page * p.page_size;
    }
    const long long dk = page * p.page_stride + h * p.d_h + off * p.d_t + 8 * b;
    const long long sk = page * p.page_stride + h * p.s_h + off * p.s_t + b;
    quantize8_store<NB>(xk, tab[0], p.kd + dk, p.ks + sk);
    quantize8_store<NB>(xv, tab[1], p.vd + dk, p.vs + sk);
  }
}

}  // namespace nibble_nvfp4
