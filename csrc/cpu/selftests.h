// The host kernels' self-tests: exhaustive checks of the claims the kernels rest on, for the tests
// only (tests/test_split_master.py, tests/test_compressed_states.py). Private to the build: ops.cpp
// registers them as torch.ops.fusedoff_testing, never as torch.ops.fusedoff; the public launchers
// are in launchers.h.
#pragma once

#include <cstdint>

namespace fusedoff {
namespace selftests {

// Counts of the fp32 bit patterns for which a claim of [note: split master weights] (master.h) fails:
// the split master's round trip, the split8 one's (and its rounding, the note's), the split8 rounding's
// bound, and the parameter's rounding (to nearest, ties away from zero). All zero is the proof.
struct SplitMaster {
  int64_t split_failures;
  int64_t split8_failures;
  int64_t split8_outside_bound;
  int64_t roundings_off;
};
SplitMaster split_master(uint32_t split8_salt_value, int num_threads);

// The count of (fp32 master, bf16 parameter) pairs, over every master and the 4 parameters around
// its upper half, where master.h's `master_or_param` keeps the master beside a parameter that is
// not one of its nearest roundings, or takes one that is (see [note: every write is seen]).
int64_t written_param(int num_threads);

// Counts of the fp32 bit patterns for which the host kernels' 16-lane split and split8 masters
// (cpu/master_lanes.h: parameter and low bits stored, master joined back) differ from master.h's
// scalar ones; `checked` is false where the CPU or compiler has no AVX-512 form (nothing to compare).
struct SplitMasterLanes {
  bool checked;
  int64_t split_off;
  int64_t split8_off;
};
SplitMasterLanes split_master_lanes(uint32_t split8_salt_value, int num_threads);

// Counts of the values and codes on which the host kernels' AVX-512 codec (cpu/state_codec_avx512.h)
// differs from state_codec.h's; `checked` is false where the CPU has no AVX-512 (nothing to compare).
struct StateCodec {
  bool checked;
  int64_t encode_signed_off;
  int64_t encode_unsigned_off;
  int64_t decode_signed_off;
  int64_t decode_unsigned_off;
};
StateCodec state_codec(int num_threads);

}  // namespace selftests
}  // namespace fusedoff
