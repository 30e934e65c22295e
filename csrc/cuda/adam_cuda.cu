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
//  - The master weight is read and written as master.h's MasterWeight for the launch's
//    MasterPrecision (a template parameter): fp32, or the low bits of a split master beside the
//    bf16 parameter, loaded and stored as words like the other arrays (multi_tensor.cuh).
//  - Thread 0 of a block reads found_inf, grad_scale and the tensor's step and computes the
//    AdamScalars (double pow) and the split8 salt once; shared memory broadcasts them. With
//    *found_inf != 0 every block returns before touching a tensor: the skip is decided on the
//    device, with no host sync.
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
  void* master;  // stored as the launch's MasterPrecision
};

template <typename P, typename G, bool kAmsgrad, MasterPrecision kMaster>
__device__ __forceinline__ ChunkPtrs<P, G> chunk_ptrs(const AdamTensorPtrs& t, int64_t begin) {
  ChunkPtrs<P, G> c;
  c.param = static_cast<P*>(t.param) + begin;
  c.grad = static_cast<const G*>(t.grad) + begin;
  c.exp_avg = t.exp_avg + begin;
  c.exp_avg_sq = t.exp_avg_sq + begin;
  c.max_exp_avg_sq = kAmsgrad ? t.max_exp_avg_sq + begin : nullptr;
  c.master = master_at<kMaster>(t.master, begin);
  return c;
}

// Elements [i, i + kVec) of a chunk; every pointer + i is aligned for its vector accesses (i >= the
// vector head).
template <int kVec, bool kAmsgrad, MasterPrecision kMaster, typename P, typename G>
__device__ __forceinline__ void update_vector(const ChunkPtrs<P, G>& c, int i, float grad_scale,
                                              const AdamScalars& s, uint32_t salt) {
  float p[kVec];
  float g[kVec];
  float m[kVec];
  float v[kVec];
  float vmax[kVec] = {};
  load_weights<kVec, kMaster>(c.master, c.param, i, p);
  load_vector(c.grad + i, g);
  load_vector(c.exp_avg + i, m);
  load_vector(c.exp_avg_sq + i, v);
  if (kAmsgrad) load_vector(c.max_exp_avg_sq + i, vmax);
#pragma unroll
  for (int k = 0; k < kVec; ++k) adam_update<kAmsgrad>(p[k], g[k], m[k], v[k], vmax[k], grad_scale, s);
  store_vector(c.exp_avg + i, m);
  store_vector(c.exp_avg_sq + i, v);
  if (kAmsgrad) store_vector(c.max_exp_avg_sq + i, vmax);
  store_weights<kVec, kMaster>(c.master, c.param, i, p, salt);
}

// Element i of a chunk, any alignment; the same loads and stores as the host kernel.
template <bool kAmsgrad, MasterPrecision kMaster, typename P, typename G>
__device__ __forceinline__ void update_scalar(const ChunkPtrs<P, G>& c, int i, float grad_scale,
                                              const AdamScalars& s, uint32_t salt) {
  float p = MasterWeight<kMaster, P>::load(c.master, c.param, i);
  float m = c.exp_avg[i];
  float v = c.exp_avg_sq[i];
  float vmax = kAmsgrad ? c.max_exp_avg_sq[i] : 0.0f;
  adam_update<kAmsgrad>(p, load_float(c.grad + i), m, v, vmax, grad_scale, s);
  c.exp_avg[i] = m;
  c.exp_avg_sq[i] = v;
  if (kAmsgrad) c.max_exp_avg_sq[i] = vmax;
  MasterWeight<kMaster, P>::store(c.master, c.param, i, p, salt);
}

// One block per chunk of the tensors in `table` (see the design at the top of the file).
template <typename P, typename G, bool kAmsgrad, MasterPrecision kMaster>
__global__ void __launch_bounds__(kThreads) adam_chunks_kernel(const __grid_constant__ AdamChunkTable table) {
  __shared__ AdamScalars block_scalars;
  __shared__ float block_grad_scale;
  __shared__ uint32_t block_salt;
  __shared__ bool block_skips;

  const BlockWork work = block_work(table, static_cast<int>(blockIdx.x));
  const AdamTensorPtrs& tensor = table.tensors[work.slot];
  if (threadIdx.x == 0) {
    const bool skip = table.args.found_inf != nullptr && *table.args.found_inf != 0.0f;
    block_skips = skip;
    if (!skip) {
      const float step = *tensor.step;
      block_scalars = adam_scalars(table.args.hyper, step);
      block_salt = split8_salt(step);
      block_grad_scale = table.args.grad_scale != nullptr ? *table.args.grad_scale : 1.0f;
    }
  }
  __syncthreads();
  if (block_skips) return;  // AMP overflow: change nothing
  const AdamScalars s = block_scalars;
  const float grad_scale = block_grad_scale;
  const uint32_t salt = block_salt;

  constexpr int kVec = kVectorElements<P, G>;
  const ChunkPtrs<P, G> c = chunk_ptrs<P, G, kAmsgrad, kMaster>(tensor, work.begin);
  const int thread = static_cast<int>(threadIdx.x);
  const BlockRuns runs = block_runs<kVec>(table.vector_head[work.slot], work.numel);
  for (int i = thread; i < runs.vector_begin; i += kThreads)
    update_scalar<kAmsgrad, kMaster>(c, i, grad_scale, s, salt);
  for (int i = runs.vector_begin + thread * kVec; i < runs.vector_end; i += kThreads * kVec)
    update_vector<kVec, kAmsgrad, kMaster>(c, i, grad_scale, s, salt);
  for (int i = runs.vector_end + thread; i < work.numel; i += kThreads)
    update_scalar<kAmsgrad, kMaster>(c, i, grad_scale, s, salt);
}

// The vector head (multi_tensor.cuh) of the pointers the kernel reads or writes.
template <typename P, typename G, MasterPrecision kMaster>
int adam_vector_head(const AdamTensorPtrs& t, bool amsgrad) {
  constexpr int kState = static_cast<int>(sizeof(float));
  const Access accesses[] = {{t.param, static_cast<int>(sizeof(P))},
                             {t.grad, static_cast<int>(sizeof(G))},
                             {t.exp_avg, kState},
                             {t.exp_avg_sq, kState},
                             {t.max_exp_avg_sq, amsgrad ? kState : 0},
                             master_access<kMaster, kVectorElements<P, G>>(t.master)};
  return multi_tensor::vector_head(accesses);
}

template <typename P, typename G, bool kAmsgrad, MasterPrecision kMaster>
void launch_adam_chunks(const AdamLaunch& launch) {
  const cudaStream_t stream = static_cast<cudaStream_t>(launch.stream);
  AdamChunkTable table{};
  table.args = AdamLaunchArgs{launch.grad_scale, launch.found_inf, launch.hyper};
  const auto head_of = [&](const AdamTensorPtrs& t) {
    return adam_vector_head<P, G, kMaster>(t, launch.amsgrad);
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
      dispatch_master<P>(launch.master, [&](auto master) {
        constexpr MasterPrecision kMaster = decltype(master)::value;
        launch.amsgrad ? launch_adam_chunks<P, G, true, kMaster>(launch)
                       : launch_adam_chunks<P, G, false, kMaster>(launch);
      });
    });
  });
}

}  // namespace fusedoff
