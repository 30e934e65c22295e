// Host Adam/AdamW kernel: the math of fusedoff/adam.h over flat ranges, OpenMP across cores and
// SIMD within a core (instruction set picked at run time, see isa.h).
#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "fusedoff/adam.h"
#include "fusedoff/launchers.h"
#include "blocks.h"
#include "isa.h"
#include "master_lanes.h"

namespace fusedoff {
namespace {

// NOTE: software prefetch, `kPrefetchDistance` elements ahead in every stream, issued once per
// `kPrefetchChunk` elements. The loop's divisions and square root keep few iterations in flight,
// so the hardware prefetchers alone left it short of memory-level parallelism; prefetching made
// the step faster, and any distance from 128 to 1024 elements did as well (the figures: see
// 'CPU kernel tuning' in benchmarks/results/RESULTS.md).
constexpr int64_t kPrefetchChunk = 64;
constexpr int64_t kPrefetchDistance = 512;

// Prefetches (for writing when kWrite) each cache line of data[begin, end).
template <int kWrite, typename T>
FUSEDOFF_INLINE void prefetch_lines(const T* data, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += static_cast<int64_t>(64 / sizeof(T))) __builtin_prefetch(data + i, kWrite, 3);
}

// The loop every ISA variant compiles (isa.h inlines it into one wrapper per instruction set).
//
// NOTE: without a grad scale (or with a scale of exactly 1) the loop passes adam_update the
// constant 1.0f, and the compiler drops `grad / grad_scale`: x / 1.0f == x for every float, so the
// results are bitwise those of the scaled loop, minus one of three vdivps per 8 elements (divisions
// and the square root share one unit; the figures: see 'CPU kernel tuning' in
// benchmarks/results/RESULTS.md).
// NOTE: `s` is a local copy so that the compiler keeps the scalars in registers: through the
// pointer it reloaded and re-broadcast all ten in every iteration (a float store may alias them).
template <typename P, typename G, bool kAmsgrad, MasterPrecision kMaster, bool kScaled>
struct AdamRange {
// Prefetches every stream of `t` kPrefetchDistance elements beyond [chunk, chunk_end).
static FUSEDOFF_INLINE void prefetch_ahead(const AdamTensorPtrs& t, int64_t chunk, int64_t chunk_end) {
  const int64_t ahead = chunk + kPrefetchDistance;
  const int64_t ahead_end = std::min(t.numel, chunk_end + kPrefetchDistance);
  if (ahead >= ahead_end) return;
  prefetch_lines<1>(t.exp_avg, ahead, ahead_end);
  prefetch_lines<1>(t.exp_avg_sq, ahead, ahead_end);
  if (kAmsgrad) prefetch_lines<1>(t.max_exp_avg_sq, ahead, ahead_end);
  if (kMaster != MasterPrecision::None) {
    prefetch_lines<1>(static_cast<const master_storage_t<kMaster>*>(t.master), ahead, ahead_end);
  }
  prefetch_lines<1>(static_cast<const P*>(t.param), ahead, ahead_end);
  prefetch_lines<0>(static_cast<const G*>(t.grad), ahead, ahead_end);
}

static FUSEDOFF_INLINE void run(const AdamTensorPtrs* tensor, int64_t begin, int64_t end, float grad_scale,
                                const AdamScalars* scalars) {
  const AdamTensorPtrs& t = *tensor;
  P* __restrict__ param = static_cast<P*>(t.param);
  const G* __restrict__ grad = static_cast<const G*>(t.grad);
  float* __restrict__ exp_avg = t.exp_avg;
  float* __restrict__ exp_avg_sq = t.exp_avg_sq;
  float* __restrict__ max_exp_avg_sq = t.max_exp_avg_sq;
  void* master = t.master;
  const uint32_t salt = split8_salt(*t.step);
  const AdamScalars s = *scalars;
  const float scale = kScaled ? grad_scale : 1.0f;
  // A split8 chunk goes through a buffer (below), where chunks of 128 elements did better than 64
  // (see 'CPU kernel tuning' in benchmarks/results/RESULTS.md).
  constexpr int64_t kChunk = kMaster == MasterPrecision::Split8 ? 2 * kPrefetchChunk : kPrefetchChunk;
  for (int64_t chunk = begin; chunk < end; chunk += kChunk) {
    const int64_t chunk_end = std::min(end, chunk + kChunk);
    prefetch_ahead(t, chunk, chunk_end);
    MasterLanes<kMaster, kChunk> lanes(master, chunk, chunk_end);
    using Master = MasterWeight<kMaster, P, typename decltype(lanes)::Lane>;
    void* chunk_master = lanes.lanes();
    P* chunk_param = param + chunk;
    // NOTE: a split8 master in the update loop left the compiler a long loop that ran at a low
    // instruction rate, well behind "split": its masters are read and written in loops of their own,
    // through an fp32 buffer in L1, around the update loop (the figures: 'CPU kernel tuning' in
    // benchmarks/results/RESULTS.md).
    constexpr bool kBuffered = kMaster == MasterPrecision::Split8;
    alignas(64) float masters[kBuffered ? kChunk : 1];
    if constexpr (kBuffered) {
#pragma omp simd
      for (int64_t i = 0; i < chunk_end - chunk; ++i) masters[i] = Master::load(chunk_master, chunk_param, i);
    }
#pragma omp simd
    for (int64_t i = chunk; i < chunk_end; ++i) {
      float p = kBuffered ? masters[i - chunk] : Master::load(chunk_master, chunk_param, i - chunk);
      float m = exp_avg[i];
      float v = exp_avg_sq[i];
      float vmax = kAmsgrad ? max_exp_avg_sq[i] : 0.0f;
      adam_update<kAmsgrad>(p, load_float(grad + i), m, v, vmax, scale, s);
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      if (kAmsgrad) max_exp_avg_sq[i] = vmax;
      if (kBuffered) {
        masters[i - chunk] = p;
      } else {
        Master::store(chunk_master, chunk_param, i - chunk, p, salt);
      }
    }
    if constexpr (kBuffered) {
#pragma omp simd
      for (int64_t i = 0; i < chunk_end - chunk; ++i) Master::store(chunk_master, chunk_param, i, masters[i], salt);
    }
    lanes.write_back();
  }
}

#if defined(FUSEDOFF_AVX512_LANES)
// bf16 parameters with a master weight, in the AVX-512 variant: 16 elements at a time in 512-bit
// vectors, the master joined and split in registers (MasterVectors), the remainder by `run`.
// NOTE: for `run`'s loop GCC chose 16 lanes of 256-bit vectors, the width of the 16-bit parameters
// and gradients, so the square root and divisions ran in ymm registers, at about half the divider's
// throughput on zmm, where the loop of fp32 parameters runs (the figures: 'CPU kernel tuning' in
// benchmarks/results/RESULTS.md).
static constexpr bool kLanes = MasterVectors<P, kMaster>::kOn && !kAmsgrad &&
                               (std::is_same<G, bfloat16_t>::value || std::is_same<G, float>::value);

static FUSEDOFF_AVX512_INLINE void run_avx512(const AdamTensorPtrs* tensor, int64_t begin, int64_t end,
                                              float grad_scale, const AdamScalars* scalars) {
  if constexpr (!kLanes) {
    run(tensor, begin, end, grad_scale, scalars);
  } else {
    const AdamTensorPtrs& t = *tensor;
    uint16_t* __restrict__ param_bits = reinterpret_cast<uint16_t*>(static_cast<P*>(t.param));
    const G* __restrict__ grad = static_cast<const G*>(t.grad);
    float* __restrict__ exp_avg = t.exp_avg;
    float* __restrict__ exp_avg_sq = t.exp_avg_sq;
    void* master = t.master;
    const uint32_t salt = split8_salt(*t.step);
    const AdamScalars s = *scalars;
    const float scale = kScaled ? grad_scale : 1.0f;
    const int64_t whole = begin + (end - begin) / 16 * 16;
    // NOTE: a split8 master's rounding (a hash with two multiplies, then selects) after the update's
    // divisions made the loop one long dependency chain per 16 elements; updating 256 elements into an
    // L1 buffer and then rounding and storing them in a loop of their own, which overlaps the next
    // chunk's divisions, is faster (than 64 or 512 elements too). The other masters store in the update
    // loop: a buffer made them slower (the figures: 'CPU kernel tuning' in benchmarks/results/RESULTS.md).
    constexpr bool kSplit8 = kMaster == MasterPrecision::Split8;
    constexpr int64_t kChunk = kSplit8 ? 4 * kPrefetchChunk : kPrefetchChunk;
    for (int64_t chunk = begin; chunk < whole; chunk += kChunk) {
      const int64_t chunk_end = std::min(whole, chunk + kChunk);
      prefetch_ahead(t, chunk, chunk_end);
      alignas(64) float updated[kSplit8 ? kChunk : 1];
      for (int64_t i = chunk; i < chunk_end; i += 16) {
        Float16Lanes p = MasterVectors<P, kMaster>::load(master, param_bits, i);
        const Float16Lanes g = load_float_lanes(grad + i);
        Float16Lanes m = as_lanes(_mm512_loadu_ps(exp_avg + i));
        Float16Lanes v = as_lanes(_mm512_loadu_ps(exp_avg_sq + i));
        Float16Lanes unused = p;
        adam_update<false>(p, g, m, v, unused, scale, s);
        _mm512_storeu_ps(exp_avg + i, as_m512(m));
        _mm512_storeu_ps(exp_avg_sq + i, as_m512(v));
        if constexpr (kSplit8) {
          _mm512_store_ps(updated + (i - chunk), as_m512(p));
        } else {
          MasterVectors<P, kMaster>::store(master, param_bits, i, p, salt);
        }
      }
      if constexpr (kSplit8) {
        for (int64_t i = chunk; i < chunk_end; i += 16) {
          MasterVectors<P, kMaster>::store(master, param_bits, i, as_lanes(_mm512_load_ps(updated + (i - chunk))), salt);
        }
      }
    }
    if (whole < end) run(tensor, whole, end, grad_scale, scalars);
  }
}
#endif
};

using RangeFn = void (*)(const AdamTensorPtrs*, int64_t, int64_t, float, const AdamScalars*);

template <typename P, typename G, bool kAmsgrad, MasterPrecision kMaster, bool kScaled>
RangeFn select_range_fn() {
  return select_isa_variant<AdamRange<P, G, kAmsgrad, kMaster, kScaled>, const AdamTensorPtrs*, int64_t, int64_t,
                            float, const AdamScalars*>();
}

template <typename P, typename G, bool kAmsgrad>
RangeFn select_range_fn(MasterPrecision precision, bool scaled) {
  RangeFn fn = nullptr;
  dispatch_master<P>(precision, [&](auto master) {
    constexpr MasterPrecision kMaster = decltype(master)::value;
    fn = scaled ? select_range_fn<P, G, kAmsgrad, kMaster, true>() : select_range_fn<P, G, kAmsgrad, kMaster, false>();
  });
  return fn;
}

RangeFn select_range_fn(const AdamLaunch& launch, bool scaled) {
  RangeFn fn = nullptr;
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      fn = launch.amsgrad ? select_range_fn<P, G, true>(launch.master, scaled)
                          : select_range_fn<P, G, false>(launch.master, scaled);
    });
  });
  return fn;
}

}  // namespace

void adam_step_cpu(const AdamLaunch& launch) {
  if (launch.found_inf != nullptr && *launch.found_inf != 0.0f) return;  // AMP overflow: skip
  const float grad_scale = launch.grad_scale != nullptr ? *launch.grad_scale : 1.0f;

  std::vector<AdamScalars> scalars(launch.num_tensors);
  for (int64_t i = 0; i < launch.num_tensors; ++i) scalars[i] = adam_scalars(launch.hyper, *launch.tensors[i].step);
  const RangeFn range_fn = select_range_fn(launch, /*scaled=*/grad_scale != 1.0f);
  for_each_block(launch.num_threads, split_into_blocks(launch.tensors, launch.num_tensors),
                 [&](int64_t, const WorkBlock& b) {
                   range_fn(&launch.tensors[b.tensor], b.begin, b.end, grad_scale, &scalars[b.tensor]);
                 });
}

}  // namespace fusedoff
