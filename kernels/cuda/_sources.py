"""CUDA C++ sources of the NVFP4 / FP8 decode kernel, kept as strings (built on first use).

``PARAMS`` is shared by the device code (``CUDA_SRC`` = ``PARAMS`` + :mod:`._src_tile`
+ :mod:`._src_pipe` + :mod:`._src_fp8` + :mod:`._src_kernel`) and the torch binding
(``CPP_SRC``). The device code includes no
torch header, so nvcc compiles it quickly and it can also be compiled alone
(``nvcc -cubin``) to read registers and SASS.

Kernel design (one CTA = 4 warps for one (sequence, KV head, split); each warp runs
its own online softmax over a contiguous range of 16-token tiles, then the 4 warps
combine through shared memory and write one partial; a reduce kernel combines splits):

* S^T = K Q^T with ``mma.sync.m16n8k16`` fp16 -> fp32, swap-AB: A = K (16 tokens on
  M), B = Q^T (n = 8 query heads, up to 8 real). The head dim of each k-step is
  permuted so that lane ``(g, t)`` (``g = lane / 4``, ``t = lane % 4``) needs exactly
  head-dim elements ``[32t, 32t + 32)`` of tokens ``g`` and ``8 + g``: one 16-byte load
  per token row, no shuffles. Q uses the same permutation.
* O^T = V^T P^T, swap-AB: A = V^T (rows = head dim, 8 m-tiles), B = P^T (k = 16
  tokens, n = 8 heads). P goes from the S accumulator to the B fragment with two
  ``movmatrix.trans`` per tile. Lane ``(g, t)`` owns head-dim block ``g``
  (``d = 16g .. 16g+15``) of tokens ``2t, 2t+1, 8+2t, 9+2t``: 8 bytes per token row.
* E2M1 -> fp16 by bit placement: ``s << 15 | m << 9`` is exactly value * 2^-14
  (7 logic ops + 4 byte permutes per 8 codes; V pairs two tokens' bytes first).
  Block scales are converted with ``cvt.rn.f16x2.e4m3x2``, times 2^7 (so every
  product is an exact normal-range fp16), and applied with one ``HMUL2`` per 2
  elements. 2^7 * 2^-14 and the global scales fold into the softmax scale (K) and
  the partial output (V).
* Online softmax in the log2 domain with a lazy rescale: the running max moves only
  when a score exceeds it by more than 8, so ``p <= 256``; a warp vote skips the
  max reduction and the accumulator rescale otherwise.
* Feeding (variants, see ``decode.VARIANTS``): the next tile prefetched into
  registers (ping-pong), or a per-warp ``cp.async`` ring in shared memory with
  lane-private chunk layouts (conflict-free), consumed one tile or two tiles (one
  softmax step per 32 tokens, two independent score chains) at a time.
* FP8 E4M3 pages (``decode.FP8_VARIANTS``) share everything but the tile: the ring
  loops, softmax step and combine are templates over a *format policy* (NVFP4 or FP8,
  see :mod:`._src_pipe` and :mod:`._src_fp8`); FP8 converts with one
  ``cvt.rn.f16x2.e4m3x2`` per 2 values and has no block scales.
"""

from ._src_fp8 import FP8_SRC
from ._src_kernel import KERNEL_SRC
from ._src_pipe import PIPE_SRC
from ._src_store import STORE_SRC
from ._src_tile import TILE_SRC

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
struct StoreParams {                                    // NVFP4 quantize-and-store
  const void* k; const void* v; long long k_t, k_h, v_t, v_h;  // [T, H, D], element strides
  int in_dtype;                                         // 0 bf16, 1 FP8 E4M3
  const void* slots; int slot_i64;                      // [T] page * S + offset, < 0: skip
  int n_tokens, num_heads, head_dim;
  uint8_t* kd; uint8_t* vd; uint8_t* ks; uint8_t* vs;   // layer views at page 0
  long long page_stride, d_h, d_t, s_h, s_t;            // bytes: page; code / scale head, token
  int page_size;
  const float* k_gs; const float* v_gs;
};
void launch_decode(const Params& p, int batch, int variant, void* stream);
void launch_store(const StoreParams& p, void* stream);
void launch_reduce(const float* part_o, const float* part_ml, void* out, long long o_b,
                   long long o_h, int out_dtype, int batch, int hq, int nsplit, void* stream);
int decode_occupancy(int variant);
}  // namespace nibble_nvfp4
"""

CUDA_SRC = PARAMS + TILE_SRC + PIPE_SRC + FP8_SRC + KERNEL_SRC + STORE_SRC

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

void store(torch::Tensor k, torch::Tensor v, torch::Tensor slots, torch::Tensor kd,
           torch::Tensor vd, torch::Tensor ks, torch::Tensor vs, torch::Tensor k_gs,
           torch::Tensor v_gs, int64_t page_size) {
  TORCH_CHECK(k.is_cuda() && kd.is_cuda(), "store: CUDA tensors expected");
  const c10::cuda::CUDAGuard guard(k.device());
  StoreParams p;
  p.k = k.data_ptr(); p.v = v.data_ptr();
  p.k_t = k.stride(0); p.k_h = k.stride(1); p.v_t = v.stride(0); p.v_h = v.stride(1);
  p.in_dtype = k.scalar_type() == torch::kFloat8_e4m3fn ? 1 : 0;
  p.slots = slots.data_ptr(); p.slot_i64 = slots.scalar_type() == torch::kInt64;
  p.n_tokens = (int)k.size(0); p.num_heads = (int)k.size(1); p.head_dim = (int)k.size(2);
  p.kd = kd.data_ptr<uint8_t>(); p.vd = vd.data_ptr<uint8_t>();
  p.ks = ks.data_ptr<uint8_t>(); p.vs = vs.data_ptr<uint8_t>();
  p.page_stride = kd.stride(0); p.d_h = kd.stride(1); p.d_t = kd.stride(2);
  p.s_h = ks.stride(1); p.s_t = ks.stride(2); p.page_size = (int)page_size;
  p.k_gs = k_gs.data_ptr<float>(); p.v_gs = v_gs.data_ptr<float>();
  launch_store(p, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""
