// Device Adam/AdamW kernel: the math of fusedoff/adam.h (`adam_scalars`, `adam_update`) over many
// tensors per launch. ATen-free: ops.cpp validates the call, sets the device guard and passes the
// current stream; errors come back as std::runtime_error.
//
// Design:
//  - Every tensor is cut into chunks of kChunkElements; one thread block updates one chunk.
//  - One launch serves up to kMaxTensors tensors. Their pointers and a block table travel by value
//    as the kernel argument (AdamChunkTable, under the 4 KB parameter limit). The table holds the
//    first block of each tensor: block b works on the last tensor whose first block is <= b (a
//    binary search) and on chunk b - first_block of it. So the table grows with the number of
//    tensors, not of blocks: a tensor is never split across launches, and one launch covers any
//    tensor up to 2^31 - 1 chunks (3.5e13 elements). The host launches until every tensor is done.
//  - Indexing: a 64-bit base offset per block (chunk * kChunkElements), a 32-bit index inside it.
//  - A tensor whose pointers are all 16-byte aligned is read and written with 16-byte accesses,
//    kVectorElements per thread and step; the last (< kVectorElements) elements of its chunks, and
//    every element of a tensor with an unaligned pointer (a view offset by one element), take the
//    scalar path.
//  - Thread 0 of a block reads found_inf, grad_scale and the tensor's step and computes the
//    AdamScalars (double pow) once; shared memory broadcasts them. With *found_inf != 0 every block
//    returns before touching a tensor: the skip is decided on the device, with no host sync.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "fusedoff/adam.h"
#include "fusedoff/launchers.h"

