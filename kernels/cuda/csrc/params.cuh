// Launch parameters of the decode, reduce and store kernels, and the launchers' declarations.
// Shared by the device code (decode.cu, store.cu) and the torch binding (binding.cpp): plain
// C++ with no CUDA or torch header, so g++ includes it as well as nvcc.
#pragma once
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
  // Fused combine (null counters: the reduce kernel combines the splits instead): one int32
  // per (sequence, KV head), zero before the launch and left zero by it; out [B, Hq, 128].
  int* counters; void* out; long long o_b, o_h; int out_dtype;  // out element strides
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
void launch_decode(const Params& p, int batch, int variant, void* stream, bool pdl);
void launch_store(const StoreParams& p, int variant, void* stream);  // store.cu
void launch_reduce(const float* part_o, const float* part_ml, void* out, long long o_b,
                   long long o_h, int out_dtype, int batch, int hq, int nsplit, void* stream);
int decode_occupancy(int variant);
}  // namespace nibble_nvfp4
