// Host Adam/AdamW kernel: the math of fusedoff/adam.h over flat ranges, OpenMP across cores and
// SIMD within a core, with the instruction set picked at run time (no -march=native in the build,
// so the prebuilt extension runs on any x86-64 or aarch64 CPU).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "fusedoff/adam.h"
#include "fusedoff/launchers.h"

namespace fusedoff {
namespace {

// NOTE: 32K elements is 128 KiB per fp32 stream: big enough that OpenMP scheduling is noise,
// small enough that a 64M-element call splits into ~2K blocks and both cores stay busy to the end.
constexpr int64_t kBlockElements = 32768;

struct WorkBlock {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

// The loop every ISA variant compiles: always inlined into the target-specific wrappers below so
// that it is vectorised with their instruction set.
template <typename P, typename G, bool kAmsgrad, bool kMaster>
FUSEDOFF_INLINE void adam_range(const AdamTensorPtrs& t, int64_t begin, int64_t end, float grad_scale,
                                const AdamScalars& s) {
  P* __restrict__ param = static_cast<P*>(t.param);
  const G* __restrict__ grad = static_cast<const G*>(t.grad);
  float* __restrict__ exp_avg = t.exp_avg;
  float* __restrict__ exp_avg_sq = t.exp_avg_sq;
  float* __restrict__ max_exp_avg_sq = t.max_exp_avg_sq;
  float* __restrict__ master = t.master;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float p = kMaster ? master[i] : load_float(param + i);
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    float vmax = kAmsgrad ? max_exp_avg_sq[i] : 0.0f;
    adam_update<kAmsgrad>(p, load_float(grad + i), m, v, vmax, grad_scale, s);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (kAmsgrad) max_exp_avg_sq[i] = vmax;
    if (kMaster) master[i] = p;
    store_float(param + i, p);
  }
}

using RangeFn = void (*)(const AdamTensorPtrs&, int64_t, int64_t, float, const AdamScalars&);

#define FUSEDOFF_DEFINE_ISA_VARIANT(NAME, TARGET_ATTR)                                                  \
  template <typename P, typename G, bool kAmsgrad, bool kMaster>                                       \
  TARGET_ATTR void NAME(const AdamTensorPtrs& t, int64_t begin, int64_t end, float grad_scale,        \
                        const AdamScalars& s) {                                                        \
    adam_range<P, G, kAmsgrad, kMaster>(t, begin, end, grad_scale, s);                                 \
  }

FUSEDOFF_DEFINE_ISA_VARIANT(adam_range_baseline, )
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FUSEDOFF_X86_DISPATCH 1
FUSEDOFF_DEFINE_ISA_VARIANT(adam_range_avx2, __attribute__((target("avx2,fma,f16c"))))
FUSEDOFF_DEFINE_ISA_VARIANT(adam_range_avx512,
                            __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))))
#endif

enum class Isa { Baseline, Avx2, Avx512 };

Isa detect_isa() {
#if defined(FUSEDOFF_X86_DISPATCH)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::Avx2;
#endif
  return Isa::Baseline;  // aarch64: NEON is part of the baseline ISA
}

Isa current_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

template <typename P, typename G, bool kAmsgrad, bool kMaster>
RangeFn select_range_fn() {
#if defined(FUSEDOFF_X86_DISPATCH)
  switch (current_isa()) {
    case Isa::Avx512: return adam_range_avx512<P, G, kAmsgrad, kMaster>;
    case Isa::Avx2: return adam_range_avx2<P, G, kAmsgrad, kMaster>;
    case Isa::Baseline: break;
  }
#endif
  return adam_range_baseline<P, G, kAmsgrad, kMaster>;
}

RangeFn select_range_fn(const AdamLaunch& launch) {
  RangeFn fn = nullptr;
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      if (launch.amsgrad) {
        fn = launch.has_master ? select_range_fn<P, G, true, true>() : select_range_fn<P, G, true, false>();
      } else {
        fn = launch.has_master ? select_range_fn<P, G, false, true>() : select_range_fn<P, G, false, false>();
      }
    });
  });
  return fn;
}

}  // namespace

const char* cpu_isa_name() {
  switch (current_isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Baseline: break;
  }
  return "baseline";
}

void adam_step_cpu(const AdamLaunch& launch) {
  if (launch.found_inf != nullptr && *launch.found_inf != 0.0f) return;  // AMP overflow: skip
  const float grad_scale = launch.grad_scale != nullptr ? *launch.grad_scale : 1.0f;

  std::vector<AdamScalars> scalars(launch.num_tensors);
  std::vector<WorkBlock> blocks;
  for (int64_t i = 0; i < launch.num_tensors; ++i) {
    const AdamTensorPtrs& t = launch.tensors[i];
    scalars[i] = adam_scalars(launch.hyper, *t.step);
    for (int64_t begin = 0; begin < t.numel; begin += kBlockElements)
      blocks.push_back({static_cast<int32_t>(i), begin, std::min(t.numel, begin + kBlockElements)});
  }
  const RangeFn range_fn = select_range_fn(launch);
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  const int num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(launch.num_threads, num_blocks)));
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const WorkBlock& block = blocks[b];
    range_fn(launch.tensors[block.tensor], block.begin, block.end, grad_scale, scalars[block.tensor]);
  }
}

}  // namespace fusedoff
