// Entry points of the backend launchers. ATen-free: ops.cpp fills a plain AdamLaunch and calls one.
#pragma once

#include "fusedoff/adam.h"

namespace fusedoff {

// Host kernel: OpenMP across `launch.num_threads` threads, SIMD chosen at run time (cpu/isa.h).
void adam_step_cpu(const AdamLaunch& launch);

// The instruction set the host kernels dispatch to on this CPU ("avx512", "avx2", "baseline").
const char* cpu_isa_name();

#if defined(FUSEDOFF_WITH_CUDA)
// Device kernel: multi-tensor launches on `launch.stream`; pointers are device pointers.
void adam_step_cuda(const AdamLaunch& launch);
#endif

}  // namespace fusedoff
