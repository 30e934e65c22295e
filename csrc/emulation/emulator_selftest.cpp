// Small kernels that hold the CUDA emulation to CUDA's rules (tests/test_cuda_emulation.py): each
// either computes what a GPU would, or breaks a rule that a GPU punishes and must be reported.
// Reached from Python as fusedoff._C_emulated.selftest(name), which returns the kernel's outputs
// and the launch's error message ("" when it succeeded). ATen-free.
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../cuda/launch.cuh"
#include "../cuda/multi_tensor.cuh"

namespace fusedoff {
namespace emulation_selftest {
namespace {

// Every thread writes its global linear index and its block's index, read back from shared memory
// after a barrier that thread 0's write precedes.
__global__ void indices_kernel(int* out) {
  __shared__ int block_id;
  const int threads = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
  const int t = static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
  const int b = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  if (t == 0) block_id = b;
  __syncthreads();
  out[2 * (b * threads + t)] = b * threads + t;
  out[2 * (b * threads + t) + 1] = block_id;
}

// Each warp's lanes exchange values: out = [xor-butterfly sum, down-tree sum (lane 0), up by 1, index 7].
__global__ void shuffle_kernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  int butterfly = lane;
  for (int m = 16; m > 0; m /= 2) butterfly += __shfl_xor_sync(0xffffffffu, butterfly, m);
  float tree = static_cast<float>(lane);
  for (int d = 16; d > 0; d /= 2) tree += __shfl_down_sync(0xffffffffu, tree, d);
  const double up = __shfl_up_sync(0xffffffffu, static_cast<double>(lane), 1);
  const int seven = __shfl_sync(0xffffffffu, lane * 10, 7);
  int* o = out + 4 * (32 * warp + lane);
  o[0] = butterfly;
  o[1] = static_cast<int>(tree);
  o[2] = static_cast<int>(up);
  o[3] = seven;
}

// Thread 5 returns early; the others wait at a barrier it never reaches.
__global__ void early_return_kernel(int* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

// Lanes 0-15 shuffle among themselves but lane 15 reads lane 16, outside the mask.
__global__ void shuffle_outside_mask_kernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (lane < 16) out[lane] = __shfl_down_sync(0x0000ffffu, lane, 1);
}

// Half a warp waits at a shuffle that names the whole warp, the other half at a barrier.
__global__ void divergent_shuffle_kernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (lane < 16) {
    out[lane] = __shfl_xor_sync(0xffffffffu, lane, 1);
  } else {
    __syncthreads();
  }
}

// A 16-byte vector load one float past an aligned address.
__global__ void misaligned_vector_kernel(const float* src, int* out) {
  float v[4];
  multi_tensor::load_vector(src + 1, v);
  out[threadIdx.x] = static_cast<int>(v[0]);
}

// A kernel parameter past the 4 KB limit.
struct Oversized {
  char bytes[4100];
};
__global__ void oversized_parameter_kernel(const __grid_constant__ Oversized table, int* out) { out[0] = table.bytes[0]; }

__global__ void noop_kernel(int* out) { out[0] = 0; }

struct Outcome {
  std::vector<int> out;
  std::string error;
};

template <typename Run>
Outcome run(std::size_t outputs, Run&& launch) {
  Outcome o{std::vector<int>(outputs, -1), ""};
  cudaGetLastError();
  launch(o.out.data());
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) o.error = cudaGetErrorString(err);
  return o;
}

const std::map<std::string, std::function<Outcome()>>& cases() {
  static const std::map<std::string, std::function<Outcome()>> table = {
      {"indices", [] {  // grid (3, 2, 1) of blocks (4, 2, 8): 64 threads, 2 warps each
         return run(2 * 6 * 64, [](int* out) {
           emulation::launch(indices_kernel, dim3(3, 2, 1), dim3(4, 2, 8), nullptr, out);
         });
       }},
      {"shuffles", [] {
         return run(4 * 64, [](int* out) { launch_kernel(shuffle_kernel, 1, 64, nullptr, out); });
       }},
      {"early_return", [] {
         return run(32, [](int* out) { launch_kernel(early_return_kernel, 1, 32, nullptr, out); });
       }},
      {"shuffle_outside_mask", [] {
         return run(32, [](int* out) { launch_kernel(shuffle_outside_mask_kernel, 1, 32, nullptr, out); });
       }},
      {"divergent_shuffle", [] {
         return run(32, [](int* out) { launch_kernel(divergent_shuffle_kernel, 1, 32, nullptr, out); });
       }},
      {"misaligned_vector", [] {
         alignas(16) static float src[8] = {1, 2, 3, 4, 5, 6, 7, 8};
         return run(32, [](int* out) { launch_kernel(misaligned_vector_kernel, 1, 32, nullptr, src, out); });
       }},
      {"oversized_parameter", [] {
         static Oversized table{};
         return run(1, [](int* out) { launch_kernel(oversized_parameter_kernel, 1, 32, nullptr, table, out); });
       }},
      {"block_too_large", [] {
         return run(1, [](int* out) { launch_kernel(noop_kernel, 1, 2048, nullptr, out); });
       }},
      {"block_too_many_threads", [] {  // every dimension within its limit, 2048 threads in all
         return run(1, [](int* out) { emulation::launch(noop_kernel, dim3(1), dim3(32, 32, 2), nullptr, out); });
       }},
      {"empty_grid", [] { return run(1, [](int* out) { launch_kernel(noop_kernel, 0, 32, nullptr, out); }); }},
  };
  return table;
}

}  // namespace

std::vector<std::string> selftest_names() {
  std::vector<std::string> names;
  for (const auto& entry : cases()) names.push_back(entry.first);
  return names;
}

std::pair<std::vector<int>, std::string> selftest(const std::string& name) {
  const auto it = cases().find(name);
  if (it == cases().end()) throw std::invalid_argument("no emulator self-test named " + name);
  Outcome o = it->second();
  return {std::move(o.out), std::move(o.error)};
}

}  // namespace emulation_selftest
}  // namespace fusedoff
