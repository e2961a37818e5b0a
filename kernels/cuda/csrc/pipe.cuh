// Device code, part 2: cp.async rings, the softmax step shared by all formats, the NVFP4
// format policy and the tile loops, generic over a format policy.
//
// A format policy F (Nvfp4Fmt<DQ> here, Fp8Fmt in fp8.cuh) gives: kStage (ring bytes per
// 16-token tile), LaneT and lane_of (per-lane byte offsets, global and in a stage), issue
// (the cp.async copies of one tile into a ring stage) and one<MASK> / pair<MASK> (one or two
// tiles of math from ring stages). The kernel design is described at the top of decode.cu.
#pragma once
#include "tile.cuh"

namespace nibble_nvfp4 {

// ---- cp.async helpers
__device__ __forceinline__ void cp16(uint32_t dst, const uint8_t* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
// Predicated copy (no branch, so no divergence bookkeeping around it).
__device__ __forceinline__ void cp16_if(uint32_t dst, const uint8_t* src, bool pred) {
  asm volatile("{.reg .pred p;\n setp.ne.b32 p, %2, 0;\n"
               " @p cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n}"
               :: "r"(dst), "l"(src), "r"((int)pred));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

// Softmax step for two 16-token tiles: x[j] = raw scores of tile j (S^T fragment: x[j][0..1]
// token g, heads 2t, 2t+1; x[j][2..3] token 8+g). Scales, masks past `rem` tokens, updates
// the running max (lazily) and sums, rescales the accumulators when the max moved, and
// returns P^T B fragments pb[j] and per-token V masks vm[j] (fp16x2 lanes of tokens 2t,
// 2t+1 / 8+2t, 9+2t; all ones without MASK).
template <bool MASK>
__device__ __forceinline__ void softmax_pair(float (&x)[2][4], float qk, int rem, int lane,
                                             State& st, uint32_t (&pb)[2][2],
                                             uint32_t (&vm)[2][2]) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[j][i] *= qk;
    vm[j][0] = vm[j][1] = 0xffffffffu;
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
  lazy_rescale(fmaxf(fmaxf(x[0][0], x[0][2]), fmaxf(x[1][0], x[1][2])),
               fmaxf(fmaxf(x[0][1], x[0][3]), fmaxf(x[1][1], x[1][3])), st);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float p0 = ex2(x[j][0] - st.m0), p1 = ex2(x[j][1] - st.m1);
    const float p2 = ex2(x[j][2] - st.m0), p3 = ex2(x[j][3] - st.m1);
    st.l0 += p0 + p2;
    st.l1 += p1 + p3;
    pb[j][0] = movm_trans(pack_h2(p0, p1));
    pb[j][1] = movm_trans(pack_h2(p2, p3));
  }
}

// ---- NVFP4 ring stage: K as lane-private code chunks [chunk][lane], V as 8-byte slots
// [read j][lane t * 8 + g] (both conflict-free for the fragment reads) and the tile's two
// 128-byte scale blocks copied by lanes 0-15.
constexpr int kStageBytes = 2304, kKOff = 0, kVOff = 1024, kKsOff = 2048, kVsOff = 2176;

struct LaneCp {         // per-lane byte offsets from the K code section of page 0, tile 0
  uint32_t k, v, sc;    // sc: this lane's 16-byte piece of a scale block (lanes 0-15)
  uint32_t vd;          // stage offset of this lane's first 16-byte V chunk
};

__device__ __forceinline__ void issue_tile(uint32_t stage, const Params& p, PageCursor& pc,
                                           const LaneCp& ln, int tile, int lane) {
  const uint8_t* pg = page_base(p, pc.page(tile >> p.tpp_log2, lane));
  const uint32_t off = (uint32_t)tile & ((1u << p.tpp_log2) - 1u);
  const uint8_t* kp = ptr_add(pg, off * (16 * 64) + ln.k);
  const uint8_t* vp = ptr_add(pg, off * (16 * 64) + ln.v);
  cp16(stage + kKOff + lane * 16, kp);
  cp16(stage + kKOff + 512 + lane * 16, kp + 8 * 64);
  cp16(stage + ln.vd, vp);                    // rows lane / 4 and 8 + lane / 4, 16 bytes
  cp16(stage + ln.vd + 512, vp + 512);
  cp16_if(stage + kKsOff + lane * 16, ptr_add(pg, off * (16 * 8) + ln.sc), lane < 16);
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
    x.v[j] = *reinterpret_cast<const uint2*>(st + kVOff + j * 256 + (t * 8 + g) * 8);
  x.vs[0] = st[kVsOff + (2 * t) * 8 + g];
  x.vs[1] = st[kVsOff + (2 * t + 1) * 8 + g];
  x.vs[2] = st[kVsOff + (8 + 2 * t) * 8 + g];
  x.vs[3] = st[kVsOff + (9 + 2 * t) * 8 + g];
}

template <int DQ> struct Nvfp4Fmt {
  static constexpr int kStage = kStageBytes;
  typedef LaneCp LaneT;
  __device__ static __forceinline__ LaneT lane_of(const Params& p, int h, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const uint32_t row0 = (uint32_t)(h * p.page_size);
    const uint32_t ks0 = (uint32_t)(p.ks - p.kd), vd0 = (uint32_t)(p.vd - p.kd);
    const uint32_t vs0 = (uint32_t)(p.vs - p.kd);
    // V: lane L copies bytes [16 L, 16 L + 16) of the tile's rows (and 512 on), i.e. row
    // r = L / 4, bytes 16u (u = L % 4), into the 8-byte slots of lanes (g = 2u, 2u + 1,
    // t = (r / 2) % 4) of read j = r % 2 (+ 2 for rows 8-15); read_v's 8-byte loads of
    // slot t * 8 + g are conflict-free, and each copy instruction moves 512 contiguous bytes.
    const uint32_t r = lane >> 2, u = lane & 3;
    return {(row0 + g) * 64 + 16 * t, vd0 + row0 * 64 + 16 * lane,
            (lane < 8 ? ks0 : vs0) + row0 * 8 + (lane & 7) * 16,
            kVOff + (r & 1) * 256 + ((r >> 1) & 3) * 64 + 16 * u};
  }
  __device__ static __forceinline__ void issue(uint32_t stage, const Params& p, PageCursor& pc,
                                               const LaneT& ln, int tile, int lane) {
    issue_tile(stage, p, pc, ln, tile, lane);
  }
  template <bool MASK>
  __device__ static __forceinline__ void one(const uint8_t* s, const LaneT&,
                                             const uint32_t (&qf)[8][2], float qk, int rem,
                                             int lane, State& st) {
    Tile x;
    read_k(x, s, lane);
    read_v(x, s, lane);
    compute_tile<DQ, MASK>(x, qf, qk, rem, lane, st);
  }
  // Two tiles (tokens 0-15 at sa, 16-31 at sb of `rem`), one softmax step: two independent
  // score chains, half the softmax and vote work per token.
  template <bool MASK>
  __device__ static __forceinline__ void pair(const uint8_t* sa, const uint8_t* sb, const LaneT&,
                                              const uint32_t (&qf)[8][2], float qk, int rem,
                                              int lane, State& st) {
    Tile a, b;
    read_k(a, sa, lane);
    read_k(b, sb, lane);
    float x[2][4];
    tile_scores<DQ>(a, qf, x[0]);
    tile_scores<DQ>(b, qf, x[1]);
    read_v(a, sa, lane);
    read_v(b, sb, lane);
    uint32_t pb[2][2], vm[2][2];
    softmax_pair<MASK>(x, qk, rem, lane, st, pb, vm);
    tile_pv<DQ>(a, pb[0][0], pb[0][1], vm[0][0], vm[0][1], st);
    tile_pv<DQ>(b, pb[1][0], pb[1][1], vm[1][0], vm[1][1], st);
  }
};

__device__ __forceinline__ void cursor_init(PageCursor& pc, const Params& p, int b, int seq_len,
                                            int t_lo, int lane) {
  pc.row = p.bt + (long long)b * p.bt_b;
  pc.n_pages = (seq_len + p.page_size - 1) / p.page_size;
  pc.init(t_lo >> p.tpp_log2, lane);
}

// Runs one warp over tiles [t_lo, t_hi), one tile per step, PIPE-stage ring in `ring`.
template <class F, int PIPE>
__device__ __forceinline__ void warp_tiles_pipe(const Params& p, int b, int h, int seq_len,
                                                int t_lo, int t_hi, int lane, uint8_t* ring,
                                                const uint32_t (&qf)[8][2], float qk, State& st) {
  const typename F::LaneT ln = F::lane_of(p, h, lane);
  PageCursor pc;
  cursor_init(pc, p, b, seq_len, t_lo, lane);
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
#pragma unroll
  for (int i = 0; i < PIPE - 1; ++i) {
    if (t_lo + i < t_hi) F::issue(ring_s + i * F::kStage, p, pc, ln, t_lo + i, lane);
    cp_commit();
  }
  int slot = 0;
  for (int tt = t_lo; tt < t_hi; ++tt) {
    cp_wait<PIPE - 2>();
    __syncwarp();
    const uint8_t* cur = ring + slot * F::kStage;
    const int nslot = slot == 0 ? PIPE - 1 : slot - 1;       // the stage read last iteration
    if (tt + PIPE - 1 < t_hi)
      F::issue(ring_s + nslot * F::kStage, p, pc, ln, tt + PIPE - 1, lane);
    cp_commit();
    slot = slot == PIPE - 1 ? 0 : slot + 1;
    const int rem = seq_len - tt * 16;
    if (rem >= 16) F::template one<false>(cur, ln, qf, qk, 16, lane, st);
    else F::template one<true>(cur, ln, qf, qk, rem, lane, st);
  }
  cp_wait<0>();
}

// Waits for the grid this one was launched as a programmatic dependent of (PDL: the fused
// QKV kernel, which writes q and this step's K/V rows) to finish and flush; returns at once
// in a grid launched without that attribute.
__device__ __forceinline__ void grid_dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Two tiles per iteration over a PIPE-stage ring (PIPE even): pairs ahead in flight.
// load_q(qf) runs after the first copies are issued, so that its latency overlaps theirs.
// Under PDL those first copies also overlap the QKV kernel: they run before grid_dep_wait
// unless they would read the sequence's last tile, the one holding the step's new token.
template <class F, int PIPE, class QLoad>
__device__ __forceinline__ void warp_pairs_pipe(const Params& p, int b, int h, int seq_len,
                                                int t_lo, int t_hi, int lane, uint8_t* ring,
                                                QLoad load_q, float qk, State& st) {
  const typename F::LaneT ln = F::lane_of(p, h, lane);
  PageCursor pc;
  cursor_init(pc, p, b, seq_len, t_lo, lane);
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const bool fresh_first = min(t_hi, t_lo + PIPE - 2) * 16 >= seq_len;
  if (fresh_first) grid_dep_wait();
#pragma unroll
  for (int i = 0; i < PIPE - 2; ++i) {
    if (t_lo + i < t_hi) F::issue(ring_s + i * F::kStage, p, pc, ln, t_lo + i, lane);
    cp_commit();
  }
  if (!fresh_first) grid_dep_wait();
  uint32_t qf[8][2];
  load_q(qf);
  const int end = min(seq_len, t_hi * 16);    // tokens past this belong to no tile of ours
  int slot = 0;                               // ring slot of tile tt (even)
  for (int tt = t_lo; tt < t_hi; tt += 2) {
    cp_wait<PIPE - 4>();
    __syncwarp();
    const int ns = slot == 0 ? PIPE - 2 : slot - 2;          // slots read last iteration
    const int tn = tt + PIPE - 2;
    if (tn + 1 < t_hi) {                      // the common case: both tiles, straight line
      F::issue(ring_s + ns * F::kStage, p, pc, ln, tn, lane);
      cp_commit();
      F::issue(ring_s + (ns + 1) * F::kStage, p, pc, ln, tn + 1, lane);
      cp_commit();
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (tn + i < t_hi) F::issue(ring_s + (ns + i) * F::kStage, p, pc, ln, tn + i, lane);
        cp_commit();
      }
    }
    const uint8_t* sa = ring + slot * F::kStage;
    const int rem = end - tt * 16;
    if (rem >= 32) F::template pair<false>(sa, sa + F::kStage, ln, qf, qk, 32, lane, st);
    else F::template pair<true>(sa, sa + F::kStage, ln, qf, qk, rem, lane, st);
    slot = slot == PIPE - 2 ? 0 : slot + 2;
  }
  cp_wait<0>();
}

}  // namespace nibble_nvfp4
