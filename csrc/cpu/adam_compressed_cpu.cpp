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
#include "master_lanes.h"
#include "state_codec_avx512.h"

namespace fusedoff {
namespace {

static_assert(kBlockElements % kQuantBlock == 0, "a thread's work is whole 8-bit blocks");

// Elements [begin, end) of one range (`begin` a multiple of kQuantBlock).
// NOTE: the loops below run inside isa.h's per-ISA wrappers, but `#pragma omp simd` is lowered
// where it is written, in this body, which has no target attribute: there an `omp simd`
// reduction, or a local passed by reference (as adam_update's arguments are), becomes a per-lane
// array sized for the baseline ISA, and the AVX-512 loop ran several times slower (see 'CPU kernel
// tuning' in benchmarks/results/RESULTS.md). So the update is called by value, no loop has a
// reduction clause, and the block's scale is a separate integer max loop (which GCC vectorises as a
// plain loop).
struct Updated {
  float param, exp_avg, exp_avg_sq;
};

FUSEDOFF_INLINE Updated adam_updated(float param, float grad, float exp_avg, float exp_avg_sq, float grad_scale,
                                     const AdamScalars& s) {
  float unused = 0.0f;
  adam_update<false>(param, grad, exp_avg, exp_avg_sq, unused, grad_scale, s);
  return {param, exp_avg, exp_avg_sq};
}

// The largest finite magnitude of x[0, n), as the bits of a non-negative float (they order as ints).
FUSEDOFF_INLINE float block_absmax(const float* x, int64_t n) {
  int32_t most = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t magnitude = static_cast<int32_t>(float_to_bits(x[i]) & 0x7fffffffu);
    most = std::max(most, magnitude < 0x7f800000 ? magnitude : 0);  // finite_magnitude's bits
  }
  return bits_to_float(static_cast<uint32_t>(most));
}

// One 8-bit block's codes and scales to fp32 moments and back (state_codec.h), compiled per ISA
// (isa.h); the AVX-512 form is state_codec_avx512.h's, which gives the same codes.
// `n` <= kQuantBlock elements; `m`, `v` hold the block's fp32 moments.
struct DecodeBlock8 {
  static FUSEDOFF_INLINE void run(const uint8_t* m_codes, float m_decode, const uint8_t* v_codes, float v_decode,
                                  float* m, float* v, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) m[i] = decode_signed(m_codes[i], m_decode);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) v[i] = decode_unsigned(v_codes[i], v_decode);
  }
#if defined(FUSEDOFF_X86_DISPATCH)
  static FUSEDOFF_AVX512_INLINE void run_avx512(const uint8_t* m_codes, float m_decode, const uint8_t* v_codes,
                                                float v_decode, float* m, float* v, int64_t n) {
    const __m512 m_factor = _mm512_set1_ps(m_decode);
    const __m512 v_factor = _mm512_set1_ps(v_decode);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 lanes = n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
      const __m512i m_code = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, m_codes + i));
      const __m512i v_code = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, v_codes + i));
      _mm512_mask_storeu_ps(m + i, lanes, avx512_codec::decode_signed(m_code, m_factor));
      _mm512_mask_storeu_ps(v + i, lanes, avx512_codec::decode_unsigned(v_code, v_factor));
    }
  }
#endif
};

// Writes the block's scales (the largest finite magnitudes) and its codes.
struct EncodeBlock8 {
  static FUSEDOFF_INLINE void run(const float* m, const float* v, int64_t n, uint8_t* m_codes, uint8_t* v_codes,
                                  float* m_absmax, float* v_absmax) {
    const float m_max = block_absmax(m, n);
    const float v_max = block_absmax(v, n);
    *m_absmax = m_max;
    *v_absmax = v_max;
    const float m_encode = encode_factor(m_max);
    const float v_encode = encode_factor(v_max);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) m_codes[i] = encode_signed(m[i], m_encode);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) v_codes[i] = encode_unsigned(v[i], v_encode);
  }
