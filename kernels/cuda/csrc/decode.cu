// NVFP4 / FP8 E4M3 paged GQA decode for Hopper (sm_90a), part 4: the in-CTA combine, the
// decode kernel, the reduce kernel and the launchers. Includes no torch header, so nvcc
// compiles it quickly, and it compiles alone to read registers and SASS:
//   nvcc -cubin -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a decode.cu
//
// Kernel design (one CTA = 4 warps for one (sequence, KV head, split); each warp runs its
// own online softmax over a contiguous range of 16-token tiles, then the 4 warps combine
// through shared memory and write one partial; the last CTA of a (sequence, KV head) to
// finish combines the splits, or, without a counter buffer, a reduce kernel does):
//
// * S^T = K Q^T with mma.sync.m16n8k16 fp16 -> fp32, swap-AB: A = K (16 tokens on M),
//   B = Q^T (n = 8 query heads, up to 8 real). The head dim of each k-step is permuted so
//   that lane (g, t) (g = lane / 4, t = lane % 4) needs exactly head-dim elements
//   [32t, 32t + 32) of tokens g and 8 + g: one 16-byte load per token row, no shuffles.
//   Q uses the same permutation.
// * O^T = V^T P^T, swap-AB: A = V^T (rows = head dim, 8 m-tiles), B = P^T (k = 16 tokens,
//   n = 8 heads). P goes from the S accumulator to the B fragment with two movmatrix.trans
//   per tile. Lane (g, t) owns head-dim block g (d = 16g .. 16g+15) of tokens 2t, 2t+1,
//   8+2t, 9+2t: 8 bytes per token row.
// * E2M1 -> fp16 by bit placement: s << 15 | m << 9 is exactly value * 2^-14 (3 LOP3 +
//   3 shifts + 4 byte permutes per 8 codes with DQ 2; V pairs two tokens' bytes first).
//   Block scales are converted with cvt.rn.f16x2.e4m3x2, times 2^7 (so every product is an
//   exact normal-range fp16), and applied with one HMUL2 per 2 elements. 2^7 * 2^-14 and
//   the global scales fold into the softmax scale (K) and the partial output (V).
// * Online softmax in the log2 domain with a lazy rescale: the running max moves only when
//   a score exceeds it by more than 8, so p <= 256; a warp vote skips the max reduction and
//   the accumulator rescale otherwise.
// * Feeding (variants, see decode.VARIANTS): the next tile prefetched into registers
//   (ping-pong), or a per-warp cp.async ring in shared memory with conflict-free chunk
//   layouts, consumed one tile or two tiles (one softmax step per 32 tokens, two
//   independent score chains) at a time. Page addresses are one 32 x 32 -> 64-bit multiply
//   (the wrapper bounds the page stride), the Q fragment loads after the first copies are
//   issued, and the reduce kernel spreads the splits over up to 32 warps.
// * FP8 E4M3 pages (decode.FP8_VARIANTS) share everything but the tile: the ring loops,
//   softmax step and combine are templates over a format policy (NVFP4 or FP8, see
//   pipe.cuh and fp8.cuh); FP8 converts with one cvt.rn.f16x2.e4m3x2 per 2 values and has
//   no block scales.
#include "fp8.cuh"

