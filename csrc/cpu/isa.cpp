#include "isa.h"

#include "fusedoff/launchers.h"

namespace fusedoff {
namespace {

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

}  // namespace

Isa current_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

const char* cpu_isa_name() {
  switch (current_isa()) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Baseline: break;
  }
  return "baseline";
}

}  // namespace fusedoff
