// Portability macros shared by the host (C++) and device (CUDA) kernels. ATen-free.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FUSEDOFF_HOST_DEVICE __host__ __device__
#define FUSEDOFF_INLINE __forceinline__
#else
#define FUSEDOFF_HOST_DEVICE
// Host kernels are compiled once per instruction set (function `target` attributes); the math
// helpers must be inlined into each of those callers to be vectorised with the caller's ISA.
#define FUSEDOFF_INLINE inline __attribute__((always_inline))
#endif