namespace nibble_nvfp4 {

// out[i] = v in the output dtype (0 bf16, 1 fp16, 2 fp32).
__device__ __forceinline__ void store_out(void* out, long long i, int dtype, float v) {
  if (dtype == 0) reinterpret_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  else if (dtype == 1) reinterpret_cast<__half*>(out)[i] = __float2half_rn(v);
  else reinterpret_cast<float*>(out)[i] = v;
}

// The fused combine below sits in __noinline__ functions taking scalars: inlined, its code
// changed the register allocation of the whole kernel and slowed the main loop by 10-20%
// (docs/benchmarks.md); behind a call, the loop compiles as without it.
struct SplitOut {                  // what the fused combine needs, passed by value in registers
  int* counters; float* part_o; float* part_ml; void* out;
  long long o_b, o_h; int out_dtype, nsplit, group, num_kv_heads;
};

// One split (with the fused combine): output element `oi`, normalised by the row sum `l`.
__device__ __noinline__ void store_single(void* out, long long oi, int out_dtype, float o,
                                          float l) {
  store_out(out, oi, out_dtype, l > 0.f ? o / l : 0.f);
}

// The 4 warps' (m, l, O) -> one partial per query head of the group (with the fused combine
// and a single split: the output itself).
// vfac: the factor from the V operand's fp16 values to real values (NVFP4 2^7 * v_gs).
__device__ __forceinline__ void combine_warps(const Params& p, int b, int h, int c, int lane,
                                             int warp, uint8_t* smem, float vfac, State& st) {
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
    if (p.counters != nullptr && p.nsplit == 1) {   // one split: this is the answer
      store_single(p.out, (long long)b * p.o_b + (long long)(h * p.group + hh) * p.o_h + d,
                   p.out_dtype, o * vfac, l);
      continue;
    }
    const long long idx = ((long long)b * hq_total + h * p.group + hh) * p.nsplit + c;
    p.part_o[idx * kD + d] = o * vfac;
    if (d == 0) { p.part_ml[idx * 2] = mx; p.part_ml[idx * 2 + 1] = l; }
  }
}

// Counting in: a barrier orders the CTA's prior stores (partials) before thread 0's acq_rel
// atomic at GPU scope (release is cumulative over them, as in CUTLASS's split-K barriers); the
// last CTA's acquire then makes every other CTA's stores visible to it after the next barrier.
// The last one resets the counter, so the buffer is zero again for the next launch or graph
// replay. Returns (to every thread) whether this CTA was the last of `total`.
__device__ __forceinline__ bool count_in(int* ctr, int total, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(ctr)
                 : "memory");
    *flag = old == total - 1;
    if (*flag) *ctr = 0;
  }
  __syncthreads();
  return *flag != 0;
}

// Sums `count` partials of each query head of the group, slots first, first + stride, ...
// (in split units), 16 at a time with an online rescale: each batch issues its 16 (m, l)
// pairs and 16 partial rows at once (one L2 round trip per batch, no max pass); partials
// are read through L2 (.cg): other SMs wrote them in this launch. to_out: the normalised
// rows go to the output; else the sum goes back, as one partial, to slot `first`.
// Warp w takes heads w, w + 4, ...; lane l holds head dims [4l, 4l + 4).
__device__ __forceinline__ void sum_partials(const SplitOut& a, int b, int h, int lane, int warp,
                                             int first, int count, int stride, bool to_out) {
  const int hq_total = a.num_kv_heads * a.group;
  for (int hh = warp; hh < a.group; hh += kWarps) {
    const long long base = ((long long)b * hq_total + h * a.group + hh) * a.nsplit + first;
    const float2* ml = reinterpret_cast<const float2*>(a.part_ml) + base;
    const float4* po = reinterpret_cast<const float4*>(a.part_o + base * kD) + lane;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float mx = -INFINITY, l = 0.f;
    for (int j0 = 0; j0 < count; j0 += 16) {
      const int n = min(16, count - j0), j = lane & 15;
      const float2 m = j < n ? __ldcg(ml + (long long)(j0 + j) * stride)
                             : make_float2(-INFINITY, 0.f);
      float4 v[16];
#pragma unroll
      for (int u = 0; u < 16; ++u)
        v[u] = u < n ? __ldcg(po + (long long)(j0 + u) * stride * (kD / 4))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
      float bm = m.x;
#pragma unroll
      for (int sh = 8; sh > 0; sh >>= 1) bm = fmaxf(bm, __shfl_xor_sync(kFull, bm, sh));
      const float nm = fmaxf(mx, bm);
      if (nm == -INFINITY) continue;                 // only empty splits so far
      const float sc = mx == -INFINITY ? 0.f : ex2(mx - nm);
      acc.x *= sc; acc.y *= sc; acc.z *= sc; acc.w *= sc;
      mx = nm;
      const float wt = m.x == -INFINITY ? 0.f : ex2(m.x - nm);
      float lb = wt * m.y;
#pragma unroll
      for (int sh = 8; sh > 0; sh >>= 1) lb += __shfl_xor_sync(kFull, lb, sh);
      l = l * sc + lb;
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        const float w = __shfl_sync(kFull, wt, u);
        acc.x += w * v[u].x; acc.y += w * v[u].y; acc.z += w * v[u].z; acc.w += w * v[u].w;
      }
    }
    if (!to_out) {                                   // one partial in the same convention
      reinterpret_cast<float4*>(a.part_o + base * kD)[lane] = acc;
      if (lane == 0) reinterpret_cast<float2*>(a.part_ml)[base] = make_float2(mx, l);
      continue;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const long long oi = (long long)b * a.o_b + (long long)(h * a.group + hh) * a.o_h + 4 * lane;
    store_out(a.out, oi, a.out_dtype, acc.x * inv);
    store_out(a.out, oi + 1, a.out_dtype, acc.y * inv);
    store_out(a.out, oi + 2, a.out_dtype, acc.z * inv);
    store_out(a.out, oi + 3, a.out_dtype, acc.w * inv);
  }
}

