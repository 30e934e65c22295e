// Run-time instruction-set dispatch for the host kernels. The prebuilt extension must run on any
// x86-64 or aarch64 CPU, so nothing is built with -march=native: each kernel loop is compiled once
// per instruction set (GCC/Clang `target` attributes on thin wrappers around an always-inlined
// body) and the variant for this CPU is picked when the kernel runs.
#pragma once

#include <type_traits>

namespace fusedoff {

enum class Isa { Baseline, Avx2, Avx512 };

Isa current_isa();

}  // namespace fusedoff

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FUSEDOFF_X86_DISPATCH 1
#define FUSEDOFF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FUSEDOFF_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
// An always-inlined function with intrinsics of the AVX-512 variant (its callers carry the target).
#define FUSEDOFF_AVX512_INLINE FUSEDOFF_TARGET_AVX512 inline __attribute__((always_inline))
// adam.h's update on GCC's 16-lane vectors (float_lanes.h). Clang refuses a call with a 512-bit
// vector in a function without AVX-512 even where it inlines it (adam_update's call of the vector
// square root), so with Clang the kernels that use them run their scalar code.
#if !defined(__clang__)
#define FUSEDOFF_AVX512_LANES 1
#endif
#endif

namespace fusedoff {

// Kernel loops are `struct Body { static FUSEDOFF_INLINE R run(Args...); }`; these wrappers compile
// the inlined body once per instruction set, and `select_isa_variant<Body, Args...>()` returns the
// one for this CPU as a plain function pointer (looked up once per call, outside the hot loop).
template <typename Body, typename... Args>
auto isa_variant_baseline(Args... args) {
  return Body::run(args...);
}

#if defined(FUSEDOFF_X86_DISPATCH)
template <typename Body, typename... Args>
FUSEDOFF_TARGET_AVX2 auto isa_variant_avx2(Args... args) {
  return Body::run(args...);
}

// A Body may give an AVX-512 form of its own, `static FUSEDOFF_TARGET_AVX512 ... run_avx512(Args...)`
// (written with intrinsics, which only a function with the target may call); this variant runs it.
template <typename Body, typename = void>
struct HasAvx512Form : std::false_type {};
template <typename Body>
struct HasAvx512Form<Body, std::void_t<decltype(&Body::run_avx512)>> : std::true_type {};

template <typename Body, typename... Args>
FUSEDOFF_TARGET_AVX512 auto isa_variant_avx512(Args... args) {
  if constexpr (HasAvx512Form<Body>::value) {
    return Body::run_avx512(args...);
  } else {
    return Body::run(args...);
  }
}
#endif

template <typename Body, typename... Args>
auto select_isa_variant() {
#if defined(FUSEDOFF_X86_DISPATCH)
  switch (current_isa()) {
    case Isa::Avx512: return &isa_variant_avx512<Body, Args...>;
    case Isa::Avx2: return &isa_variant_avx2<Body, Args...>;
    case Isa::Baseline: break;
  }
#endif
  return &isa_variant_baseline<Body, Args...>;
}

}  // namespace fusedoff
