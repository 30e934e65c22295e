// Device Adam/AdamW kernel: the math of fusedoff/adam.h (`adam_scalars`, `adam_update`) over many
// tensors per launch. ATen-free: ops.cpp validates the call, sets the device guard and passes the
// current stream; errors come back as std::runtime_error.
//
// Design:
//  - The multi-tensor scheme of multi_tensor.cuh: one block per chunk of kChunkElements, the
//    tensors of a launch and the first block of each in a by-value table (AdamChunkTable, under the
//    4 KB parameter limit), block -> tensor by binary search, a 64-bit base offset per block and a
//    32-bit index inside it. The host launches until every tensor is done.
//  - 16-byte accesses, kVectorElements per thread and step, from the tensor's vector head (the
//    first element where all its pointers are 16-byte aligned) to the last whole vector of each
//    chunk; the elements before the head and after the last vector take the scalar path, and so does
//    every element of a tensor whose pointers differ in misalignment (multi_tensor.cuh).
//  - Thread 0 of a block reads found_inf, grad_scale and the tensor's step and computes the
//    AdamScalars (double pow) once; shared memory broadcasts them. With *found_inf != 0 every block
//    returns before touching a tensor: the skip is decided on the device, with no host sync.
#include <cuda_runtime.h>

#include <cstdint>

#include "fusedoff/adam.h"
#include "fusedoff/launchers.h"
#include "launch.cuh"
#include "multi_tensor.cuh"

