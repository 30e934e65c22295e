// The multi-tensor launch machinery shared by the device kernels (adam_cuda.cu, apollo_cuda.cu).
// ATen-free; for .cu files only.
//
//  - Every tensor is cut into chunks of kChunkElements; one thread block of kThreads works on one
//    chunk.
//  - One launch serves up to a table's capacity of tensors. Their pointers and a block table travel
//    by value as the kernel argument (ChunkTable, kept under the 4 KB parameter limit by each user).
//    The table holds the first block of each tensor: block b works on the last tensor whose first
//    block is <= b (a binary search) and on chunk b - first_block of it. So the table grows with
//    the number of tensors, not of blocks: a tensor is never split across launches, and one launch
//    covers any tensor up to 2^31 - 1 chunks (3.5e13 elements). The host launches until every
//    tensor is done (fill_chunk_table).
//  - Indexing: a 64-bit base offset per block (chunk * kChunkElements), a 32-bit index inside it.
//  - 16-byte loads and stores with conversion to and from fp32 (load_vector, store_vector) from a
//    tensor's vector head on: the first element at which all its pointers are 16-byte aligned
//    (vector_head; 0 for tensors that start aligned, up to 7 for views and shards at an offset that
//    all pointers share). Each chunk starts with the same misalignment as its tensor
//    (kChunkElements * element size is a multiple of 16), so a block accesses elements
//    [0, head) one at a time, then 16-byte words, then the last (< kVectorElements) elements one at
//    a time. A tensor whose pointers differ in misalignment (head -1) is accessed one element at a
//    time throughout.
//  - A parameter and its master weight (master.h's MasterWeight, any MasterPrecision) are read and
//    written as stored (load_weights, store_weights): words of 16 bytes, or 8 for the 8 one-byte
//    low bits of a "split8" master, which the head aligns to 8 bytes only (master_access).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "fusedoff/dtypes.h"
#include "fusedoff/macros.h"
#include "fusedoff/master.h"

// A misaligned vector access (16 or 8 bytes) faults on a GPU; the host emulation (csrc/emulation)
// checks each one.
#if !defined(FUSEDOFF_CHECK_VECTOR_ACCESS)
#define FUSEDOFF_CHECK_VECTOR_ACCESS(address, bytes) ((void)0)
#endif

