// A host emulation of the part of CUDA that fusedoff's device kernels use, so that csrc/cuda/*.cu
// compile as host C++ and run, bit for bit, on CPU tensors (the `emulated` tests; never in user
// builds). ATen-free. See [note: CUDA emulation] in emulator.cpp for the execution model.
//
// What it provides, and what it checks as a GPU or the driver would:
//  - `__global__`, `__device__`, `__host__`, `__forceinline__`, `__launch_bounds__`,
//    `__grid_constant__` as host no-ops; `__shared__` as one variable per block (kernel-local
//    statics, per OS thread: a block's threads are fibers of one OS thread).
//  - threadIdx, blockIdx, blockDim, gridDim, dim3, uint3; CUDA's integer min/max overloads.
//  - `__syncthreads()`: a barrier every live thread of the block must reach; a thread that returns
//    while others wait at one is reported (on a GPU: a hang or undefined behaviour).
//  - `__shfl_sync`, `__shfl_xor_sync`, `__shfl_down_sync`, `__shfl_up_sync` on 4- and 8-byte
//    values: an exchange among the lanes of one warp named in the mask, every one of which must
//    reach the same shuffle with the same mask; a source lane outside the mask is reported.
//  - Vector accesses (multi_tensor.cuh's load_vector/store_vector, 16 bytes; load_stored/
//    store_stored, 16 or 8) checked for alignment to their size: a misaligned one faults on a GPU.
//  - A launch checks its grid and block against the device limits and its parameters against the
//    4 KB kernel-parameter limit, and fails through cudaGetLastError as a launch would.
//  - cudaStream_t, cudaError_t, cudaGetLastError, cudaGetErrorString. Streams are one queue: a
//    launch runs to completion before it returns.
#pragma once

#if defined(__CUDACC__)
#error "csrc/emulation emulates CUDA on the host: compile the kernels with a host C++ compiler here"
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emulation_control.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static thread_local

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Set by the emulator for the thread (fiber) it is running.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

// CUDA's device min/max overloads (the kernels call min(int, int)).
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

typedef struct CUstream_st* cudaStream_t;

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
};

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
// For errors the emulator raised, the message says what happened and where (block, thread).
const char* cudaGetErrorString(cudaError_t error);

namespace fusedoff {
namespace emulation {

enum class ShuffleKind : int { Index, Xor, Down, Up };

// What the driver checks before a launch runs.
struct LaunchShape {
  dim3 grid;
  dim3 block;
  std::size_t param_bytes;  // the kernel's parameters, laid out with their alignment
};

// Runs `thread_body(context)` once for every thread of every block of the grid, blocks one after
// another; returns when the grid is done or an error is set (cudaGetLastError).
void run_grid(const LaunchShape& shape, void (*thread_body)(void*), void* context);

// The calling thread waits at its block's barrier (__syncthreads).
void sync_threads();

// The calling lane's part of a warp shuffle: `bits` is its value, the result the value of its
// source lane (or its own where the source is outside the width segment).
std::uint64_t warp_shuffle(ShuffleKind kind, unsigned int mask, std::uint64_t bits, int operand, int width);

// A vector access of `bytes` (16 or 8) at `address`: faults unless it is aligned to its size.
void check_vector_access(const void* address, int bytes);

template <typename T>
T shuffle(ShuffleKind kind, unsigned int mask, T value, int operand, int width) {
  static_assert(std::is_trivially_copyable_v<T> && (sizeof(T) == 4 || sizeof(T) == 8),
                "shuffles exchange 4- or 8-byte values");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_shuffle(kind, mask, bits, operand, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

template <typename... Params>
constexpr std::size_t param_bytes() {
  std::size_t offset = 0;
  ((offset = (offset + alignof(Params) - 1) / alignof(Params) * alignof(Params) + sizeof(Params)), ...);
  return offset;
}

// A kernel launch: the kernel and a copy of its arguments, run by every thread (each thread
// takes its own copy of the parameters, as it reads them from the parameter space).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t /*stream: one queue*/,
            Args&&... args) {
  struct Context {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> params;
  };
  Context context{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  const auto body = [](void* c) {
    Context& ctx = *static_cast<Context*>(c);
    std::apply(ctx.kernel, ctx.params);
  };
  run_grid(LaunchShape{grid, block, param_bytes<std::decay_t<Params>...>()}, body, &context);
}

}  // namespace emulation
}  // namespace fusedoff

inline void __syncthreads() { fusedoff::emulation::sync_threads(); }

template <typename T>
T __shfl_sync(unsigned int mask, T value, int src_lane, int width = warpSize) {
  return fusedoff::emulation::shuffle(fusedoff::emulation::ShuffleKind::Index, mask, value, src_lane, width);
}
template <typename T>
T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = warpSize) {
  return fusedoff::emulation::shuffle(fusedoff::emulation::ShuffleKind::Xor, mask, value, lane_mask, width);
}
template <typename T>
T __shfl_down_sync(unsigned int mask, T value, unsigned int delta, int width = warpSize) {
  return fusedoff::emulation::shuffle(fusedoff::emulation::ShuffleKind::Down, mask, value, static_cast<int>(delta),
                                      width);
}
template <typename T>
T __shfl_up_sync(unsigned int mask, T value, unsigned int delta, int width = warpSize) {
  return fusedoff::emulation::shuffle(fusedoff::emulation::ShuffleKind::Up, mask, value, static_cast<int>(delta),
                                      width);
}

// multi_tensor.cuh's hook on every vector access.
#define FUSEDOFF_CHECK_VECTOR_ACCESS(address, bytes) ::fusedoff::emulation::check_vector_access(address, bytes)
