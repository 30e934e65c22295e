// Device Apollo kernel: one phase ('reduce', 'full', 'moments', 'finish') of the step of
// fusedoff/apollo.h over many tensors, or ranges of tensors, per launch. The math is apollo.h's
// (apollo_step_scalars, apollo_grad, apollo_reduce_element, apollo_step_constants,
// apollo_decay_coefficient, apollo_update_moments, apollo_rebound, apollo_finish_element); this
// file only moves data and orders sums. ATen-free: ops.cpp validates the call, sets the device
// guard, and passes the current stream and a workspace of apollo_cuda_workspace_bytes from torch's
// caching allocator; errors come back as std::runtime_error.
//
// Design:
//  - The multi-tensor scheme of multi_tensor.cuh (as adam_cuda.cu): one block per chunk of
//    kChunkElements, the tensors of a launch and the first block of each in a by-value table
//    (ApolloChunkTable, under the 4 KB parameter limit), block -> tensor by binary search, a 64-bit
//    base per block and a 32-bit index inside it, 16-byte accesses from the vector head (the first
//    element where all the pointers a phase uses are aligned) to the last whole vector of a chunk,
//    scalar accesses before and after it, and throughout where the pointers' misalignments differ.
//  - The master weight is read and written as master.h's MasterWeight for the launch's
//    MasterPrecision (a template parameter), as words like the other arrays (multi_tensor.cuh).
//  - Thread 0 of a block reads found_inf, grad_scale, the tensor's step and (except in 'reduce')
//    its stats, all from device memory, and computes the tensor's constants (and the split8 salt)
//    once; shared memory broadcasts them. With *found_inf != 0 every kernel returns before writing
//    anything: the skip is decided on the device, with no host sync.
//  - 'full' and 'finish' are elementwise. 'reduce' and 'moments' also reduce over the tensor,
//    deterministically and without atomics, in two kernels on the stream:
//     1. each block sums its chunk in fp32 (each thread over its own elements in index order, then
//        a fixed shuffle tree per warp, then thread 0 over the warps in order) and writes one
//        partial into the workspace: an ApolloPartials (4 floats) or sum D (1 float);
//     2. apollo_combine_kernel adds the partials of each stats in double: one block per distinct
//        stats pointer of the launch (ranges of one tensor share it; the first slot holding it
//        does every slot holding it, in slot order, so no two blocks write one stats). Each thread
//        sums a contiguous run of a slot's partials in block order, and thread 0 adds the runs in
//        order onto the old stats (a NaN-propagating max for max|y|). Up to kCombineThreads
//        partials per slot (4M elements) a run is one partial and the partials are added in block
//        order, stats += p_0, stats += p_1, ... (the host kernel does the same over its own blocks;
//        its blocks are 32K elements summed in double, these 16K summed per thread in double and
//        across threads in fp32, so the two agree to rounding, not bit for bit).
//    The result depends only on the split into ranges and chunks: reproducible bit for bit. Calls
//    that share stats (ranges of a tensor in several calls) accumulate in stream order.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "fusedoff/apollo.h"
#include "fusedoff/launchers.h"
#include "launch.cuh"
#include "multi_tensor.cuh"