// The splits of a (sequence, KV head) combine in up to two levels: up to kSplitGroup splits,
// the last CTA to publish its partials sums them into the output. Above that, splits form
// groups of kSplitGroup: the last CTA of each group sums its group into the group's first
// slot, and the last group to finish sums the groups' slots into the output, so no CTA sums
// more than kSplitGroup partials (one L2 round trip each level; one CTA summing 66 partials
// in five dependent round trips took 4.8 us, docs/benchmarks.md). Counters per (sequence,
// KV head): [0] the groups (or the splits, one level), [1 + g] group g's splits.
// (A template over the caller's CTAs per SM so each copy gets its caller's register budget.)
template <int MINB>
__device__ __noinline__ void combine_splits(const SplitOut a, int b, int h, int c, int lane,
                                            int warp, int* flag) {
  int* ctr = a.counters + ((long long)b * a.num_kv_heads + h) * kCtrStride;
  const int ns = a.nsplit;
  if (ns <= kSplitGroup) {
    if (count_in(ctr, ns, flag)) sum_partials(a, b, h, lane, warp, 0, ns, 1, true);
    return;
  }
  const int groups = (ns + kSplitGroup - 1) / kSplitGroup, g = c / kSplitGroup;
  const int first = g * kSplitGroup, size = min(kSplitGroup, ns - first);
  if (!count_in(ctr + 1 + g, size, flag)) return;
  sum_partials(a, b, h, lane, warp, first, size, 1, false);
  if (count_in(ctr, groups, flag))
    sum_partials(a, b, h, lane, warp, 0, groups, kSplitGroup, true);
}

// FMT 0: NVFP4 pages (DQ = dequant form, PIPE 0 = register ping-pong, MODE = diagnostics);
// FMT 1: FP8 E4M3 pages (cp.async ring only).
template <int MINB, int DQ, int PIPE, int MODE = 0, int PAIR = 0, int FMT = 0>
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
  const auto q_loader = [&](uint32_t (&q)[8][2]) {
    if (FMT == 1) load_q8(p, b, h, lane, q);
    else load_q(p, b, h, lane, q);
  };
  State st;
