// A master weight as the host kernels' vector loops see it.
//
// NOTE: a split8 master's bytes read and written inside a `#pragma omp simd` loop made GCC vectorise
// the whole loop at 16 lanes of 128-bit vectors (the fp32 math in xmm registers, the widest type
// following the narrowest), 2.4x slower than the split (uint16) loop, which runs in 256-bit vectors,
// on this repository's AVX-512 machine. So the loops hold a split8 master's bytes widened to 16 bits
// in a buffer of the chunk they run over, filled before and written back after the loop (plain loops
// that vectorise alone); every other master is read and written in place.
#pragma once

#include <algorithm>
#include <cstdint>

#include "fusedoff/master.h"

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

}  // namespace fusedoff