namespace fusedoff {
namespace {

using namespace multi_tensor;

// What every block of one launch shares.
struct ApolloLaunchArgs {
  const float* grad_scale;  // nullptr: no scaling
  const float* found_inf;   // nullptr: always step
  float* partials;          // 'reduce'/'moments': kPartialFloats per block of this launch, in block order
  ApolloHyperparams hyper;
};

// The kernel argument: 47 tensors of 80 bytes plus the rest of the table fit under the classic
// 4 KB parameter limit.
using ApolloChunkTable = ChunkTable<ApolloTensorPtrs, ApolloLaunchArgs, 47>;
static_assert(sizeof(ApolloChunkTable) <= 4096, "the kernel argument must stay under 4 KB");

// The partial of one block: 'reduce' writes the ApolloPartials (stats kSumD4..kMaxAbsY, in that
// order), 'moments' sum D (stats kSumD); the other phases write none.
template <ApolloPhase kPhase>
constexpr int kPartialFloats = kPhase == ApolloPhase::Reduce ? 4 : kPhase == ApolloPhase::Moments ? 1 : 0;
template <ApolloPhase kPhase>
constexpr int kFirstPartialStat = kPhase == ApolloPhase::Reduce ? kSumD4 : kSumD;
static_assert(sizeof(ApolloPartials) == 4 * sizeof(float) &&
                  offsetof(ApolloPartials, sum_d4) == kSumD4 * sizeof(float) &&
                  offsetof(ApolloPartials, sum_yd) == kSumYD * sizeof(float) &&
                  offsetof(ApolloPartials, sum_bdd) == kSumBDD * sizeof(float) &&
                  offsetof(ApolloPartials, max_abs_y) == kMaxAbsY * sizeof(float),
              "ApolloPartials lists its sums in ApolloStat order");

// Elements per thread and vector step: 8 whatever the dtypes (two 16-byte words of an fp32 array,
// one of a 16-bit array; multi_tensor.cuh's kVectorElements would take 4 for fp32). Which thread
// sums which element, and so how the sums round, then depends on the tensor's alignment only, not
// on the dtypes: a GradScaler-scaled fp16 gradient gives the bits of its unscaled fp32 copy, as on
// the host.
constexpr int kApolloVectorElements = 8;

// NOTE: the combine reads 16 bytes per 16K elements reduced; 256 threads keep a 2^31-element
// tensor's 131072 partials to 512 per thread (not timed: see 'GPU launch shapes' in
// benchmarks/results/RESULTS.md).
constexpr int kCombineThreads = 256;

// The partials [begin, end) of a slot's `blocks` (>= 1) that combine thread `thread` sums: contiguous
// runs in block order, one partial each up to kCombineThreads; threads 0 .. num_runs - 1 get one.
struct PartialRun {
  int64_t begin;
  int64_t end;
};

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE int64_t partial_run_length(int64_t blocks) {
  return (blocks + kCombineThreads - 1) / kCombineThreads;
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE PartialRun partial_run(int64_t blocks, int64_t thread) {
  const int64_t run = partial_run_length(blocks);
  const int64_t begin = thread * run < blocks ? thread * run : blocks;
  return {begin, begin + run < blocks ? begin + run : blocks};
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE int64_t num_partial_runs(int64_t blocks) {
  const int64_t run = partial_run_length(blocks);
  return (blocks + run - 1) / run;
}

int64_t partial_floats(ApolloPhase phase) {
  switch (phase) {
    case ApolloPhase::Reduce: return kPartialFloats<ApolloPhase::Reduce>;
    case ApolloPhase::Moments: return kPartialFloats<ApolloPhase::Moments>;
    default: return 0;
  }
}

// What thread 0 computes for its block.
struct BlockConstants {
  ApolloStepConstants c;  // 'reduce': only alpha, curr_lr and l2_decay are set
  float decay;            // 'full'/'finish': apollo_decay_coefficient
  float grad_scale;
  uint32_t salt;          // split8_salt of the step
  bool skip;              // *found_inf != 0
};

// The pointers of one block's chunk, typed and offset by the chunk's 64-bit base.
template <typename P, typename G>
struct ChunkPtrs {
  P* param;
  const G* grad;
  float* exp_avg_grad;
  float* hessian;
  float* update;
  void* master;  // stored as the launch's MasterPrecision
};

template <typename P, typename G, MasterPrecision kMaster>
__device__ __forceinline__ ChunkPtrs<P, G> chunk_ptrs(const ApolloTensorPtrs& t, int64_t begin) {
  ChunkPtrs<P, G> c;
  c.param = static_cast<P*>(t.param) + begin;
  c.grad = static_cast<const G*>(t.grad) + begin;
  c.exp_avg_grad = t.exp_avg_grad + begin;
  c.hessian = t.approx_hessian + begin;
  c.update = t.update + begin;
  c.master = master_at<kMaster>(t.master, begin);
  return c;
}

// Elements [i, i + N) of a chunk, one phase; N > 1 needs every pointer + i aligned for its vector
// accesses (i at or after the vector head). 'reduce' adds into `partial`, 'moments' into `sum_rebound`. Loads and
// stores are those of the host kernel (apollo_cpu.cpp), phase by phase.
template <int N, ApolloPhase kPhase, MasterPrecision kMaster, bool kL2, typename P, typename G>
__device__ __forceinline__ void step_elements(const ChunkPtrs<P, G>& c, int i, const BlockConstants& b,
                                              ApolloPartialsT<double>& partial, double& sum_rebound) {
  const ApolloStepScalars s{b.c.alpha, b.c.curr_lr, b.c.l2_decay, 0.0};  // apollo_grad reads l2_decay only
  float p[N] = {};
  float g[N];
  float m[N];
  float hessian[N];
  float d[N];
  if constexpr (kPhase == ApolloPhase::Reduce) {
    if constexpr (kL2) load_weights<N, kMaster>(c.master, c.param, i, p);  // else p = 0: no parameter is read
    load_elements(c.grad + i, g);
    load_elements(c.exp_avg_grad + i, m);
    load_elements(c.hessian + i, hessian);
    load_elements(c.update + i, d);
#pragma unroll
    for (int k = 0; k < N; ++k)
      apollo_reduce_element(apollo_grad(g[k], p[k], b.grad_scale, s), m[k], hessian[k], d[k], partial);
  } else if constexpr (kPhase == ApolloPhase::Full || kPhase == ApolloPhase::Moments) {
    constexpr bool kFinish = kPhase == ApolloPhase::Full;
    // 'moments' without L2 decay needs no parameter (p = 0 is never read): skip the load.
    if constexpr (kFinish || kL2) load_weights<N, kMaster>(c.master, c.param, i, p);
    load_elements(c.grad + i, g);
    load_elements(c.exp_avg_grad + i, m);
    load_elements(c.hessian + i, hessian);
    load_elements(c.update + i, d);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      apollo_update_moments(apollo_grad(g[k], p[k], b.grad_scale, s), m[k], hessian[k], d[k], b.c);
      if constexpr (kFinish) {
        apollo_finish_element(p[k], m[k], hessian[k], d[k], b.decay, b.c);
      } else {
        sum_rebound += apollo_rebound(hessian[k], b.c);
      }
    }
    store_elements(c.exp_avg_grad + i, m);
    store_elements(c.hessian + i, hessian);
    if constexpr (kFinish) {
      store_elements(c.update + i, d);
      store_weights<N, kMaster>(c.master, c.param, i, p, b.salt);
    }
  } else {  // Finish
    load_weights<N, kMaster>(c.master, c.param, i, p);
    load_elements(c.exp_avg_grad + i, m);
    load_elements(c.hessian + i, hessian);
#pragma unroll
    for (int k = 0; k < N; ++k) apollo_finish_element(p[k], m[k], hessian[k], d[k], b.decay, b.c);
    store_elements(c.update + i, d);
    store_weights<N, kMaster>(c.master, c.param, i, p, b.salt);
  }
}

// ---- block reduction: fixed order, fp32 --------------------------------------------------------

__device__ __forceinline__ ApolloPartials combine_partials(const ApolloPartials& a, const ApolloPartials& b) {
  return {a.sum_d4 + b.sum_d4, a.sum_yd + b.sum_yd, a.sum_bdd + b.sum_bdd, nan_max(a.max_abs_y, b.max_abs_y)};
}
__device__ __forceinline__ float combine_partials(float a, float b) { return a + b; }

__device__ __forceinline__ ApolloPartials shuffle_down(const ApolloPartials& v, int offset) {
  return {__shfl_down_sync(0xffffffffu, v.sum_d4, offset), __shfl_down_sync(0xffffffffu, v.sum_yd, offset),
          __shfl_down_sync(0xffffffffu, v.sum_bdd, offset), __shfl_down_sync(0xffffffffu, v.max_abs_y, offset)};
}
__device__ __forceinline__ float shuffle_down(float v, int offset) { return __shfl_down_sync(0xffffffffu, v, offset); }

// The block's partial, complete in thread 0 (every thread of the block must call it): lanes fold
// by a shuffle tree, then thread 0 folds the warps in order. Same inputs, same bits.
template <typename T>
__device__ __forceinline__ T block_reduce(T v) {
  __shared__ T warp_partials[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = combine_partials(v, shuffle_down(v, offset));
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (lane == 0) warp_partials[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) v = combine_partials(v, warp_partials[w]);
  }
  return v;
}

// ---- the phase kernel ------------------------------------------------------------------------

// One block per chunk of the tensors in `table` (see the design at the top of the file).
template <typename P, typename G, MasterPrecision kMaster, ApolloPhase kPhase, bool kL2>
__global__ void __launch_bounds__(kThreads) apollo_chunks_kernel(const __grid_constant__ ApolloChunkTable table) {
  __shared__ BlockConstants block_constants;

  const BlockWork work = block_work(table, static_cast<int>(blockIdx.x));
  const ApolloTensorPtrs& tensor = table.tensors[work.slot];
  if (threadIdx.x == 0) {
    const ApolloLaunchArgs& args = table.args;
    BlockConstants b{};
    b.skip = args.found_inf != nullptr && *args.found_inf != 0.0f;
    if (!b.skip) {
      const float step = *tensor.step;
      const ApolloStepScalars s = apollo_step_scalars(args.hyper, step);
      b.salt = split8_salt(step);
      if constexpr (kPhase == ApolloPhase::Reduce) {
        b.c = ApolloStepConstants{s.alpha, s.curr_lr, s.l2_decay, 0.0f, 0.0f, 0.0f, 0.0f};
      } else {
        b.c = apollo_step_constants(args.hyper, s, tensor.stats);  // reads the reduced sums
      }
      if constexpr (kPhase == ApolloPhase::Full || kPhase == ApolloPhase::Finish)
        b.decay = apollo_decay_coefficient(args.hyper, tensor.stats, tensor.total_numel);
      b.grad_scale = args.grad_scale != nullptr ? *args.grad_scale : 1.0f;
    }
    block_constants = b;
  }
  __syncthreads();
  if (block_constants.skip) return;  // AMP overflow: change nothing (uniform across the block)
  const BlockConstants b = block_constants;

  constexpr int kVec = kApolloVectorElements;
  const ChunkPtrs<P, G> c = chunk_ptrs<P, G, kMaster>(tensor, work.begin);
  const int thread = static_cast<int>(threadIdx.x);
  // NOTE: each thread sums its elements in double: a sequential fp32 sum of near-equal values (sum D
  // at the rebound floor, say) is biased by up to n/2 ulps; the host kernel does the same.
  ApolloPartialsT<double> thread_partial{0.0, 0.0, 0.0, 0.0f};
  double thread_sum_rebound = 0.0;
  const BlockRuns runs = block_runs<kVec>(table.vector_head[work.slot], work.numel);
  for (int i = thread; i < runs.vector_begin; i += kThreads)
    step_elements<1, kPhase, kMaster, kL2>(c, i, b, thread_partial, thread_sum_rebound);
  for (int i = runs.vector_begin + thread * kVec; i < runs.vector_end; i += kThreads * kVec)
    step_elements<kVec, kPhase, kMaster, kL2>(c, i, b, thread_partial, thread_sum_rebound);
  for (int i = runs.vector_end + thread; i < work.numel; i += kThreads)
    step_elements<1, kPhase, kMaster, kL2>(c, i, b, thread_partial, thread_sum_rebound);
  ApolloPartials partial{static_cast<float>(thread_partial.sum_d4), static_cast<float>(thread_partial.sum_yd),
                         static_cast<float>(thread_partial.sum_bdd), thread_partial.max_abs_y};
  float sum_rebound = static_cast<float>(thread_sum_rebound);

  if constexpr (kPhase == ApolloPhase::Reduce) {
    partial = block_reduce(partial);
    if (threadIdx.x == 0) {
      float* out = table.args.partials + static_cast<int64_t>(blockIdx.x) * kPartialFloats<kPhase>;
      out[kSumD4] = partial.sum_d4;
      out[kSumYD] = partial.sum_yd;
      out[kSumBDD] = partial.sum_bdd;
      out[kMaxAbsY] = partial.max_abs_y;
    }
  } else if constexpr (kPhase == ApolloPhase::Moments) {
    sum_rebound = block_reduce(sum_rebound);
    if (threadIdx.x == 0) table.args.partials[blockIdx.x] = sum_rebound;
  }
}

// ---- the combine kernel: block partials -> stats, in double ------------------------------------

// stats slot `stat` after one more partial: nan_max (apollo.h) in double for max|y|, as the host
// kernel does, else a sum.
__device__ __forceinline__ double fold_stat(int stat, double acc, double x) {
  if (stat == kMaxAbsY) return (x > acc || x != x) ? x : acc;
  return acc + x;
}

// One block per slot of `table`; the block of the first slot with a given stats pointer folds the
// partials of every slot with that pointer, in slot order, into stats[kFirstStat .. + kFields).
template <int kFirstStat, int kFields>
__global__ void __launch_bounds__(kCombineThreads)
    apollo_combine_kernel(const __grid_constant__ ApolloChunkTable table) {
  __shared__ double run_sums[kFields][kCombineThreads];

  if (table.args.found_inf != nullptr && *table.args.found_inf != 0.0f) return;  // no partials were written
  const int slot = static_cast<int>(blockIdx.x);
  double* const stats = table.tensors[slot].stats;
  for (int earlier = 0; earlier < slot; ++earlier)
    if (table.tensors[earlier].stats == stats) return;  // that slot's block folds this one too

  const int64_t thread = static_cast<int64_t>(threadIdx.x);
  double acc[kFields];  // thread 0: the stats so far
  if (thread == 0) {
#pragma unroll
    for (int f = 0; f < kFields; ++f) acc[f] = stats[kFirstStat + f];
  }
  for (int s = slot; s < table.num_tensors; ++s) {
    if (table.tensors[s].stats != stats) continue;  // uniform across the block
    const int64_t blocks = chunks_of(table.tensors[s].numel);  // >= 1: empty tensors have no slot
    const PartialRun run = partial_run(blocks, thread);
    const float* partials = table.args.partials + static_cast<int64_t>(table.first_block[s]) * kFields;
    double sum[kFields];
#pragma unroll
    for (int f = 0; f < kFields; ++f) sum[f] = 0.0;  // also max|y|'s start, as on the host: |y| >= 0
#pragma unroll 4
    for (int64_t block = run.begin; block < run.end; ++block) {
#pragma unroll
      for (int f = 0; f < kFields; ++f) sum[f] = fold_stat(kFirstStat + f, sum[f], partials[block * kFields + f]);
    }
    __syncthreads();  // thread 0 has folded the previous slot's runs
#pragma unroll
    for (int f = 0; f < kFields; ++f) run_sums[f][thread] = sum[f];
    __syncthreads();
    if (thread == 0) {
      const int64_t runs = num_partial_runs(blocks);
      for (int64_t r = 0; r < runs; ++r) {
#pragma unroll
        for (int f = 0; f < kFields; ++f) acc[f] = fold_stat(kFirstStat + f, acc[f], run_sums[f][r]);
      }
    }
  }
  if (thread == 0) {
#pragma unroll
    for (int f = 0; f < kFields; ++f) stats[kFirstStat + f] = acc[f];
  }
}

// ---- host side -------------------------------------------------------------------------------

// The vector head (multi_tensor.cuh) of the pointers the phase reads or writes.
template <typename P, typename G, MasterPrecision kMaster>
int apollo_vector_head(const ApolloTensorPtrs& t, ApolloPhase phase, bool l2) {
  constexpr int kState = static_cast<int>(sizeof(float));
  const bool uses_grad = phase != ApolloPhase::Finish;
  const bool uses_param = phase != ApolloPhase::Reduce || l2;
  const Access accesses[] = {{t.exp_avg_grad, kState},
                             {t.approx_hessian, kState},
                             {t.update, kState},
                             {t.grad, uses_grad ? static_cast<int>(sizeof(G)) : 0},
                             {t.param, uses_param ? static_cast<int>(sizeof(P)) : 0},
                             master_access<kMaster, kApolloVectorElements>(t.master, uses_param)};
  return multi_tensor::vector_head(accesses);
}

// Walks the launches of one call in order: fills `table` with the next tensors (the partials of
// consecutive launches follow one another in the workspace) and calls run(table, blocks).
template <typename P, typename G, MasterPrecision kMaster, typename Run>
void for_each_launch(const ApolloLaunch& launch, bool l2, ApolloChunkTable& table, Run&& run) {
  table.args = ApolloLaunchArgs{launch.grad_scale, launch.found_inf, nullptr, launch.hyper};
  const int64_t floats_per_block = partial_floats(launch.phase);
  float* partials = static_cast<float*>(launch.workspace);
  const auto head_of = [&](const ApolloTensorPtrs& t) {
    return apollo_vector_head<P, G, kMaster>(t, launch.phase, l2);
  };
  int64_t next_tensor = 0;
  while (const int64_t blocks =
             fill_chunk_table(launch.tensors, launch.num_tensors, next_tensor, table, head_of, "apollo_step_cuda")) {
    table.args.partials = partials;
    run(static_cast<const ApolloChunkTable&>(table), blocks);
    if (floats_per_block > 0) partials += blocks * floats_per_block;
  }
}

template <typename P, typename G, MasterPrecision kMaster, ApolloPhase kPhase, bool kL2>
void launch_apollo_chunks(const ApolloLaunch& launch) {
  constexpr int kFields = kPartialFloats<kPhase>;
  const cudaStream_t stream = static_cast<cudaStream_t>(launch.stream);
  ApolloChunkTable table{};
  for_each_launch<P, G, kMaster>(launch, kL2, table, [&](const ApolloChunkTable& t, int64_t blocks) {
    launch_kernel(apollo_chunks_kernel<P, G, kMaster, kPhase, kL2>, static_cast<unsigned int>(blocks), kThreads, stream,
                  t);
    check_launch("apollo_step_cuda");
    if constexpr (kFields > 0) {
      launch_kernel(apollo_combine_kernel<kFirstPartialStat<kPhase>, kFields>, static_cast<unsigned int>(t.num_tensors),
                    kCombineThreads, stream, t);
      check_launch("apollo_step_cuda");
    }
  });
}

template <typename P, typename G, MasterPrecision kMaster>
void launch_apollo_phase(const ApolloLaunch& launch) {
  switch (launch.phase) {
    case ApolloPhase::Reduce:
      if (launch.hyper.decay == ApolloDecay::L2) {
        launch_apollo_chunks<P, G, kMaster, ApolloPhase::Reduce, true>(launch);
      } else {
        launch_apollo_chunks<P, G, kMaster, ApolloPhase::Reduce, false>(launch);
      }
      break;
    case ApolloPhase::Full: launch_apollo_chunks<P, G, kMaster, ApolloPhase::Full, false>(launch); break;
    case ApolloPhase::Moments: launch_apollo_chunks<P, G, kMaster, ApolloPhase::Moments, false>(launch); break;
    // 'finish' reads no gradient: one instantiation per parameter type.
    case ApolloPhase::Finish: launch_apollo_chunks<P, float, kMaster, ApolloPhase::Finish, false>(launch); break;
  }
}

}  // namespace

int64_t apollo_cuda_workspace_bytes(const ApolloLaunch& launch) {
  int64_t blocks = 0;  // every launch's, in launch order: the launches take consecutive tensors
  for (int64_t i = 0; i < launch.num_tensors; ++i) blocks += chunks_of(launch.tensors[i].numel);
  return blocks * partial_floats(launch.phase) * static_cast<int64_t>(sizeof(float));
}

void apollo_step_cuda(const ApolloLaunch& launch) {
  if (launch.workspace == nullptr && apollo_cuda_workspace_bytes(launch) > 0)
    throw std::runtime_error("fusedoff: apollo_step_cuda: launch.workspace is null; allocate "
                             "apollo_cuda_workspace_bytes(launch) bytes");
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      dispatch_master<P>(launch.master,
                         [&](auto master) { launch_apollo_phase<P, G, decltype(master)::value>(launch); });
    });
  });
}

}  // namespace fusedoff