#pragma unroll
  for (int i = 0; i < 8; ++i) st.acc[i][0] = st.acc[i][1] = st.acc[i][2] = st.acc[i][3] = 0.f;
  st.m0 = st.m1 = -INFINITY;
  st.l0 = st.l1 = 0.f;
  const float qk = p.qk_scale * __ldg(p.k_gs);
  typedef typename std::conditional<FMT == 1, Fp8Fmt, Nvfp4Fmt<DQ>>::type F;
  uint8_t* ring = smem + warp * (PIPE > 0 ? PIPE : 1) * F::kStage;
  if constexpr (PAIR == 1 && PIPE > 0) {
    warp_pairs_pipe<F, PIPE>(p, b, h, seq_len, t_lo, t_hi, lane, ring, q_loader, qk, st);
  } else {
    grid_dep_wait();
    uint32_t qf[8][2];
    q_loader(qf);
    if (PIPE == 0) {
      if (t_lo < t_hi) warp_tiles<DQ, MODE>(p, b, h, seq_len, t_lo, t_hi, lane, qf, qk, st);
    } else {
      warp_tiles_pipe<F, PIPE>(p, b, h, seq_len, t_lo, t_hi, lane, ring, qf, qk, st);
    }
  }
  combine_warps(p, b, h, c, lane, warp, smem, (FMT == 1 ? 1.f : 128.f) * __ldg(p.v_gs), st);
  if (p.counters != nullptr && p.nsplit > 1) {
    const SplitOut a{p.counters, p.part_o, p.part_ml, p.out, p.o_b, p.o_h, p.out_dtype,
                     p.nsplit, p.group, p.num_kv_heads};
    combine_splits<MINB>(a, b, h, c, lane, warp, reinterpret_cast<int*>(smem + kFlagOff));
  }
}

// out[b, hq, :] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s; one CTA per (b, hq) of
// 32 * R threads (R = blockDim / 32 groups, up to kRedGroups): all threads find M, then group r
// (one warp, 4 head dims per lane, 16-byte loads) sums splits r, r + R, ..., and 128 threads
// add the groups up in shared memory. With one thread per head dim looping over all splits,
// the kernel took 13 us at 66 splits (1 x 131072; 3.5 us at 8 splits).
constexpr int kRedGroups = 32;
__global__ void __launch_bounds__(32 * kRedGroups) reduce_kernel(
    const float* __restrict__ po, const float* __restrict__ pml, void* out, long long o_b,
    long long o_h, int out_dtype, int hq, int nsplit) {
  __shared__ float s_mx[kRedGroups];
  __shared__ float4 s_o[kRedGroups][kD / 4];
  __shared__ float s_l[kRedGroups];
  const int bq = blockIdx.x, tid = threadIdx.x, lane = tid & 31, grp = tid >> 5;
  const int groups = blockDim.x >> 5;
  const long long base = (long long)bq * nsplit;
  float mx = -INFINITY;
  for (int s = tid; s < nsplit; s += blockDim.x) mx = fmaxf(mx, pml[(base + s) * 2]);
#pragma unroll
  for (int sh = 16; sh > 0; sh >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, sh));
  if (lane == 0) s_mx[grp] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int w = 0; w < groups; ++w) mx = fmaxf(mx, s_mx[w]);
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  float l = 0.f;
#pragma unroll 2
  for (int s = grp; s < nsplit; s += groups) {
    const float2 ml = reinterpret_cast<const float2*>(pml)[base + s];
    const float wt = ml.x == -INFINITY ? 0.f : ex2(ml.x - mx);
    const float4 v = reinterpret_cast<const float4*>(po + (base + s) * kD)[lane];
    o.x += wt * v.x; o.y += wt * v.y; o.z += wt * v.z; o.w += wt * v.w;
    l += wt * ml.y;
  }
  s_o[grp][lane] = o;
  if (lane == 0) s_l[grp] = l;
  __syncthreads();
  if (tid >= kD) return;
  const float* so = reinterpret_cast<const float*>(&s_o[0][0]);
  float acc = 0.f, lsum = 0.f;
  for (int r = 0; r < groups; ++r) { acc += so[r * kD + tid]; lsum += s_l[r]; }
  const long long oi = (long long)(bq / hq) * o_b + (long long)(bq % hq) * o_h + tid;
  store_out(out, oi, out_dtype, lsum > 0.f ? acc / lsum : 0.f);
}

