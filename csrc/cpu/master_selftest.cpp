// The proofs behind [note: split master weights] (master.h), run over every fp32 bit pattern: the
// split master gives back every master, and the split8 one its stochastic rounding, bit for bit; and
// the host kernels' 16-lane form of them (MasterVectors, master_lanes.h) gives the scalar form's bits;
// and an fp32 master is kept beside exactly its nearest roundings ([note: every write is seen]).
#include <omp.h>

#include <cstdint>
#include <memory>

#include "fusedoff/master.h"
#include "isa.h"
#include "master_lanes.h"
#include "selftests.h"

namespace fusedoff {

selftests::SplitMaster selftests::split_master(uint32_t split8_salt_value, int num_threads) {
  int64_t split_failures = 0, split8_failures = 0, split8_outside_bound = 0, roundings_off = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    reduction(+ : split_failures, split8_failures, split8_outside_bound, roundings_off)
  for (int64_t high = 0; high < 65536; ++high) {
    for (uint32_t low = 0; low < 65536; ++low) {
      const uint32_t u = (static_cast<uint32_t>(high) << 16) | low;
      const float master = bits_to_float(u);
      const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
      // "split": the parameter and the low half give the master back (a NaN quieted, as arithmetic makes it).
      const uint16_t param = master_to_bf16_bits(master);
      const uint32_t joined = float_to_bits(join_master(param, static_cast<uint16_t>(u)));
      split_failures += joined != (nan ? (u | 0x00400000u) : u);
      // The parameter is the rounding to nearest of the master, ties away from zero: within half a
      // bf16 step of it (in bit-pattern distance, which orders same-sign floats), above it at a tie.
      if (!nan) {
        const int64_t distance = static_cast<int64_t>(u & 0x7fffffffu) - (static_cast<int64_t>(param & 0x7fffu) << 16);
        roundings_off += (distance < -0x8000 || distance >= 0x8000) || ((param ^ (u >> 16)) & 0x8000u) != 0;
      }

      // "split8": the stochastic rounding comes back from the parameter and 8 bits, within 256 units.
      const float rounded = round_master_split8(master, split8_salt_value);
      const uint32_t r = float_to_bits(rounded);
      const uint16_t param8 = master_to_bf16_bits(rounded);
      const uint32_t joined8 = float_to_bits(join_master(param8, static_cast<uint16_t>(r & 0xff00u)));
      // ... and it is the note's rounding, written plainly: up by the random byte, but down where a
      // finite master would reach the exponent of inf (master.h computes it without a select of selects).
      const uint32_t up = (u + (mix32(u ^ split8_salt_value) & 0xffu)) & 0xffffff00u;
      const bool overflowed = (u & 0x7f800000u) != 0x7f800000u && (up & 0x7f800000u) == 0x7f800000u;
      const uint32_t stated = nan ? (u | 0x00400000u) & 0xffffff00u : overflowed ? u & 0xffffff00u : up;
      split8_failures += joined8 != r || (r & 0xffu) != 0 || r != stated;
      if (nan) {
        split8_outside_bound += (r & 0x7fffffffu) <= 0x7f800000u;
      } else {
        const int64_t moved = static_cast<int64_t>(r & 0x7fffffffu) - static_cast<int64_t>(u & 0x7fffffffu);
        const bool finite = (u & 0x7f800000u) != 0x7f800000u;
        split8_outside_bound += moved <= -256 || moved >= 256 || ((r ^ u) & 0x80000000u) != 0 ||
                                (finite && (r & 0x7f800000u) == 0x7f800000u);
      }
    }
  }
  return {split_failures, split8_failures, split8_outside_bound, roundings_off};
}

int64_t selftests::written_param(int num_threads) {
  int64_t off = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(+ : off)
  for (int64_t high = 0; high < 65536; ++high) {
    for (uint32_t low = 0; low < 65536; ++low) {
      const uint32_t u = (static_cast<uint32_t>(high) << 16) | low;
      const float master = bits_to_float(u);
      const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
      // Beside a bf16 parameter within half a bf16 step of it in bit-pattern distance, of its sign
      // (either nearest rounding at a tie: torch's cast and fusedoff's), the master is kept; beside
      // any other (the next values either side; for a NaN master, any but its quieted upper half)
      // the parameter is taken.
      for (uint32_t k = 0; k < 4; ++k) {
        const uint16_t candidate = static_cast<uint16_t>((u >> 16) + k - 1u);
        const int64_t apart = static_cast<int64_t>(u & 0x7fffffffu) - (static_cast<int64_t>(candidate & 0x7fffu) << 16);
        const bool nearest = nan ? candidate == master_to_bf16_bits(master)
                                 : ((candidate ^ (u >> 16)) & 0x8000u) == 0 && apart >= -0x8000 && apart <= 0x8000;
        const uint32_t got = float_to_bits(master_or_param(master, bfloat16_t{candidate}));
        off += got != (nearest ? u : static_cast<uint32_t>(candidate) << 16);
      }
    }
  }
  return off;
}

#if defined(FUSEDOFF_AVX512_LANES)
namespace {

// The 2^16 masters whose bits have the upper half `high`, through MasterVectors (split and split8:
// store, then load back) and through the scalar MasterWeight: adds the elements whose bits differ.
constexpr int64_t kHalf = 1 << 16;
struct UpperHalf {  // one thread's buffers (on the heap: 704 KiB)
  alignas(64) float masters[kHalf];
  alignas(64) uint16_t params[kHalf];
  alignas(64) uint16_t lows[kHalf];
  alignas(64) uint16_t params8[kHalf];
  alignas(64) uint8_t lows8[kHalf];
};

FUSEDOFF_TARGET_AVX512 void compare_lanes_upper_half(uint32_t high, uint32_t salt, UpperHalf& buffers,
                                                     int64_t& split_off, int64_t& split8_off) {
  constexpr int64_t n = kHalf;
  float* const masters = buffers.masters;
  uint16_t* const params = buffers.params;
  uint16_t* const lows = buffers.lows;
  uint16_t* const params8 = buffers.params8;
  uint8_t* const lows8 = buffers.lows8;
  for (int64_t i = 0; i < n; ++i) masters[i] = bits_to_float((high << 16) | static_cast<uint32_t>(i));
  using Split = MasterVectors<bfloat16_t, MasterPrecision::Split16>;
  using Split8 = MasterVectors<bfloat16_t, MasterPrecision::Split8>;
  for (int64_t i = 0; i < n; i += 16) {
    const Float16Lanes m = as_lanes(_mm512_load_ps(masters + i));
    Split::store(lows, params, i, m, salt);
    Split8::store(lows8, params8, i, m, salt);
  }
  for (int64_t i = 0; i < n; i += 16) {
    alignas(64) float joined[16], joined8[16];
    _mm512_store_ps(joined, as_m512(Split::load(lows, params, i)));
    _mm512_store_ps(joined8, as_m512(Split8::load(lows8, params8, i)));
    for (int64_t j = 0; j < 16; ++j) {
      const float master = masters[i + j];
      bfloat16_t param, param8;
      uint16_t low;
      uint8_t low8;
      MasterWeight<MasterPrecision::Split16, bfloat16_t>::store(&low, &param, 0, master, salt);
      MasterWeight<MasterPrecision::Split8, bfloat16_t>::store(&low8, &param8, 0, master, salt);
      const float scalar_joined = MasterWeight<MasterPrecision::Split16, bfloat16_t>::load(&low, &param, 0);
      const float scalar_joined8 = MasterWeight<MasterPrecision::Split8, bfloat16_t>::load(&low8, &param8, 0);
      split_off += params[i + j] != param.bits || lows[i + j] != low ||
                   float_to_bits(joined[j]) != float_to_bits(scalar_joined);
      split8_off += params8[i + j] != param8.bits || lows8[i + j] != low8 ||
                    float_to_bits(joined8[j]) != float_to_bits(scalar_joined8);
    }
  }
}

}  // namespace
#endif

selftests::SplitMasterLanes selftests::split_master_lanes(uint32_t split8_salt_value, int num_threads) {
  SplitMasterLanes r{};
#if defined(FUSEDOFF_AVX512_LANES)
  if (current_isa() != Isa::Avx512) return r;
  r.checked = true;
  int64_t split_off = 0, split8_off = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : split_off, split8_off)
  {
    const std::unique_ptr<UpperHalf> buffers(new UpperHalf);
#pragma omp for schedule(static)
    for (int64_t high = 0; high < 65536; ++high) {
      compare_lanes_upper_half(static_cast<uint32_t>(high), split8_salt_value, *buffers, split_off, split8_off);
    }
  }
  r.split_off = split_off;
  r.split8_off = split8_off;
#else
  (void)split8_salt_value;
  (void)num_threads;
#endif
  return r;
}

}  // namespace fusedoff