namespace fusedoff {
namespace {

// NOTE: not measured yet (written on a machine without a GPU). 256 threads and 16K elements per
// block: 16 (fp32) or 8 (16-bit params or grads) vector steps per thread, enough blocks that a
// 16M-element tensor fills two waves of an H100/H200, and a per-block prologue (a search over the
// table and two double pows, about 1 us) that is a few percent of the block's memory time.
constexpr int kThreads = 256;
constexpr int kChunkElements = 16384;
constexpr int64_t kMaxBlocksPerLaunch = 2147483647;  // gridDim.x limit
// 56 tensors of 64 bytes plus the rest of the table fit under the classic 4 KB parameter limit.
constexpr int kMaxTensors = 56;

// The kernel argument: the tensors of one launch and the first block of each.
struct AdamChunkTable {
  AdamTensorPtrs tensors[kMaxTensors];
  const float* grad_scale;  // nullptr: no scaling
  const float* found_inf;   // nullptr: always step
  AdamHyperparams hyper;
  int32_t first_block[kMaxTensors];  // strictly increasing: empty tensors are left out
  int32_t num_tensors;
  bool vector_aligned[kMaxTensors];  // all of the tensor's pointers are 16-byte aligned
};
static_assert(sizeof(AdamChunkTable) <= 4096, "the kernel argument must stay under 4 KB");

// Elements per thread and vector step: 16 bytes of the narrowest stored type (the state is fp32).
template <typename P, typename G>
constexpr int kVectorElements = 16 / static_cast<int>(sizeof(P) < sizeof(G) ? sizeof(P) : sizeof(G));

// What one block updates: elements [begin, begin + numel) of tensor `slot` of the table.
struct BlockWork {
  int slot;
  int64_t begin;
  int numel;
};

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE BlockWork block_work(const AdamChunkTable& table, int block) {
  int lo = 0;  // first_block[0] == 0 <= block
  int hi = table.num_tensors - 1;
  while (lo < hi) {  // the last slot whose first block is <= block
    const int mid = (lo + hi + 1) / 2;
    if (table.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t begin = static_cast<int64_t>(block - table.first_block[lo]) * kChunkElements;
  const int64_t left = table.tensors[lo].numel - begin;
  return {lo, begin, static_cast<int>(left < kChunkElements ? left : kChunkElements)};
}

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
  c.master = kMaster ? t.master + begin : nullptr;
  return c;
}

// 16 bytes of storage elements: one 128-bit load or store.
template <typename T>
struct alignas(16) Word16 {
  T elems[16 / sizeof(T)];
};

template <int N, typename T>
__device__ __forceinline__ void load_vector(const T* src, float (&dst)[N]) {
  constexpr int kPerWord = 16 / static_cast<int>(sizeof(T));
  static_assert(N % kPerWord == 0, "a vector step is a whole number of 16-byte words");
#pragma unroll
  for (int w = 0; w < N / kPerWord; ++w) {
    const Word16<T> word = reinterpret_cast<const Word16<T>*>(src)[w];
#pragma unroll
    for (int k = 0; k < kPerWord; ++k) dst[w * kPerWord + k] = load_float(&word.elems[k]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_vector(T* dst, const float (&src)[N]) {
  constexpr int kPerWord = 16 / static_cast<int>(sizeof(T));
  static_assert(N % kPerWord == 0, "a vector step is a whole number of 16-byte words");
#pragma unroll
  for (int w = 0; w < N / kPerWord; ++w) {
    Word16<T> word;
#pragma unroll
    for (int k = 0; k < kPerWord; ++k) store_float(&word.elems[k], src[w * kPerWord + k]);
    reinterpret_cast<Word16<T>*>(dst)[w] = word;
  }
}

// Elements [i, i + kVec) of a chunk whose pointers are 16-byte aligned; i is a multiple of kVec.
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
    const bool skip = table.found_inf != nullptr && *table.found_inf != 0.0f;
    block_skips = skip;
    if (!skip) {
      block_scalars = adam_scalars(table.hyper, *tensor.step);
      block_grad_scale = table.grad_scale != nullptr ? *table.grad_scale : 1.0f;
    }
  }
  __syncthreads();
  if (block_skips) return;  // AMP overflow: change nothing
  const AdamScalars s = block_scalars;
  const float grad_scale = block_grad_scale;

  constexpr int kVec = kVectorElements<P, G>;
  const ChunkPtrs<P, G> c = chunk_ptrs<P, G, kAmsgrad, kMaster>(tensor, work.begin);
  const int thread = static_cast<int>(threadIdx.x);
  int scalar_begin = 0;
  if (table.vector_aligned[work.slot]) {
    scalar_begin = work.numel - work.numel % kVec;
    for (int i = thread * kVec; i < scalar_begin; i += kThreads * kVec)
      update_vector<kVec, kAmsgrad, kMaster>(c, i, grad_scale, s);
  }
  for (int i = scalar_begin + thread; i < work.numel; i += kThreads)
    update_scalar<kAmsgrad, kMaster>(c, i, grad_scale, s);
}

bool vector_aligned(const AdamTensorPtrs& t, bool amsgrad, bool has_master) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return aligned(t.param) && aligned(t.grad) && aligned(t.exp_avg) && aligned(t.exp_avg_sq) &&
         (!amsgrad || aligned(t.max_exp_avg_sq)) && (!has_master || aligned(t.master));
}

// Fills `table` with the tensors from `next_tensor` on that fit in one launch, advances
// `next_tensor` past them and returns the launch's number of blocks: 0 when no tensor is left.
int64_t fill_chunk_table(const AdamLaunch& launch, int64_t& next_tensor, AdamChunkTable& table) {
  table.grad_scale = launch.grad_scale;
  table.found_inf = launch.found_inf;
  table.hyper = launch.hyper;
  table.num_tensors = 0;
  int64_t blocks = 0;
  for (; next_tensor < launch.num_tensors && table.num_tensors < kMaxTensors; ++next_tensor) {
    const AdamTensorPtrs& t = launch.tensors[next_tensor];
    if (t.numel == 0) continue;
    const int64_t tensor_blocks = (t.numel + kChunkElements - 1) / kChunkElements;
    if (tensor_blocks > kMaxBlocksPerLaunch)
      throw std::runtime_error("fusedoff: adam_step_cuda: tensor " + std::to_string(next_tensor) + " has " +
                               std::to_string(t.numel) + " elements, more than one launch can cover");
    if (blocks + tensor_blocks > kMaxBlocksPerLaunch) break;  // it opens the next launch
    const int slot = table.num_tensors++;
    table.tensors[slot] = t;
    table.first_block[slot] = static_cast<int32_t>(blocks);
    table.vector_aligned[slot] = vector_aligned(t, launch.amsgrad, launch.has_master);
    blocks += tensor_blocks;
  }
  return blocks;
}

template <typename P, typename G, bool kAmsgrad, bool kMaster>
void launch_adam_chunks(const AdamLaunch& launch) {
  const cudaStream_t stream = static_cast<cudaStream_t>(launch.stream);
  AdamChunkTable table{};
  int64_t next_tensor = 0;
  while (const int64_t blocks = fill_chunk_table(launch, next_tensor, table)) {
    adam_chunks_kernel<P, G, kAmsgrad, kMaster><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(table);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("fusedoff: adam_step_cuda: kernel launch failed: ") +
                               cudaGetErrorString(err));
  }
}

}  // namespace

void adam_step_cuda(const AdamLaunch& launch) {
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      if (launch.amsgrad && launch.has_master) {
        launch_adam_chunks<P, G, true, true>(launch);
      } else if (launch.amsgrad) {
        launch_adam_chunks<P, G, true, false>(launch);
      } else if (launch.has_master) {
        launch_adam_chunks<P, G, false, true>(launch);
      } else {
        launch_adam_chunks<P, G, false, false>(launch);
      }
    });
  });
}

}  // namespace fusedoff
