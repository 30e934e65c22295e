// Entry points of the backend launchers. ATen-free: ops.cpp fills a plain AdamLaunch and calls one.
#pragma once

#include "fusedoff/adam.h"
#include "fusedoff/apollo.h"

namespace fusedoff {

// Host kernel: OpenMP across `launch.num_threads` threads, SIMD chosen at run time (cpu/isa.h).
void adam_step_cpu(const AdamLaunch& launch);
// Host Adam with compressed moments (state_codec.h).
void adam_compressed_step_cpu(const CompressedAdamLaunch& launch);

// Host Apollo kernel, one phase of the step (see apollo.h).
void apollo_step_cpu(const ApolloLaunch& launch);

// The 8-bit codec (state_codec.h) on a whole flat tensor, for checkpoints: `absmax` has one scale per
// block of kQuantBlock elements counted from the first.
void encode_8bit_cpu(const float* values, int64_t numel, bool is_signed, uint8_t* codes, float* absmax,
                     int num_threads);
void decode_8bit_cpu(const uint8_t* codes, const float* absmax, int64_t numel, bool is_signed, float* values,
                     int num_threads);

// The instruction set the host kernels dispatch to on this CPU ("avx512", "avx2", "baseline").
const char* cpu_isa_name();

#if defined(FUSEDOFF_WITH_CUDA)
// Device kernel: multi-tensor launches on `launch.stream`; pointers are device pointers.
void adam_step_cuda(const AdamLaunch& launch);
void adam_compressed_step_cuda(const CompressedAdamLaunch& launch);
void apollo_step_cuda(const ApolloLaunch& launch);
// The device memory apollo_step_cuda needs in `launch.workspace` (per-block partial sums of the
// 'reduce' and 'moments' phases; 0 for the others), for the caller to take from its allocator.
int64_t apollo_cuda_workspace_bytes(const ApolloLaunch& launch);
#endif

}  // namespace fusedoff