// variant = 100000 * FMT + 10000 * PAIR + 1000 * MODE + 100 * PIPE + 10 * DQ + MINB:
// FMT = page format (0 NVFP4, 1 FP8 E4M3), PAIR = two tiles per step, MODE = diagnostic
// (1 loads only, 2 compute only), PIPE = cp.async stages per warp (0: register ping-pong),
// DQ = dequant form, MINB = CTAs per SM for the register cap.
#define NIBBLE_VARIANTS(X) X(4, 0, 0, 0, 0, 0) X(4, 2, 0, 0, 0, 0) X(4, 0, 4, 0, 1, 0) \
  X(4, 2, 4, 0, 1, 0) X(4, 0, 0, 1, 0, 0) X(4, 0, 0, 2, 0, 0) X(3, 0, 4, 0, 1, 1)        \
  X(4, 0, 4, 0, 1, 1) X(4, 0, 3, 0, 0, 1) X(4, 0, 2, 0, 0, 1) X(2, 0, 6, 0, 1, 1)        \
  X(5, 2, 4, 0, 1, 0) X(6, 2, 4, 0, 1, 0)

static int smem_bytes(int pipe, int fmt) {
  const int ring = kWarps * pipe * (fmt == 1 ? kStage8 : kStageBytes);
  return ring > kCombineBytes ? ring : kCombineBytes;
}

// The kernel of `variant` with its dynamic shared-memory limit raised once; null if unknown.
static const void* kernel_of(int variant, int* smem) {
#define NIBBLE_FN(M, Q, P, D, R, F)                                                        \
  if (variant == 100000 * F + 10000 * R + 1000 * D + 100 * P + 10 * Q + M) {                \
    static bool ready = false;                                                              \
    *smem = smem_bytes(P, F);                                                               \
    if (!ready) {                                                                           \
      cudaFuncSetAttribute(decode_kernel<M, Q, P, D, R, F>,                                 \
                           cudaFuncAttributeMaxDynamicSharedMemorySize, *smem);             \
      ready = true;                                                                         \
    }                                                                                       \
    return (const void*)decode_kernel<M, Q, P, D, R, F>;                                    \
  }
  NIBBLE_VARIANTS(NIBBLE_FN)
#undef NIBBLE_FN
  return nullptr;
}

// pdl: launch as a programmatic dependent of the kernel before it on the stream, which may
// then still be running (the kernel waits for it before reading q and the new token's tile).
void launch_decode(const Params& p, int batch, int variant, void* stream, bool pdl) {
  int smem = 0;
  const void* f = kernel_of(variant, &smem);
  if (f == nullptr) return;                  // the wrapper admits known variants only
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.nsplit, p.num_kv_heads, batch);
  cfg.blockDim = dim3(kWarps * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  void* args[] = {const_cast<Params*>(&p)};
  cudaLaunchKernelExC(&cfg, f, args);
}

void launch_reduce(const float* part_o, const float* part_ml, void* out, long long o_b,
                   long long o_h, int out_dtype, int batch, int hq, int nsplit, void* stream) {
  // at least kD threads for the final sum; one warp per split up to kRedGroups
  const int groups = nsplit < kD / 32 ? kD / 32 : nsplit < kRedGroups ? nsplit : kRedGroups;
  reduce_kernel<<<batch * hq, 32 * groups, 0, static_cast<cudaStream_t>(stream)>>>(
      part_o, part_ml, out, o_b, o_h, out_dtype, hq, nsplit);
}

int decode_occupancy(int variant) {
  int n = 0, smem = 0;
  const void* f = kernel_of(variant, &smem);
  if (f != nullptr) cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, f, kWarps * 32, smem);
  return n;
}

}  // namespace nibble_nvfp4
