// NVFP4 quantize-and-store kernel (sm_90a), in the same extension as the decode kernel.
//
// One thread per 16-value block of one (token, KV head) row, for K and for V (both loads
// are issued before any math). Bit-identical to nibble.kernels.nvfp4.quantize_nvfp4 (the
// reference):
//
// * scale = e4m3(amax / 6 / gs) with two IEEE divisions and cvt.rn.satfinite (RNE,
//   saturating at 448, as the reference's clamp-and-cast);
// * inv = 1 / (float(scale) * gs) (IEEE division), clamped to the largest finite fp32, 0
//   for a zero scale;
// * per value q = x * inv (fp32, not contracted) and the E2M1 code of |q| as the smallest
//   of three roundings at 2^22, where the fp32 ulp is 0.5 and addition rounds to nearest
//   even: |q| + 2^22 (to multiples of 0.5: codes 0-4), fma(|q|, 0.5, 2^22 + 1) (to 1:
//   codes 4-6), fma(|q|, 0.25, 2^22 + 2) (to 2: codes 6-7) and 2^22 + 3.5 (saturation);
//   the code is the low 3 bits, the sign the IEEE sign bit of q.
//
// Inputs are bf16 (widened by shifts) or FP8 E4M3 (cvt.rn.f16x2.e4m3x2, exact). That is
// store variant 0; variant 1 (FP8 input only, store8.cuh) rounds by byte-parallel integer
// compares against per-amax thresholds.
#include <algorithm>
#include "store8.cuh"

namespace nibble_nvfp4 {

__device__ __forceinline__ void widen_bf16(const uint4 (&w)[2], float (&x)[16]) {
  const uint32_t u[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[2 * i] = __uint_as_float(u[i] << 16);
    x[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void widen_e4m3(const uint4& w, float (&x)[16]) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
    e4m3x4_f16x4(u[i], lo, hi);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    x[4 * i] = a.x; x[4 * i + 1] = a.y; x[4 * i + 2] = b.x; x[4 * i + 3] = b.y;
  }
}

// One 16-value block -> 8 code bytes (even value in the low nibble) and its scale byte.
__device__ __forceinline__ uint2 quantize_block(const float (&x)[16], float gs, uint32_t& sbyte) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const float t = __fdiv_rn(__fdiv_rn(amax, 6.f), gs);
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(t));
  sbyte = pair & 0xffu;
  const float scale = __half2float(__ushort_as_half((unsigned short)(e4m3x2_f16x2(sbyte) & 0xffffu)));
  const float denom = __fmul_rn(scale, gs);
  const float inv = denom > 0.f ? fminf(__fdiv_rn(1.f, denom), 3.402823466e38f) : 0.f;
  uint32_t word[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float q = __fmul_rn(x[i], inv);
    const float m = fabsf(q);
    const float s1 = __fadd_rn(m, 4194304.f);
    const float s2 = __fmaf_rn(m, 0.5f, 4194305.f);
    const float s3 = __fmaf_rn(m, 0.25f, 4194306.f);
    const float u = fminf(fminf(s1, s2), fminf(s3, 4194307.5f));
    const uint32_t code = (__float_as_uint(u) & 7u) | ((__float_as_uint(q) >> 28) & 8u);
    word[i >> 3] |= code << (4 * (i & 7));
  }
  return make_uint2(word[0], word[1]);
}

__device__ __forceinline__ void load_block(const uint8_t* row, int in_dtype, int b, uint4 (&w)[2]) {
  if (in_dtype == 1) {
    w[0] = __ldg(reinterpret_cast<const uint4*>(row + 16 * b));
  } else {
    w[0] = __ldg(reinterpret_cast<const uint4*>(row + 32 * b));
    w[1] = __ldg(reinterpret_cast<const uint4*>(row + 32 * b + 16));
  }
}

__device__ __forceinline__ void quantize_store(const uint4 (&w)[2], int in_dtype, float gs,
                                               uint8_t* codes, uint8_t* scale) {
  float x[16];
  if (in_dtype == 1) widen_e4m3(w[0], x);
  else widen_bf16(w, x);
  uint32_t sbyte;
  *reinterpret_cast<uint2*>(codes) = quantize_block(x, gs, sbyte);
  *scale = (uint8_t)sbyte;
}

