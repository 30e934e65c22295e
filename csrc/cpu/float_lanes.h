// 16 fp32 lanes as a GCC vector type, for adam.h's update to run on unchanged: arithmetic on
// it is the float operation in each lane (one AVX-512 instruction in the AVX-512 variant; contraction
// into FMAs stays off, -ffp-contract=off), and LaneMath gives the square root.
#pragma once

#include "fusedoff/adam.h"
#include "isa.h"
#include "state_codec_avx512.h"  // immintrin.h

#if defined(FUSEDOFF_AVX512_LANES)

namespace fusedoff {

using Float16Lanes = float __attribute__((vector_size(64)));

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

}  // namespace fusedoff

#endif  // FUSEDOFF_AVX512_LANES