#if defined(FUSEDOFF_X86_DISPATCH)
  static FUSEDOFF_AVX512_INLINE __mmask16 tail(int64_t n, int64_t i) {
    return n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
  }
  static FUSEDOFF_AVX512_INLINE void run_avx512(const float* m, const float* v, int64_t n, uint8_t* m_codes,
                                                uint8_t* v_codes, float* m_absmax, float* v_absmax) {
    const __m512i magnitude_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
    __m512i m_most = _mm512_setzero_si512();  // finite_magnitude's bits, as block_absmax
    __m512i v_most = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 lanes = tail(n, i);
      const __m512i m_bits = _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes, m + i), magnitude_mask);
      const __m512i v_bits = _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes, v + i), magnitude_mask);
      m_most = _mm512_mask_max_epi32(m_most, _mm512_cmplt_epi32_mask(m_bits, inf_bits), m_most, m_bits);
      v_most = _mm512_mask_max_epi32(v_most, _mm512_cmplt_epi32_mask(v_bits, inf_bits), v_most, v_bits);
    }
    const float m_max = bits_to_float(static_cast<uint32_t>(_mm512_reduce_max_epi32(m_most)));
    const float v_max = bits_to_float(static_cast<uint32_t>(_mm512_reduce_max_epi32(v_most)));
    *m_absmax = m_max;
    *v_absmax = v_max;
    const __m512 m_encode = _mm512_set1_ps(encode_factor(m_max));
    const __m512 v_encode = _mm512_set1_ps(encode_factor(v_max));
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 lanes = tail(n, i);
      const __m512i m_code = avx512_codec::encode_signed(_mm512_maskz_loadu_ps(lanes, m + i), m_encode);
      const __m512i v_code = avx512_codec::encode_unsigned(_mm512_maskz_loadu_ps(lanes, v + i), v_encode);
      _mm_mask_storeu_epi8(m_codes + i, lanes, _mm512_cvtepi32_epi8(m_code));
      _mm_mask_storeu_epi8(v_codes + i, lanes, _mm512_cvtepi32_epi8(v_code));
    }
  }
#endif
};

using DecodeBlock8Fn = void (*)(const uint8_t*, float, const uint8_t*, float, float*, float*, int64_t);
using EncodeBlock8Fn = void (*)(const float*, const float*, int64_t, uint8_t*, uint8_t*, float*, float*);

// The block codec for this CPU, chosen once per call.
struct Block8Codec {
  DecodeBlock8Fn decode;
  EncodeBlock8Fn encode;
};

Block8Codec block8_codec() {
  return {select_isa_variant<DecodeBlock8, const uint8_t*, float, const uint8_t*, float, float*, float*, int64_t>(),
          select_isa_variant<EncodeBlock8, const float*, const float*, int64_t, uint8_t*, uint8_t*, float*, float*>()};
}

template <typename P, typename G, MasterPrecision kMaster, bool kScaled, bool kBlock8>
struct CompressedAdamRange {
// One 8-bit block of `n` <= kQuantBlock elements from element `block` of the range: decode, update,
// find the new scales, encode.
static FUSEDOFF_INLINE void update_block8(const CompressedAdamTensorPtrs& t, int64_t block, int64_t n, float scale,
                                          const AdamScalars& s, const Block8Codec& codec) {
  P* __restrict__ param = static_cast<P*>(t.param) + block;
  const G* __restrict__ grad = static_cast<const G*>(t.grad) + block;
  MasterLanes<kMaster, kQuantBlock> lanes(t.master, block, block + n);  // see master_lanes.h
  using Master = MasterWeight<kMaster, P, typename decltype(lanes)::Lane>;
  void* block_master = lanes.lanes();
  const uint32_t salt = split8_salt(*t.step);
  uint8_t* m_codes = static_cast<uint8_t*>(t.exp_avg) + block;
  uint8_t* v_codes = static_cast<uint8_t*>(t.exp_avg_sq) + block;
  const int64_t b = block / kQuantBlock;
  alignas(64) float m_block[kQuantBlock];
  alignas(64) float v_block[kQuantBlock];
  codec.decode(m_codes, decode_factor(t.exp_avg_absmax[b]), v_codes, decode_factor(t.exp_avg_sq_absmax[b]), m_block,
               v_block, n);
  float* __restrict__ m = m_block;
  float* __restrict__ v = v_block;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const Updated u = adam_updated(Master::load(block_master, param, i), load_float(grad + i), m[i], v[i], scale, s);
    Master::store(block_master, param, i, u.param, salt);
    m[i] = u.exp_avg;
    v[i] = u.exp_avg_sq;
  }
  lanes.write_back();
  codec.encode(m, v, n, m_codes, v_codes, &t.exp_avg_absmax[b], &t.exp_avg_sq_absmax[b]);
}