template <int IN_DTYPE>
__global__ void __launch_bounds__(256) store_kernel(const StoreParams p) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int nb = p.head_dim >> 4;
  const long long row = i / nb;
  if (row >= (long long)p.n_tokens * p.num_heads) return;
  const int b = (int)(i - row * nb);
  const int tok = (int)(row / p.num_heads), h = (int)(row - (long long)tok * p.num_heads);
  const long long slot = p.slot_i64 ? reinterpret_cast<const long long*>(p.slots)[tok]
                                    : reinterpret_cast<const int*>(p.slots)[tok];
  if (slot < 0) return;
  const int es = IN_DTYPE == 1 ? 1 : 2;
  uint4 wk[2], wv[2];
  load_block(reinterpret_cast<const uint8_t*>(p.k) + (tok * p.k_t + h * p.k_h) * es, IN_DTYPE, b, wk);
  load_block(reinterpret_cast<const uint8_t*>(p.v) + (tok * p.v_t + h * p.v_h) * es, IN_DTYPE, b, wv);
  const long long page = slot / p.page_size, off = slot - page * p.page_size;
  const long long dk = page * p.page_stride + h * p.d_h + off * p.d_t + 8 * b;
  const long long sk = page * p.page_stride + h * p.s_h + off * p.s_t + b;
  quantize_store(wk, IN_DTYPE, __ldg(p.k_gs), p.kd + dk, p.ks + sk);
  quantize_store(wv, IN_DTYPE, __ldg(p.v_gs), p.vd + dk, p.vs + sk);
}

// Blocks per thread of variant 1 for these strides and addresses: 4, 2 or 1 (8 * NB-byte
// code stores, at most 16 bytes each, and NB-byte scale stores must be aligned).
static int store8_blocks(const StoreParams& p) {
  const int nb = p.head_dim >> 4;
  const unsigned long long code = (unsigned long long)(uintptr_t)p.kd | (uintptr_t)p.vd |
      p.page_stride | p.d_h | p.d_t;
  const unsigned long long scale = (unsigned long long)(uintptr_t)p.ks | (uintptr_t)p.vs |
      p.page_stride | p.s_h | p.s_t;
  if (nb % 4 == 0 && code % 16 == 0 && scale % 4 == 0) return 4;
  if (nb % 2 == 0 && code % 16 == 0 && scale % 2 == 0) return 2;
  return 1;
}

// Resident CTAs of store8_kernel<NB> on the current device (cached per device).
template <int NB>
static int store8_resident() {
  static int cache[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 63;
  if (cache[dev] == 0) {
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, store8_kernel<NB>, kStore8Threads, 0);
    cache[dev] = sms * (per_sm > 0 ? per_sm : 1);
  }
  return cache[dev];
}

template <int NB>
static void launch_store8(const StoreParams& p, cudaStream_t s) {
  const int tpr = (p.head_dim >> 4) / NB;
  const long long items = (long long)p.n_tokens * p.num_heads * tpr;
  const long long want = (items + kStore8Threads - 1) / kStore8Threads;
  const int grid = (int)std::min<long long>(want, store8_resident<NB>());
  store8_kernel<NB><<<grid, kStore8Threads, 0, s>>>(p, tpr, (int)items);
}

// variant 0: store_kernel (one thread per block, float rounding); 1: store8_kernel for FP8
// input (bf16 input, and 2^30 blocks or more, whose int item index could overflow, take 0).
void launch_store(const StoreParams& p, int variant, void* stream) {
  const long long threads = (long long)p.n_tokens * p.num_heads * (p.head_dim >> 4);
  const int grid = (int)((threads + 255) / 256);
  if (grid == 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (variant == 1 && p.in_dtype == 1 && threads < (1LL << 30)) {
    const int nb = store8_blocks(p);
    if (nb == 4) launch_store8<4>(p, s);
    else if (nb == 2) launch_store8<2>(p, s);
    else launch_store8<1>(p, s);
  } else if (p.in_dtype == 1) {
    store_kernel<1><<<grid, 256, 0, s>>>(p);
  } else {
    store_kernel<0><<<grid, 256, 0, s>>>(p);
  }
}

}  // namespace nibble_nvfp4
