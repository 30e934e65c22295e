// Times the host AdamW kernels without torch, and prints a hash of every output byte: a quick loop
// for tuning a kernel (same hash = same bits) before benchmarks/bench_state_precision.py measures
// it properly. Build and run from the repository root:
//
//   g++ -O3 -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=off -Wno-psabi -std=c++17 -fwrapv
//       -Icsrc/include -Icsrc/cpu tools/host_kernel_timing.cpp csrc/cpu/adam_compressed_cpu.cpp
//       csrc/cpu/adam_cpu.cpp csrc/cpu/isa.cpp -o /tmp/host_kernel_timing      (one line)
//   /tmp/host_kernel_timing MODE NUMEL THREADS REPEATS
//
// MODE: fp32 | bf16 | 8bit (states, fp32 params) or fp32master | split | split8 | 8bit_split8 (bf16
// params with that master, fp32 states unless 8bit; fp32master keeps its master in the fp32 array).
// Prints the best time after two warm-up calls, in ns per parameter and core. NONFINITE=1 puts a
// NaN, an inf and a -inf into the gradient.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "fusedoff/launchers.h"

using namespace fusedoff;

namespace {
uint64_t fnv1a(const void* data, size_t bytes, uint64_t hash) {
  const uint8_t* b = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ b[i]) * 1099511628211ull;
  return hash;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MODE NUMEL THREADS REPEATS\n", argv[0]);
    return 2;
  }
  const char* mode = argv[1];
  const int64_t n = std::atoll(argv[2]);
  const int threads = std::atoi(argv[3]);
  const int repeats = std::atoi(argv[4]);
  const bool fp32_master = std::strcmp(mode, "fp32master") == 0;
  const bool bf16_params = std::strstr(mode, "split") != nullptr || fp32_master;
  const bool block8 = std::strncmp(mode, "8bit", 4) == 0;
  const bool bf16_states = std::strcmp(mode, "bf16") == 0;
  const MasterPrecision master = fp32_master                          ? MasterPrecision::Float32
                                 : !bf16_params                       ? MasterPrecision::None
                                 : std::strstr(mode, "split8") != nullptr ? MasterPrecision::Split8
                                                                          : MasterPrecision::Split16;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> param(n), grad(n), m32(n, 0.0f), v32(n, 0.0f);
  std::vector<bfloat16_t> param16(n), grad16(n);
  std::vector<uint8_t> m8(n, 0), v8(n, 0), low8(n, 0);
  std::vector<uint16_t> low16(n, 0), m16(n, 0), v16(n, 0);
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  std::vector<float> m_scale(blocks, 0.0f), v_scale(blocks, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    param[i] = normal(rng);
    grad[i] = normal(rng) * 1e-2f;
    param16[i].bits = float_to_bf16_bits(param[i]);
    grad16[i].bits = float_to_bf16_bits(grad[i]);
  }
  if (std::getenv("NONFINITE") != nullptr && n > 1000) {
    grad[5] = __builtin_nanf("");
    grad[300] = __builtin_inff();
    grad[1000] = -__builtin_inff();
    grad16[5].bits = 0x7fc0;
    grad16[300].bits = 0x7f80;
    grad16[1000].bits = 0xff80;
  }
  void* master_ptr = master == MasterPrecision::Float32   ? static_cast<void*>(param.data())
                     : master == MasterPrecision::Split8  ? static_cast<void*>(low8.data())
                     : master == MasterPrecision::Split16 ? static_cast<void*>(low16.data())
                                                          : nullptr;
  void* param_ptr = bf16_params ? static_cast<void*>(param16.data()) : static_cast<void*>(param.data());
  const void* grad_ptr = bf16_params ? static_cast<const void*>(grad16.data()) : static_cast<const void*>(grad.data());
  const DType dtype = bf16_params ? DType::BFloat16 : DType::Float32;
  const AdamHyperparams hyper{1e-3, 0.9, 0.999, 1e-8, 0.01, true, false};
  float step = 0.0f;
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    step += 1.0f;
    const auto start = std::chrono::steady_clock::now();
    if (block8 || bf16_states) {
      const CompressedAdamTensorPtrs t{param_ptr, grad_ptr,
                                       block8 ? static_cast<void*>(m8.data()) : static_cast<void*>(m16.data()),
                                       block8 ? static_cast<void*>(v8.data()) : static_cast<void*>(v16.data()),
                                       m_scale.data(), v_scale.data(), master_ptr, &step, n, 0, 1234u};
      adam_compressed_step_cpu({&t, 1, dtype, dtype, block8 ? StatePrecision::Block8 : StatePrecision::BFloat16, master,
                                hyper, nullptr, nullptr, threads, nullptr});
    } else {
      const AdamTensorPtrs t{param_ptr, grad_ptr, m32.data(), v32.data(), nullptr, master_ptr, &step, n};
      adam_step_cpu({&t, 1, dtype, dtype, false, master, hyper, nullptr, nullptr, threads, nullptr});
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r >= 2 && seconds < best) best = seconds;
  }
  uint64_t hash = 1469598103934665603ull;
  hash = fnv1a(param.data(), n * 4, hash);
  hash = fnv1a(param16.data(), n * 2, hash);
  hash = fnv1a(m8.data(), n, hash);
  hash = fnv1a(v8.data(), n, hash);
  hash = fnv1a(low8.data(), n, hash);
  hash = fnv1a(low16.data(), n * 2, hash);
  hash = fnv1a(m_scale.data(), blocks * 4, hash);
  hash = fnv1a(v_scale.data(), blocks * 4, hash);
  hash = fnv1a(m32.data(), n * 4, hash);
  hash = fnv1a(v32.data(), n * 4, hash);
  hash = fnv1a(m16.data(), n * 2, hash);
  hash = fnv1a(v16.data(), n * 2, hash);
  std::printf("%-12s n=%lld threads=%d best %.3f ms = %.3f ns per param and core  hash %016llx\n", mode,
              static_cast<long long>(n), threads, best * 1e3, best * 1e9 / n * threads,
              static_cast<unsigned long long>(hash));
  return 0;
}
