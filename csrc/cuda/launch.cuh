// The one place a device kernel is launched. ATen-free; for .cu files only.
//
// `launch_kernel(kernel, blocks, threads, stream, args...)` stands for
// `kernel<<<blocks, threads, 0, stream>>>(args...)`, so the same kernel sources compile under nvcc
// and, as host C++, under the CUDA emulation of csrc/emulation (the `emulated` tests), which runs
// every thread of every block on the host. Callers check the launch with check_launch
// (multi_tensor.cuh) as after a real launch.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace fusedoff {

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), unsigned int blocks, unsigned int threads, cudaStream_t stream,
                   Args&&... args) {
#if defined(FUSEDOFF_CUDA_EMULATION)
  emulation::launch(kernel, dim3(blocks), dim3(threads), stream, std::forward<Args>(args)...);
#else
  kernel<<<blocks, threads, 0, stream>>>(std::forward<Args>(args)...);
#endif
}

}  // namespace fusedoff
