// A master weight as the host kernels' vector loops see it: MasterLanes for the loops GCC vectorises,
// MasterVectors for the AVX-512 forms written on 16-lane vectors (below).
//
// NOTE: a split8 master's bytes read and written inside a `#pragma omp simd` loop made GCC vectorise
// the whole loop at 16 lanes of 128-bit vectors (the fp32 math in xmm registers, the widest type
// following the narrowest), slower than the split (uint16) loop, which runs in 256-bit vectors.
// So the loops hold a split8 master's bytes widened to 16 bits in a buffer of the chunk they run
// over, filled before and written back after the loop (plain loops that vectorise alone); every
// other master is read and written in place (see 'CPU kernel tuning' in benchmarks/results/RESULTS.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fusedoff/master.h"
#include "float_lanes.h"

namespace fusedoff {

template <MasterPrecision M, int64_t kMaxElements>
class MasterLanes {
 public:
  using Lane = uint16_t;  // a split8 byte's type inside the loop
  // Elements [begin, end) (at most kMaxElements) of the master at `master`.
  FUSEDOFF_INLINE MasterLanes(void* master, int64_t begin, int64_t end) : master_(master), begin_(begin), n_(end - begin) {
    if constexpr (M == MasterPrecision::Split8) {
      const uint8_t* __restrict__ bytes = static_cast<const uint8_t*>(master) + begin;
      for (int64_t i = 0; i < n_; ++i) wide_[i] = bytes[i];
    }
  }
  // Where the loop reads and writes element begin + i, at index i (MasterWeight<M, P, Lane>).
  FUSEDOFF_INLINE void* lanes() {
    if constexpr (M == MasterPrecision::Split8) return wide_;
    return master_at<M>(master_, begin_);
  }
  // Writes the loop's results back (split8: the bytes; the others were written in place).
  FUSEDOFF_INLINE void write_back() {
    if constexpr (M == MasterPrecision::Split8) {
      uint8_t* __restrict__ bytes = static_cast<uint8_t*>(master_) + begin_;
      for (int64_t i = 0; i < n_; ++i) bytes[i] = static_cast<uint8_t>(wide_[i]);
    }
  }

 private:
  void* master_;
  int64_t begin_;
  int64_t n_;
  alignas(64) Lane wide_[M == MasterPrecision::Split8 ? kMaxElements : 1];  // aligned: no scalar peel before the loop
};

#if defined(FUSEDOFF_AVX512_LANES)
// The masters of 16 bf16 parameters at once, in the AVX-512 variants: master.h's functions on
// Uint16Lanes (the same source as every backend's scalar form). `kOn<P, M>`: whether it applies.
template <typename P, MasterPrecision M>
struct MasterVectors {
  static constexpr bool kOn = std::is_same<P, bfloat16_t>::value && M != MasterPrecision::None;

  // The masters of elements i..i+15 (fp32: or their parameters where written, see [note: every write
  // is seen] in master.h).
  static FUSEDOFF_AVX512_INLINE Float16Lanes load(const void* master, const uint16_t* param_bits, int64_t i) {
    const Uint16Lanes params = load_u16_lanes(param_bits + i);
    if constexpr (M == MasterPrecision::Float32) {
      const Uint16Lanes stored = float_bits(as_lanes(_mm512_loadu_ps(static_cast<const float*>(master) + i)));
      return bits_float(master_or_bf16_param_lanes(stored, params));
    }
    if constexpr (M == MasterPrecision::Split16) {
      return bits_float(join_master_lanes(params, load_u16_lanes(static_cast<const uint16_t*>(master) + i)));
    }
    return bits_float(join_master_lanes(params, load_u8_lanes(static_cast<const uint8_t*>(master) + i) << 8));
  }

  // Writes masters `value` of elements i..i+15 and their parameters.
  static FUSEDOFF_AVX512_INLINE void store(void* master, uint16_t* param_bits, int64_t i, Float16Lanes value,
                                           uint32_t salt) {
    Uint16Lanes bits = float_bits(value);
    if constexpr (M == MasterPrecision::Split8) bits = round_master_split8_lanes(bits, salt);
    store_u16_lanes(param_bits + i, master_to_bf16_lanes(bits));
    if constexpr (M == MasterPrecision::Float32) _mm512_storeu_ps(static_cast<float*>(master) + i, as_m512(value));
    if constexpr (M == MasterPrecision::Split16) store_u16_lanes(static_cast<uint16_t*>(master) + i, bits);
    if constexpr (M == MasterPrecision::Split8) store_u8_lanes(static_cast<uint8_t*>(master) + i, bits >> 8);
  }
};
#endif  // FUSEDOFF_AVX512_LANES

}  // namespace fusedoff
