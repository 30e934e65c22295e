// Host Adam/AdamW with compressed moments: per element the math of adam.h (`adam_update`), with
// the states decoded before and encoded after it in the same pass (state_codec.h). OpenMP across
// cores over blocks of kBlockElements (a multiple of kQuantBlock, so no 8-bit block is split
// between threads) and SIMD within a core, instruction set picked at run time (isa.h).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "fusedoff/adam.h"
#include "fusedoff/launchers.h"
#include "blocks.h"
#include "isa.h"

namespace fusedoff {
namespace {

static_assert(kBlockElements % kQuantBlock == 0, "a thread's work is whole 8-bit blocks");

// Elements [begin, end) of one range (`begin` a multiple of kQuantBlock).
template <typename P, typename G, bool kMaster, bool kScaled, bool kBlock8>
struct CompressedAdamRange {
static FUSEDOFF_INLINE void run(const CompressedAdamTensorPtrs* tensor, int64_t begin, int64_t end, float grad_scale,
                                const AdamScalars* scalars, uint32_t step_key) {
  const CompressedAdamTensorPtrs& t = *tensor;
  P* __restrict__ param = static_cast<P*>(t.param);
  const G* __restrict__ grad = static_cast<const G*>(t.grad);
  float* __restrict__ master = t.master;
  const AdamScalars s = *scalars;  // a local copy: kept in registers (see adam_cpu.cpp)
  const float scale = kScaled ? grad_scale : 1.0f;
  if (kBlock8) {
    uint8_t* __restrict__ m_codes = static_cast<uint8_t*>(t.exp_avg);
    uint8_t* __restrict__ v_codes = static_cast<uint8_t*>(t.exp_avg_sq);
    float m[kQuantBlock];
    float v[kQuantBlock];
    for (int64_t block = begin; block < end; block += kQuantBlock) {
      const int64_t n = std::min<int64_t>(kQuantBlock, end - block);
      const int64_t b = block / kQuantBlock;
      const float m_scale = t.exp_avg_absmax[b];
      const float v_scale = t.exp_avg_sq_absmax[b];
      float m_max = 0.0f;
      float v_max = 0.0f;
#pragma omp simd reduction(max : m_max, v_max)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t e = block + i;
        float p = kMaster ? master[e] : load_float(param + e);
        float mi = decode_signed(m_codes[e], m_scale);
        float vi = decode_unsigned(v_codes[e], v_scale);
        float unused = 0.0f;
        adam_update<false>(p, load_float(grad + e), mi, vi, unused, scale, s);
        if (kMaster) master[e] = p;
        store_float(param + e, p);
        m[i] = mi;
        v[i] = vi;
        m_max = std::max(m_max, finite_magnitude(mi));
        v_max = std::max(v_max, finite_magnitude(vi));
      }
      t.exp_avg_absmax[b] = m_max;
      t.exp_avg_sq_absmax[b] = v_max;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        m_codes[block + i] = encode_signed(m[i], m_max);
        v_codes[block + i] = encode_unsigned(v[i], v_max);
      }
    }
  } else {
    bfloat16_t* __restrict__ m_store = static_cast<bfloat16_t*>(t.exp_avg);
    bfloat16_t* __restrict__ v_store = static_cast<bfloat16_t*>(t.exp_avg_sq);
#pragma omp simd
    for (int64_t e = begin; e < end; ++e) {
      float p = kMaster ? master[e] : load_float(param + e);
      float mi = load_float(m_store + e);
      float vi = load_float(v_store + e);
      float unused = 0.0f;
      adam_update<false>(p, load_float(grad + e), mi, vi, unused, scale, s);
      if (kMaster) master[e] = p;
      store_float(param + e, p);
      const uint32_t bits = rounding_bits(step_key, t.offset + e);
      m_store[e].bits = float_to_bf16_stochastic(mi, bits & 0xffffu);
      v_store[e].bits = float_to_bf16_stochastic(vi, bits >> 16);
    }
  }
}
};

using RangeFn = void (*)(const CompressedAdamTensorPtrs*, int64_t, int64_t, float, const AdamScalars*, uint32_t);

template <typename P, typename G, bool kMaster, bool kScaled, bool kBlock8>
RangeFn select_range_fn() {
  return select_isa_variant<CompressedAdamRange<P, G, kMaster, kScaled, kBlock8>, const CompressedAdamTensorPtrs*,
                            int64_t, int64_t, float, const AdamScalars*, uint32_t>();
}

template <typename P, typename G, bool kBlock8>
RangeFn select_range_fn(bool master, bool scaled) {
  if (master) return scaled ? select_range_fn<P, G, true, true, kBlock8>() : select_range_fn<P, G, true, false, kBlock8>();
  return scaled ? select_range_fn<P, G, false, true, kBlock8>() : select_range_fn<P, G, false, false, kBlock8>();
}

RangeFn select_range_fn(const CompressedAdamLaunch& launch, bool scaled) {
  RangeFn fn = nullptr;
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      fn = launch.precision == StatePrecision::Block8 ? select_range_fn<P, G, true>(launch.has_master, scaled)
                                                      : select_range_fn<P, G, false>(launch.has_master, scaled);
    });
  });
  return fn;
}

}  // namespace

void adam_compressed_step_cpu(const CompressedAdamLaunch& launch) {
  if (launch.found_inf != nullptr && *launch.found_inf != 0.0f) return;  // AMP overflow: skip
  const float grad_scale = launch.grad_scale != nullptr ? *launch.grad_scale : 1.0f;
  std::vector<AdamScalars> scalars(launch.num_tensors);
  std::vector<uint32_t> step_keys(launch.num_tensors);
  for (int64_t i = 0; i < launch.num_tensors; ++i) {
    const float step = *launch.tensors[i].step;
    scalars[i] = adam_scalars(launch.hyper, step);
    step_keys[i] = rounding_step_key(launch.tensors[i].tensor_key, static_cast<uint32_t>(step));
  }
  const RangeFn range_fn = select_range_fn(launch, /*scaled=*/grad_scale != 1.0f);
  for_each_block(launch.num_threads, split_into_blocks(launch.tensors, launch.num_tensors),
                 [&](int64_t, const WorkBlock& b) {
                   range_fn(&launch.tensors[b.tensor], b.begin, b.end, grad_scale, &scalars[b.tensor],
                            step_keys[b.tensor]);
                 });
}

}  // namespace fusedoff