// Elements [begin, end) of one range (`begin` a multiple of kQuantBlock).
static FUSEDOFF_INLINE void run(const CompressedAdamTensorPtrs* tensor, int64_t begin, int64_t end, float grad_scale,
                                const AdamScalars* scalars, uint32_t step_key, const Block8Codec* codec) {
  const CompressedAdamTensorPtrs& t = *tensor;
  const AdamScalars s = *scalars;  // a local copy: kept in registers (see adam_cpu.cpp)
  const float scale = kScaled ? grad_scale : 1.0f;
  if (kBlock8) {
    for (int64_t block = begin; block < end; block += kQuantBlock) {
      update_block8(t, block, std::min<int64_t>(kQuantBlock, end - block), scale, s, *codec);
    }
    return;
  }
  // The random indices t.offset + e, cut where their high half changes: 32-bit arithmetic inside.
  for (int64_t span = begin; span < end;) {
    const int64_t index = t.offset + span;
    const int64_t span_end = std::min<int64_t>(end, span + ((int64_t{1} << 32) - (index & 0xffffffff)));
    update_bf16(t, span, span_end, rounding_span_key(step_key, index), static_cast<uint32_t>(index), scale, s);
    span = span_end;
  }
}

// Elements [begin, end) with bf16 moments; element begin + i draws rounding_bits_in_span(span_key,
// index_low + i).
static FUSEDOFF_INLINE void update_bf16(const CompressedAdamTensorPtrs& t, int64_t begin, int64_t end,
                                        uint32_t span_key, uint32_t index_low, float scale, const AdamScalars& s) {
  P* __restrict__ param = static_cast<P*>(t.param) + begin;
  const G* __restrict__ grad = static_cast<const G*>(t.grad) + begin;
  MasterLanes<kMaster, kBlockElements> lanes(t.master, begin, end);  // see master_lanes.h
  using Master = MasterWeight<kMaster, P, typename decltype(lanes)::Lane>;
  void* range_master = lanes.lanes();
  const uint32_t salt = split8_salt(*t.step);
  bfloat16_t* __restrict__ m_store = static_cast<bfloat16_t*>(t.exp_avg) + begin;
  bfloat16_t* __restrict__ v_store = static_cast<bfloat16_t*>(t.exp_avg_sq) + begin;
  const int64_t n = end - begin;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const Updated u = adam_updated(Master::load(range_master, param, i), load_float(grad + i),
                                   load_float(m_store + i), load_float(v_store + i), scale, s);
    Master::store(range_master, param, i, u.param, salt);
    const uint32_t bits = rounding_bits_in_span(span_key, index_low + static_cast<uint32_t>(i));
    m_store[i].bits = float_to_bf16_stochastic(u.exp_avg, bits & 0xffffu);
    v_store[i].bits = float_to_bf16_stochastic(u.exp_avg_sq, bits >> 16);
  }
  lanes.write_back();
}
};

using RangeFn = void (*)(const CompressedAdamTensorPtrs*, int64_t, int64_t, float, const AdamScalars*, uint32_t,
                         const Block8Codec*);

template <typename P, typename G, MasterPrecision kMaster, bool kScaled, bool kBlock8>
RangeFn select_range_fn() {
  return select_isa_variant<CompressedAdamRange<P, G, kMaster, kScaled, kBlock8>, const CompressedAdamTensorPtrs*,
                            int64_t, int64_t, float, const AdamScalars*, uint32_t, const Block8Codec*>();
}

template <typename P, typename G, bool kBlock8>
RangeFn select_range_fn(MasterPrecision precision, bool scaled) {
  RangeFn fn = nullptr;
  dispatch_master<P>(precision, [&](auto master) {
    constexpr MasterPrecision kMaster = decltype(master)::value;
    fn = scaled ? select_range_fn<P, G, kMaster, true, kBlock8>() : select_range_fn<P, G, kMaster, false, kBlock8>();
  });
  return fn;
}

RangeFn select_range_fn(const CompressedAdamLaunch& launch, bool scaled) {
  RangeFn fn = nullptr;
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      fn = launch.precision == StatePrecision::Block8 ? select_range_fn<P, G, true>(launch.master, scaled)
                                                      : select_range_fn<P, G, false>(launch.master, scaled);
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
  const Block8Codec codec = block8_codec();
  for_each_block(launch.num_threads, split_into_blocks(launch.tensors, launch.num_tensors),
                 [&](int64_t, const WorkBlock& b) {
                   range_fn(&launch.tensors[b.tensor], b.begin, b.end, grad_scale, &scalars[b.tensor],
                            step_keys[b.tensor], &codec);
                 });
}

}  // namespace fusedoff
