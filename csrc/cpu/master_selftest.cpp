// The proof behind [note: split master weights] (master.h), run over every fp32 bit pattern: the
// split master gives back every master, and the split8 one its stochastic rounding, bit for bit.
#include <omp.h>

#include <cstdint>

#include "fusedoff/launchers.h"
#include "fusedoff/master.h"

namespace fusedoff {

SplitMasterSelftest split_master_selftest(uint32_t split8_salt_value, int num_threads) {
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
      split8_failures += joined8 != r || (r & 0xffu) != 0;
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

}  // namespace fusedoff
