// 16 fp32 lanes as a GCC vector type, for adam.h's update to run on unchanged: arithmetic on
// it is the float operation in each lane (one AVX-512 instruction in the AVX-512 variant; contraction
// into FMAs stays off, -ffp-contract=off), and LaneMath gives the square root.
#pragma once

#include <type_traits>

#include "fusedoff/adam.h"
#include "isa.h"
#include "state_codec_avx512.h"  // immintrin.h

#if defined(FUSEDOFF_AVX512_LANES)

namespace fusedoff {

using Float16Lanes = float __attribute__((vector_size(64)));
using Uint16Lanes = uint32_t __attribute__((vector_size(64)));  // 16 lanes of 32-bit bits (master.h's U)

template <>
struct LaneMath<Float16Lanes> {
  // Not always_inline: adam_update, which calls it, has no AVX-512 target of its own, and GCC
  // inlines it once adam_update is inlined into the AVX-512 variant (see FUSEDOFF_AVX512_LANES in
  // isa.h). (No max: amsgrad does not run on these lanes.)
  static FUSEDOFF_TARGET_AVX512 inline Float16Lanes sqrt(Float16Lanes x) {
    return reinterpret_cast<Float16Lanes>(_mm512_sqrt_ps(reinterpret_cast<__m512>(x)));
  }
};

FUSEDOFF_AVX512_INLINE Float16Lanes as_lanes(__m512 x) { return reinterpret_cast<Float16Lanes>(x); }
FUSEDOFF_AVX512_INLINE __m512 as_m512(Float16Lanes x) { return reinterpret_cast<__m512>(x); }
FUSEDOFF_AVX512_INLINE Uint16Lanes float_bits(Float16Lanes x) { return reinterpret_cast<Uint16Lanes>(x); }
FUSEDOFF_AVX512_INLINE Float16Lanes bits_float(Uint16Lanes x) { return reinterpret_cast<Float16Lanes>(x); }

// 16 consecutive uint16 (uint8) values, zero-extended into the lanes, and the lanes' low 16 (8) bits
// stored back.
FUSEDOFF_AVX512_INLINE Uint16Lanes load_u16_lanes(const uint16_t* data) {
  return reinterpret_cast<Uint16Lanes>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(data))));
}
FUSEDOFF_AVX512_INLINE Uint16Lanes load_u8_lanes(const uint8_t* data) {
  return reinterpret_cast<Uint16Lanes>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data))));
}
// 16 consecutive values of storage type T (float, or bf16: the upper half of an fp32) as fp32 lanes.
template <typename T>
FUSEDOFF_AVX512_INLINE Float16Lanes load_float_lanes(const T* data) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bfloat16_t>::value, "float or bf16 storage");
  if constexpr (std::is_same<T, float>::value) return as_lanes(_mm512_loadu_ps(data));
  return bits_float(load_u16_lanes(reinterpret_cast<const uint16_t*>(data)) << 16);
}
FUSEDOFF_AVX512_INLINE void store_u16_lanes(uint16_t* data, Uint16Lanes x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(data), _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(x)));
}
FUSEDOFF_AVX512_INLINE void store_u8_lanes(uint8_t* data, Uint16Lanes x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(data), _mm512_cvtepi32_epi8(reinterpret_cast<__m512i>(x)));
}

}  // namespace fusedoff

#endif  // FUSEDOFF_AVX512_LANES
