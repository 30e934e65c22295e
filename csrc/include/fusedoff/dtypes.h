// Storage types and their conversion to and from fp32, for host and device. ATen-free.
//
// All math is done in fp32; tensors are stored as fp32, fp16 or bf16. `load_float` upcasts in
// registers and `store_float` rounds to nearest even, so no fp32 copy of a low-precision tensor is
// ever materialised. The 16-bit types are bit-compatible with at::Half / at::BFloat16 (and
// __half / __nv_bfloat16), so ops.cpp reinterprets data pointers without copying.
#pragma once

#include <cstdint>
#include <cstring>

#include "fusedoff/macros.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace fusedoff {

struct half_t {
  uint16_t bits;
};
struct bfloat16_t {
  uint16_t bits;
};

enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2 };

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// ---- fp16 <-> fp32 -------------------------------------------------------------------------
// Host versions are branch-light integer code so that `#pragma omp simd` loops vectorise on any
// x86-64/aarch64 CPU without F16C; they are exact (normals, subnormals, inf, NaN) and round to
// nearest even like the hardware conversions.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float half_bits_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp_mant = h & 0x7fffu;
  // Shifting puts the 5-bit exponent and 10-bit mantissa in float position; scaling by 2^112
  // rebiases the exponent (15 -> 127) and also turns fp16 subnormals into exact fp32 normals.
  float magnitude = bits_to_float(exp_mant << 13) * 5.192296858534828e+33f;  // 2^112
  if (exp_mant >= 0x7c00u) magnitude = bits_to_float((exp_mant << 13) | 0x7f800000u);  // inf/NaN
  return bits_to_float(float_to_bits(magnitude) | sign);
#endif
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint16_t float_to_half_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(value));
#else
  uint32_t f = float_to_bits(value);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint32_t out;
  if (f >= (143u << 23)) {  // >= 65536: overflow to inf, or NaN (quiet)
    out = (f > 0x7f800000u) ? 0x7e00u : 0x7c00u;
  } else if (f < (113u << 23)) {  // result is subnormal or zero: let an fp32 add do the RNE
    const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    out = float_to_bits(bits_to_float(f) + bits_to_float(denorm_magic)) - denorm_magic;
  } else {  // normal: rebias the exponent and round the 13 dropped bits to nearest even
    const uint32_t mant_odd = (f >> 13) & 1u;
    f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
    f += mant_odd;
    out = f >> 13;
  }
  return static_cast<uint16_t>(out | (sign >> 16));
#endif
}

// ---- bf16 <-> fp32 -------------------------------------------------------------------------
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float bf16_bits_to_float(uint16_t b) {
  return bits_to_float(static_cast<uint32_t>(b) << 16);
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint16_t float_to_bf16_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
#else
  const uint32_t u = float_to_bits(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
#endif
}

// ---- typed load/store ----------------------------------------------------------------------
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float load_float(const float* p) { return *p; }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float load_float(const half_t* p) { return half_bits_to_float(p->bits); }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float load_float(const bfloat16_t* p) { return bf16_bits_to_float(p->bits); }

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void store_float(float* p, float v) { *p = v; }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void store_float(half_t* p, float v) { p->bits = float_to_half_bits(v); }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void store_float(bfloat16_t* p, float v) { p->bits = float_to_bf16_bits(v); }

// Calls `fn(T{})` with T the storage type for `dtype`: the one place a run-time dtype becomes a
// template parameter, for both the host and the device launchers.
template <typename Fn>
inline void dispatch_storage_type(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::Float32: fn(float{}); break;
    case DType::Float16: fn(half_t{}); break;
    case DType::BFloat16: fn(bfloat16_t{}); break;
  }
}

}  // namespace fusedoff
