// Entry points of the backend launchers. ATen-free: ops.cpp fills a plain AdamLaunch and calls one.
#pragma once

#include "fusedoff/adam.h"
#include "fusedoff/apollo.h"

namespace fusedoff {

// Host kernel: OpenMP across `launch.num_threads` threads, SIMD chosen at run time (cpu/isa.h).
void adam_step_cpu(const AdamLaunch& launch);
// Host Adam with compressed moments (state_codec.h).
void adam_compressed_step_cpu(const CompressedAdamLaunch& launch);

// Host Apollo kernel, one phase of the step (see apollo.h).
void apollo_step_cpu(const ApolloLaunch& launch);

// The 8-bit codec (state_codec.h) on a whole flat tensor, for checkpoints: `absmax` has one scale per
// block of kQuantBlock elements counted from the first.
void encode_8bit_cpu(const float* values, int64_t numel, bool is_signed, uint8_t* codes, float* absmax,
                     int num_threads);
void decode_8bit_cpu(const uint8_t* codes, const float* absmax, int64_t numel, bool is_signed, float* values,
                     int num_threads);

// Counts of the fp32 bit patterns for which a claim of [note: split master weights] (master.h) fails:
// the split master's round trip, the split8 one's (and its rounding, the note's), the split8 rounding's
// bound, and the parameter's rounding (to nearest, ties away from zero). All zero is the proof; tests/test_split_master.py runs it.
struct SplitMasterSelftest {
  int64_t split_failures;
  int64_t split8_failures;
  int64_t split8_outside_bound;
  int64_t roundings_off;
};
SplitMasterSelftest split_master_selftest(uint32_t split8_salt_value, int num_threads);

// The count of (fp32 master, bf16 parameter) pairs, over every master and the 4 parameters around
// its upper half, where master.h's `master_or_param` keeps the master beside a parameter that is
// not one of its nearest roundings, or takes one that is (see [note: every write is seen]).
int64_t written_param_selftest(int num_threads);

// Counts of the fp32 bit patterns for which the host kernels' 16-lane split and split8 masters
// (cpu/master_lanes.h: parameter and low bits stored, master joined back) differ from master.h's
// scalar ones; `checked` is false where the CPU or compiler has no AVX-512 form (nothing to compare).
struct SplitMasterLanesSelftest {
  bool checked;
  int64_t split_off;
  int64_t split8_off;
};
SplitMasterLanesSelftest split_master_lanes_selftest(uint32_t split8_salt_value, int num_threads);

// Counts of the values and codes on which the host kernels' AVX-512 codec (cpu/state_codec_avx512.h)
// differs from state_codec.h's; `checked` is false where the CPU has no AVX-512 (nothing to compare).
struct StateCodecSelftest {
  bool checked;
  int64_t encode_signed_off;
  int64_t encode_unsigned_off;
  int64_t decode_signed_off;
  int64_t decode_unsigned_off;
};
StateCodecSelftest state_codec_selftest(int num_threads);

// The instruction set the host kernels dispatch to on this CPU ("avx512", "avx2", "baseline").
const char* cpu_isa_name();

#if defined(FUSEDOFF_WITH_CUDA)
// Device kernel: multi-tensor launches on `launch.stream`; pointers are device pointers.
void adam_step_cuda(const AdamLaunch& launch);
void adam_compressed_step_cuda(const CompressedAdamLaunch& launch);
void apollo_step_cuda(const ApolloLaunch& launch);
// The device memory apollo_step_cuda needs in `launch.workspace` (per-block partial sums of the
// 'reduce' and 'moments' phases; 0 for the others), for the caller to take from its allocator.
int64_t apollo_cuda_workspace_bytes(const ApolloLaunch& launch);
#endif

}  // namespace fusedoff
