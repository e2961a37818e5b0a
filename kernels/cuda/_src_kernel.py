"""Device code, part 2: the cp.async ring tile loops (one or two tiles per softmax step),
the in-CTA combine, the decode and reduce kernels and the launchers.

Concatenated after :mod:`._src_tile`; see :mod:`._sources` for the design.
"""

KERNEL_SRC = r"""
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
  for (int j = 0; j < 4; ++j)
    x.v[j] = *reinterpret_cast<const uint2*>(st + kVOff + j * 256 + lane * 8);
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
    if (tt + PIPE - 1 < t_hi)
      issue_tile(ring_s + nslot * kStageBytes, p, pc, ln, tt + PIPE - 1, lane);
    cp_commit();
    slot = slot == PIPE - 1 ? 0 : slot + 1;
    const int rem = seq_len - tt * 16;
    if (rem >= 16) compute_tile<DQ, false>(x, qf, qk, 16, lane, st);
    else compute_tile<DQ, true>(x, qf, qk, rem, lane, st);
  }
  cp_wait<0>();
}

__device__ __forceinline__ void read_k(Tile& x, const uint8_t* st, int lane) {
  const int g = lane >> 2, t = lane & 3;
  x.k[0] = *reinterpret_cast<const uint4*>(st + kKOff + lane * 16);
  x.k[1] = *reinterpret_cast<const uint4*>(st + kKOff + 512 + lane * 16);
  x.ks[0] = *reinterpret_cast<const unsigned short*>(st + kKsOff + g * 8 + 2 * t);
  x.ks[1] = *reinterpret_cast<const unsigned short*>(st + kKsOff + (8 + g) * 8 + 2 * t);
}
__device__ __forceinline__ void read_v(Tile& x, const uint8_t* st, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    x.v[j] = *reinterpret_cast<const uint2*>(st + kVOff + j * 256 + lane * 8);
  x.vs[0] = st[kVsOff + (2 * t) * 8 + g];
  x.vs[1] = st[kVsOff + (2 * t + 1) * 8 + g];
  x.vs[2] = st[kVsOff + (8 + 2 * t) * 8 + g];
  x.vs[3] = st[kVsOff + (9 + 2 * t) * 8 + g];
}

// Two 16-token tiles (a: tokens 0-15, b: 16-31 of `rem`) with one softmax step: two
// independent score chains, half the softmax and vote work per token.
template <int DQ, bool MASK>
__device__ __forceinline__ void compute_pair(const uint8_t* sa_st, const uint8_t* sb_st,
                                             const uint32_t (&qf)[8][2], float qk, int rem,
                                             int lane, State& st) {
  const int g = lane >> 2, t = lane & 3;
  Tile a, b;
  read_k(a, sa_st, lane);
  read_k(b, sb_st, lane);
  float s[2][4];
  tile_scores<DQ>(a, qf, s[0]);
  tile_scores<DQ>(b, qf, s[1]);
  read_v(a, sa_st, lane);
  read_v(b, sb_st, lane);
  float x[2][4];
  uint32_t vm[2][2] = {{0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[j][i] = s[j][i] * qk;
    if (MASK) {
      const int r = rem - 16 * j;
      x[j][0] = g < r ? x[j][0] : -INFINITY;
      x[j][1] = g < r ? x[j][1] : -INFINITY;
      x[j][2] = 8 + g < r ? x[j][2] : -INFINITY;
      x[j][3] = 8 + g < r ? x[j][3] : -INFINITY;
      vm[j][0] = (2 * t < r ? 0x0000ffffu : 0u) | (2 * t + 1 < r ? 0xffff0000u : 0u);
      vm[j][1] = (8 + 2 * t < r ? 0x0000ffffu : 0u) | (9 + 2 * t < r ? 0xffff0000u : 0u);
    }
  }
  float mx0 = fmaxf(fmaxf(x[0][0], x[0][2]), fmaxf(x[1][0], x[1][2]));
  float mx1 = fmaxf(fmaxf(x[0][1], x[0][3]), fmaxf(x[1][1], x[1][3]));
  const bool upd = mx0 > st.m0 + kLazy || mx1 > st.m1 + kLazy;
  if (__any_sync(kFull, upd)) {
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
  uint32_t pb[2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float p0 = ex2(x[j][0] - st.m0), p1 = ex2(x[j][1] - st.m1);
    const float p2 = ex2(x[j][2] - st.m0), p3 = ex2(x[j][3] - st.m1);
    st.l0 += p0 + p2;
    st.l1 += p1 + p3;
    pb[j][0] = movm_trans(pack_h2(p0, p1));
    pb[j][1] = movm_trans(pack_h2(p2, p3));
  }
  tile_pv<DQ>(a, pb[0][0], pb[0][1], vm[0][0], vm[0][1], st);
  tile_pv<DQ>(b, pb[1][0], pb[1][1], vm[1][0], vm[1][1], st);
}

// Two tiles per iteration over a PIPE-stage ring (PIPE even): pairs ahead in flight.
template <int DQ, int PIPE>
__device__ __forceinline__ void warp_pairs_pipe(const Params& p, int b, int h, int seq_len,
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
  for (int i = 0; i < PIPE - 2; ++i) {
    if (t_lo + i < t_hi) issue_tile(ring_s + i * kStageBytes, p, pc, ln, t_lo + i, lane);
    cp_commit();
  }
  const int end = min(seq_len, t_hi * 16);    // tokens past this belong to no tile of ours
  int slot = 0;                               // ring slot of tile tt (even)
  for (int tt = t_lo; tt < t_hi; tt += 2) {
    cp_wait<PIPE - 4>();
    __syncwarp();
    const int ns = slot == 0 ? PIPE - 2 : slot - 2;          // slots read last iteration
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (tt + PIPE - 2 + i < t_hi)
        issue_tile(ring_s + (ns + i) * kStageBytes, p, pc, ln, tt + PIPE - 2 + i, lane);
      cp_commit();
    }
    const uint8_t* sa = ring + slot * kStageBytes;
    const int rem = end - tt * 16;
    if (rem >= 32) compute_pair<DQ, false>(sa, sa + kStageBytes, qf, qk, 32, lane, st);
    else compute_pair<DQ, true>(sa, sa + kStageBytes, qf, qk, rem, lane, st);
    slot = slot == PIPE - 2 ? 0 : slot + 2;
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

template <int MINB, int DQ, int PIPE, int MODE = 0, int PAIR = 0>
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
    if (t_lo < t_hi) warp_tiles<DQ, MODE>(p, b, h, seq_len, t_lo, t_hi, lane, qf, qk, st);
  } else if (PAIR) {
    warp_pairs_pipe<DQ, PIPE>(p, b, h, seq_len, t_lo, t_hi, lane,
                              smem + warp * PIPE * kStageBytes, qf, qk, st);
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

// variant = 10000 * PAIR + 1000 * MODE + 100 * PIPE + 10 * DQ + MINB: PAIR = two tiles per
// step, MODE = diagnostic (1 loads only, 2 compute only), PIPE = cp.async stages per warp
// (0: register ping-pong), DQ = dequant form, MINB = CTAs per SM for the register cap.
#define NIBBLE_VARIANTS(X) X(4, 0, 0, 0, 0) X(3, 0, 0, 0, 0) X(4, 1, 0, 0, 0) X(4, 0, 4, 0, 0) \
  X(4, 0, 0, 1, 0) X(4, 0, 0, 2, 0) X(4, 0, 4, 0, 1) X(4, 0, 6, 0, 1)

static int smem_bytes(int pipe) {
  const int ring = kWarps * pipe * kStageBytes;
  return ring > kCombineBytes ? ring : kCombineBytes;
}

// The kernel of `variant` with its dynamic shared-memory limit raised once; null if unknown.
static const void* kernel_of(int variant, int* smem) {
#define NIBBLE_FN(M, Q, P, D, R)                                                           \
  if (variant == 10000 * R + 1000 * D + 100 * P + 10 * Q + M) {                             \
    static bool ready = false;                                                              \
    *smem = smem_bytes(P);                                                                  \
    if (!ready) {                                                                           \
      cudaFuncSetAttribute(decode_kernel<M, Q, P, D, R>,                                    \
                           cudaFuncAttributeMaxDynamicSharedMemorySize, *smem);             \
      ready = true;                                                                         \
    }                                                                                       \
    return (const void*)decode_kernel<M, Q, P, D, R>;                                       \
  }
  NIBBLE_VARIANTS(NIBBLE_FN)
#undef NIBBLE_FN
  return nullptr;
}

void launch_decode(const Params& p, int batch, int variant, void* stream) {
  int smem = 0;
  const void* f = kernel_of(variant, &smem);
  if (f == nullptr) f = kernel_of(4, &smem);
  dim3 grid(p.nsplit, p.num_kv_heads, batch), block(kWarps * 32);
  void* args[] = {const_cast<Params*>(&p)};
  cudaLaunchKernel(f, grid, block, args, smem, static_cast<cudaStream_t>(stream));
}

void launch_reduce(const float* part_o, const float* part_ml, void* out, long long o_b,
                   long long o_h, int out_dtype, int batch, int hq, int nsplit, void* stream) {
  reduce_kernel<<<batch * hq, kD, 0, static_cast<cudaStream_t>(stream)>>>(
      part_o, part_ml, out, o_b, o_h, out_dtype, hq, nsplit);
}

int decode_occupancy(int variant) {
  int n = 0, smem = 0;
  const void* f = kernel_of(variant, &smem);
  if (f != nullptr) cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, f, kWarps * 32, smem);
  return n;
}

}  // namespace nibble_nvfp4
"""
