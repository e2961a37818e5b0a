// The extension's torch binding: packs tensors into Params / StoreParams (params.cuh) and calls
// the launchers of decode.cu and store.cu. Exports decode, occupancy and store.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include "params.cuh"

using namespace nibble_nvfp4;

static int dtype_code(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kBFloat16) return 0;
  if (t.scalar_type() == torch::kFloat16) return 1;
  return 2;
}

// Arguments are checked by the Python wrapper; this only packs pointers and launches (the
// reduce kernel only when `counters` is empty).
void decode(torch::Tensor q, torch::Tensor bt, torch::Tensor seq_lens, torch::Tensor kd,
            torch::Tensor vd, torch::Tensor ks, torch::Tensor vs, int64_t page_stride,
            int64_t page_size, int64_t tpp_log2, int64_t group, torch::Tensor k_gs,
            torch::Tensor v_gs, double qk_scale, torch::Tensor part_o, torch::Tensor part_ml,
            torch::Tensor out, torch::Tensor counters, int64_t nsplit, int64_t variant,
            bool pdl) {
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
  // An empty counter buffer selects the reduce kernel; otherwise the decode kernel combines.
  p.counters = counters.numel() > 0 ? counters.data_ptr<int>() : nullptr;
  p.out = out.data_ptr(); p.o_b = out.stride(0); p.o_h = out.stride(1);
  p.out_dtype = dtype_code(out);
  const int batch = (int)q.size(0), hq = (int)q.size(1);
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  launch_decode(p, batch, (int)variant, stream, pdl);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.counters != nullptr) return;
  launch_reduce(p.part_o, p.part_ml, out.data_ptr(), out.stride(0), out.stride(1),
                dtype_code(out), batch, hq, (int)nsplit, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t occupancy(int64_t variant) { return decode_occupancy((int)variant); }

void store(torch::Tensor k, torch::Tensor v, torch::Tensor slots, torch::Tensor kd,
           torch::Tensor vd, torch::Tensor ks, torch::Tensor vs, torch::Tensor k_gs,
           torch::Tensor v_gs, int64_t page_size, int64_t variant) {
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
  launch_store(p, (int)variant, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", torch::wrap_pybind_function(decode), "decode");
  m.def("occupancy", torch::wrap_pybind_function(occupancy), "occupancy");
  m.def("store", torch::wrap_pybind_function(store), "store");
}