namespace fusedoff {
namespace multi_tensor {

// NOTE: 256 threads and 16K elements per block: 16 (fp32) or 8 (16-bit params or grads) vector
// steps per thread, enough blocks that a 16M-element tensor fills two waves of an H100/H200, and a
// per-block prologue (a search over the table and two double pows) that is a few percent of the
// block's memory time. A choice by reasoning, not by timing (see 'GPU launch shapes' in
// benchmarks/results/RESULTS.md).
constexpr int kThreads = 256;
constexpr int kChunkElements = 16384;
constexpr int64_t kMaxBlocksPerLaunch = 2147483647;  // gridDim.x limit
static_assert(kThreads % 32 == 0, "blocks are whole warps");

// The blocks (chunks) that cover `numel` elements: 0 for an empty tensor.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE int64_t chunks_of(int64_t numel) {
  return (numel + kChunkElements - 1) / kChunkElements;
}

// The kernel argument of one launch: the tensors, what every block shares, and the first block of
// each tensor. TensorPtrs must have an int64_t `numel`.
template <typename TensorPtrs, typename LaunchArgs, int kMaxTensors>
struct ChunkTable {
  static constexpr int kCapacity = kMaxTensors;
  TensorPtrs tensors[kMaxTensors];
  LaunchArgs args;
  int32_t first_block[kMaxTensors];  // strictly increasing: empty tensors are left out
  int32_t num_tensors;
  int8_t vector_head[kMaxTensors];  // vector_head() of the tensor's pointers that the kernel uses
};

// What one block works on: elements [begin, begin + numel) of tensor `slot` of the table.
struct BlockWork {
  int slot;
  int64_t begin;
  int numel;
};

template <typename Table>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE BlockWork block_work(const Table& table, int block) {
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

// One array a kernel reads or writes: its pointer, element size and the alignment of its vector
// accesses (16 bytes, or 8 for the 8-byte words of a "split8" master), or element_bytes 0 if the
// kernel does not touch it (its pointer is then ignored).
struct Access {
  const void* ptr;
  int element_bytes;
  int alignment = 16;
};

// The first element index at which every accessed pointer is aligned for its vector accesses, or -1
// if there is none (their misalignments differ). Element-aligned pointers meet such a boundary every
// alignment / element_bytes elements, so a head exists below 16 if at all: 0 for aligned tensors,
// and at most 7 (16-bit arrays, and the one-byte "split8" master beside a bf16 parameter: both
// need the head to be -offset mod 8 for a view at an element offset) otherwise. So a bf16
// parameter's head is the same with every master precision.
template <int kCount>
int vector_head(const Access (&accesses)[kCount]) {
  for (int head = 0; head < 16; ++head) {
    bool aligned = true;
    for (const Access& a : accesses) {
      const uintptr_t address = reinterpret_cast<uintptr_t>(a.ptr) + static_cast<uintptr_t>(head * a.element_bytes);
      aligned = aligned && (a.element_bytes == 0 || address % static_cast<uintptr_t>(a.alignment) == 0);
    }
    if (aligned) return head;
  }
  return -1;
}

// Fills `table` (all but `table.args`) with the tensors from `next_tensor` on that fit in one
// launch, advances `next_tensor` past them and returns the launch's number of blocks: 0 when no
// tensor is left. `head_of(tensor)` is the tensor's vector_head.
template <typename Table, typename TensorPtrs, typename HeadOf>
int64_t fill_chunk_table(const TensorPtrs* tensors, int64_t num_tensors, int64_t& next_tensor, Table& table,
                         HeadOf&& head_of, const char* op_name) {
  table.num_tensors = 0;
  int64_t blocks = 0;
  for (; next_tensor < num_tensors && table.num_tensors < Table::kCapacity; ++next_tensor) {
    const TensorPtrs& t = tensors[next_tensor];
    if (t.numel == 0) continue;
    const int64_t tensor_blocks = chunks_of(t.numel);
    if (tensor_blocks > kMaxBlocksPerLaunch)
      throw std::runtime_error(std::string("fusedoff: ") + op_name + ": tensor " + std::to_string(next_tensor) +
                               " has " + std::to_string(t.numel) + " elements, more than one launch can cover");
    if (blocks + tensor_blocks > kMaxBlocksPerLaunch) break;  // it opens the next launch
    const int slot = table.num_tensors++;
    table.tensors[slot] = t;
    table.first_block[slot] = static_cast<int32_t>(blocks);
    table.vector_head[slot] = static_cast<int8_t>(head_of(t));
    blocks += tensor_blocks;
  }
  return blocks;
}

// A block's elements in three runs: [0, vector_begin) and [vector_end, numel) one at a time,
// [vector_begin, vector_end) in steps of kVec elements at 16-byte aligned addresses.
struct BlockRuns {
  int vector_begin;
  int vector_end;
};

template <int kVec>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE BlockRuns block_runs(int head, int numel) {
  if (head < 0) return {0, 0};  // misalignments differ: every element one at a time
  const int begin = head < numel ? head : numel;
  return {begin, begin + (numel - begin) / kVec * kVec};
}

// Throws if the last kernel launch on this thread failed (bad configuration, too many resources).
inline void check_launch(const char* op_name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fusedoff: ") + op_name + ": kernel launch failed: " +
                             cudaGetErrorString(err));
}

// Elements per thread and vector step: 16 bytes of the narrowest stored type (the state is fp32).
template <typename P, typename G>
constexpr int kVectorElements = 16 / static_cast<int>(sizeof(P) < sizeof(G) ? sizeof(P) : sizeof(G));

// 16 bytes of storage elements: one 128-bit load or store.
template <typename T>
struct alignas(16) Word16 {
  T elems[16 / sizeof(T)];
};

template <int N, typename T>
__device__ __forceinline__ void load_vector(const T* src, float (&dst)[N]) {
  constexpr int kPerWord = 16 / static_cast<int>(sizeof(T));
  static_assert(N % kPerWord == 0, "a vector step is a whole number of 16-byte words");
  FUSEDOFF_CHECK_VECTOR_ACCESS(src, 16);
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
  FUSEDOFF_CHECK_VECTOR_ACCESS(dst, 16);
#pragma unroll
  for (int w = 0; w < N / kPerWord; ++w) {
    Word16<T> word;
#pragma unroll
    for (int k = 0; k < kPerWord; ++k) store_float(&word.elems[k], src[w * kPerWord + k]);
    reinterpret_cast<Word16<T>*>(dst)[w] = word;
  }
}

// N elements at `src`: one scalar access for N == 1 (any alignment), 16-byte words otherwise.
template <int N, typename T>
__device__ __forceinline__ void load_elements(const T* src, float (&dst)[N]) {
  if constexpr (N == 1) {
    dst[0] = load_float(src);
  } else {
    load_vector(src, dst);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_elements(T* dst, const float (&src)[N]) {
  if constexpr (N == 1) {
    store_float(dst, src[0]);
  } else {
    store_vector(dst, src);
  }
}

// ---- elements as stored (no conversion) ----------------------------------------------------------

// The access width for N elements of T: N * sizeof(T) bytes up to 16, whole 16-byte words above.
template <int N, typename T>
constexpr int kWordBytes = N * static_cast<int>(sizeof(T)) < 16 ? N * static_cast<int>(sizeof(T)) : 16;

template <typename T, int kBytes>
struct alignas(kBytes) StoredWord {
  T elems[kBytes / sizeof(T)];
};

// N elements at `src` as stored: one scalar access for N == 1 (any alignment), else words of
// kWordBytes<N, T> aligned to their size.
template <int N, typename T>
__device__ __forceinline__ void load_stored(const T* src, T (&dst)[N]) {
  if constexpr (N == 1) {
    dst[0] = *src;
  } else {
    constexpr int kBytes = kWordBytes<N, T>;
    constexpr int kPerWord = kBytes / static_cast<int>(sizeof(T));
    static_assert(N % kPerWord == 0 && (kBytes & (kBytes - 1)) == 0, "whole words of a power-of-two size");
    FUSEDOFF_CHECK_VECTOR_ACCESS(src, kBytes);
#pragma unroll
    for (int w = 0; w < N / kPerWord; ++w) {
      const StoredWord<T, kBytes> word = reinterpret_cast<const StoredWord<T, kBytes>*>(src)[w];
#pragma unroll
      for (int k = 0; k < kPerWord; ++k) dst[w * kPerWord + k] = word.elems[k];
    }
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_stored(T* dst, const T (&src)[N]) {
  if constexpr (N == 1) {
    *dst = src[0];
  } else {
    constexpr int kBytes = kWordBytes<N, T>;
    constexpr int kPerWord = kBytes / static_cast<int>(sizeof(T));
    static_assert(N % kPerWord == 0 && (kBytes & (kBytes - 1)) == 0, "whole words of a power-of-two size");
    FUSEDOFF_CHECK_VECTOR_ACCESS(dst, kBytes);
#pragma unroll
    for (int w = 0; w < N / kPerWord; ++w) {
      StoredWord<T, kBytes> word;
#pragma unroll
      for (int k = 0; k < kPerWord; ++k) word.elems[k] = src[w * kPerWord + k];
      reinterpret_cast<StoredWord<T, kBytes>*>(dst)[w] = word;
    }
  }
}

// ---- a parameter and its master weight ----------------------------------------------------------

// The Access (for vector_head) of a master weight stored as M in vector steps of kVec elements;
// none without a master, or where the kernel does not touch it (`used` false).
template <MasterPrecision M, int kVec>
Access master_access(const void* master, bool used = true) {
  using S = master_storage_t<M>;
  if (M == MasterPrecision::None || !used) return {master, 0};
  return {master, static_cast<int>(sizeof(S)), kWordBytes<kVec, S>};
}

// Elements [i, i + N) of parameter `param` and master `master` (both at the chunk's base): the fp32
// values the update starts from (MasterWeight::load over the loaded words). N > 1 needs every
// pointer + i aligned (i at or after the vector head).
template <int N, MasterPrecision M, typename P>
__device__ __forceinline__ void load_weights(const void* master, const P* param, int i, float (&p)[N]) {
  using S = master_storage_t<M>;
  P param_elems[N];
  S master_elems[N];
  load_stored(param + i, param_elems);  // split: the high half; fp32: the check for a written parameter
  if constexpr (M != MasterPrecision::None) load_stored(static_cast<const S*>(master) + i, master_elems);
#pragma unroll
  for (int k = 0; k < N; ++k) p[k] = MasterWeight<M, P>::load(master_elems, param_elems, k);
}

// Writes the updated fp32 values of elements [i, i + N) to the parameter and its master
// (MasterWeight::store; `salt` is split8_salt of the tensor's step).
template <int N, MasterPrecision M, typename P>
__device__ __forceinline__ void store_weights(void* master, P* param, int i, const float (&p)[N], uint32_t salt) {
  using S = master_storage_t<M>;
  P param_elems[N];
  S master_elems[N];
#pragma unroll
  for (int k = 0; k < N; ++k) MasterWeight<M, P>::store(master_elems, param_elems, k, p[k], salt);
  store_stored(param + i, param_elems);
  if constexpr (M != MasterPrecision::None) store_stored(static_cast<S*>(master) + i, master_elems);
}

}  // namespace multi_tensor
}  // namespace fusedoff