namespace fusedoff {
namespace {

using namespace multi_tensor;

// What every block of one launch shares.
struct AdamLaunchArgs {
  const float* grad_scale;  // nullptr: no scaling
  const float* found_inf;   // nullptr: always step
  AdamHyperparams hyper;
};

// The kernel argument: 56 tensors of 64 bytes plus the rest of the table fit under the classic
// 4 KB parameter limit.
using AdamChunkTable = ChunkTable<AdamTensorPtrs, AdamLaunchArgs, 56>;
static_assert(sizeof(AdamChunkTable) <= 4096, "the kernel argument must stay under 4 KB");

// The pointers of one block's chunk, typed and offset by the chunk's 64-bit base.
template <typename P, typename G>
struct ChunkPtrs {
  P* param;
  const G* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  float* master;
};

template <typename P, typename G, bool kAmsgrad, bool kMaster>
__device__ __forceinline__ ChunkPtrs<P, G> chunk_ptrs(const AdamTensorPtrs& t, int64_t begin) {
  ChunkPtrs<P, G> c;
  c.param = static_cast<P*>(t.param) + begin;
  c.grad = static_cast<const G*>(t.grad) + begin;
  c.exp_avg = t.exp_avg + begin;
  c.exp_avg_sq = t.exp_avg_sq + begin;
  c.max_exp_avg_sq = kAmsgrad ? t.max_exp_avg_sq + begin : nullptr;
  c.master = kMaster ? static_cast<float*>(t.master) + begin : nullptr;
  return c;
}

// Elements [i, i + kVec) of a chunk; every pointer + i is 16-byte aligned (i >= the vector head).
template <int kVec, bool kAmsgrad, bool kMaster, typename P, typename G>
__device__ __forceinline__ void update_vector(const ChunkPtrs<P, G>& c, int i, float grad_scale,
                                              const AdamScalars& s) {
  float p[kVec];
  float g[kVec];
  float m[kVec];
  float v[kVec];
  float vmax[kVec] = {};
  if (kMaster) {
    load_vector(c.master + i, p);
  } else {
    load_vector(c.param + i, p);
  }
  load_vector(c.grad + i, g);
  load_vector(c.exp_avg + i, m);
  load_vector(c.exp_avg_sq + i, v);
  if (kAmsgrad) load_vector(c.max_exp_avg_sq + i, vmax);
#pragma unroll
  for (int k = 0; k < kVec; ++k) adam_update<kAmsgrad>(p[k], g[k], m[k], v[k], vmax[k], grad_scale, s);
  store_vector(c.exp_avg + i, m);
  store_vector(c.exp_avg_sq + i, v);
  if (kAmsgrad) store_vector(c.max_exp_avg_sq + i, vmax);
  if (kMaster) store_vector(c.master + i, p);
  store_vector(c.param + i, p);
}

// Element i of a chunk, any alignment; the same loads and stores as the host kernel.
template <bool kAmsgrad, bool kMaster, typename P, typename G>
__device__ __forceinline__ void update_scalar(const ChunkPtrs<P, G>& c, int i, float grad_scale,
                                              const AdamScalars& s) {
  float p = kMaster ? c.master[i] : load_float(c.param + i);
  float m = c.exp_avg[i];
  float v = c.exp_avg_sq[i];
  float vmax = kAmsgrad ? c.max_exp_avg_sq[i] : 0.0f;
  adam_update<kAmsgrad>(p, load_float(c.grad + i), m, v, vmax, grad_scale, s);
  c.exp_avg[i] = m;
  c.exp_avg_sq[i] = v;
  if (kAmsgrad) c.max_exp_avg_sq[i] = vmax;
  if (kMaster) c.master[i] = p;
  store_float(c.param + i, p);
}

// One block per chunk of the tensors in `table` (see the design at the top of the file).
template <typename P, typename G, bool kAmsgrad, bool kMaster>
__global__ void __launch_bounds__(kThreads) adam_chunks_kernel(const __grid_constant__ AdamChunkTable table) {
  __shared__ AdamScalars block_scalars;
  __shared__ float block_grad_scale;
  __shared__ bool block_skips;

  const BlockWork work = block_work(table, static_cast<int>(blockIdx.x));
  const AdamTensorPtrs& tensor = table.tensors[work.slot];
  if (threadIdx.x == 0) {
    const bool skip = table.args.found_inf != nullptr && *table.args.found_inf != 0.0f;
    block_skips = skip;
    if (!skip) {
      block_scalars = adam_scalars(table.args.hyper, *tensor.step);
      block_grad_scale = table.args.grad_scale != nullptr ? *table.args.grad_scale : 1.0f;
    }
  }
  __syncthreads();
  if (block_skips) return;  // AMP overflow: change nothing
  const AdamScalars s = block_scalars;
  const float grad_scale = block_grad_scale;

  constexpr int kVec = kVectorElements<P, G>;
  const ChunkPtrs<P, G> c = chunk_ptrs<P, G, kAmsgrad, kMaster>(tensor, work.begin);
  const int thread = static_cast<int>(threadIdx.x);
  const BlockRuns runs = block_runs<kVec>(table.vector_head[work.slot], work.numel);
  for (int i = thread; i < runs.vector_begin; i += kThreads) update_scalar<kAmsgrad, kMaster>(c, i, grad_scale, s);
  for (int i = runs.vector_begin + thread * kVec; i < runs.vector_end; i += kThreads * kVec)
    update_vector<kVec, kAmsgrad, kMaster>(c, i, grad_scale, s);
  for (int i = runs.vector_end + thread; i < work.numel; i += kThreads)
    update_scalar<kAmsgrad, kMaster>(c, i, grad_scale, s);
}

// The vector head (multi_tensor.cuh) of the pointers the kernel reads or writes.
template <typename P, typename G>
int adam_vector_head(const AdamTensorPtrs& t, bool amsgrad, bool has_master) {
  constexpr int kState = static_cast<int>(sizeof(float));
  const Access accesses[] = {{t.param, static_cast<int>(sizeof(P))},
                             {t.grad, static_cast<int>(sizeof(G))},
                             {t.exp_avg, kState},
                             {t.exp_avg_sq, kState},
                             {t.max_exp_avg_sq, amsgrad ? kState : 0},
                             {t.master, has_master ? kState : 0}};
  return multi_tensor::vector_head(accesses);
}

template <typename P, typename G, bool kAmsgrad, bool kMaster>
void launch_adam_chunks(const AdamLaunch& launch) {
  const cudaStream_t stream = static_cast<cudaStream_t>(launch.stream);
  AdamChunkTable table{};
  table.args = AdamLaunchArgs{launch.grad_scale, launch.found_inf, launch.hyper};
  const auto head_of = [&](const AdamTensorPtrs& t) {
    return adam_vector_head<P, G>(t, launch.amsgrad, (launch.master == MasterPrecision::Float32));
  };
  int64_t next_tensor = 0;
  while (const int64_t blocks =
             fill_chunk_table(launch.tensors, launch.num_tensors, next_tensor, table, head_of, "adam_step_cuda")) {
    launch_kernel(adam_chunks_kernel<P, G, kAmsgrad, kMaster>, static_cast<unsigned int>(blocks), kThreads, stream, table);
    check_launch("adam_step_cuda");
  }
}

}  // namespace

void adam_step_cuda(const AdamLaunch& launch) {
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      if (launch.amsgrad && (launch.master == MasterPrecision::Float32)) {
        launch_adam_chunks<P, G, true, true>(launch);
      } else if (launch.amsgrad) {
        launch_adam_chunks<P, G, true, false>(launch);
      } else if ((launch.master == MasterPrecision::Float32)) {
        launch_adam_chunks<P, G, false, true>(launch);
      } else {
        launch_adam_chunks<P, G, false, false>(launch);
      }
    });
  });
}

}  // namespace fusedoff
