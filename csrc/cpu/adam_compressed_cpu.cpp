// Host Adam/AdamW with compressed moments: per element the math of adam.h (`adam_update`), with
// the states decoded before and encoded after it in the same pass (state_codec.h). OpenMP across
// cores over blocks of kBlockElements (a multiple of kQuantBlock, so no 8-bit block is split
// between threads) and SIMD within a core, instruction set picked at run time (isa.h); the 8-bit
// blocks have an AVX-512 form of their own (update_whole_block8_avx512).

#include <omp.h>

#include <type_traits>

#include <algorithm>
#include <vector>

#include "fusedoff/adam.h"
#include "fusedoff/launchers.h"
#include "blocks.h"
#include "isa.h"
#include "float_lanes.h"
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

template <typename P, typename G, MasterPrecision kMaster, bool kScaled, bool kBlock8>
struct CompressedAdamRange {
// One 8-bit block of `n` <= kQuantBlock elements from element `block` of the range: decode and
// update, find the new scales, encode.
static FUSEDOFF_INLINE void update_block8(const CompressedAdamTensorPtrs& t, int64_t block, int64_t n, float scale,
                                          const AdamScalars& s) {
  P* __restrict__ param = static_cast<P*>(t.param) + block;
  const G* __restrict__ grad = static_cast<const G*>(t.grad) + block;
  MasterLanes<kMaster, kQuantBlock> lanes(t.master, block, block + n);  // see master_lanes.h
  using Master = MasterWeight<kMaster, P, typename decltype(lanes)::Lane>;
  void* block_master = lanes.lanes();
  const uint32_t salt = split8_salt(*t.step);
  uint8_t* __restrict__ m_codes = static_cast<uint8_t*>(t.exp_avg) + block;
  uint8_t* __restrict__ v_codes = static_cast<uint8_t*>(t.exp_avg_sq) + block;
  const int64_t b = block / kQuantBlock;
  const float m_decode = decode_factor(t.exp_avg_absmax[b]);
  const float v_decode = decode_factor(t.exp_avg_sq_absmax[b]);
  float m[kQuantBlock];
  float v[kQuantBlock];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const Updated u = adam_updated(Master::load(block_master, param, i), load_float(grad + i),
                                   decode_signed(m_codes[i], m_decode), decode_unsigned(v_codes[i], v_decode), scale, s);
    Master::store(block_master, param, i, u.param, salt);
    m[i] = u.exp_avg;
    v[i] = u.exp_avg_sq;
  }
  lanes.write_back();
  const float m_max = block_absmax(m, n);
  const float v_max = block_absmax(v, n);
  t.exp_avg_absmax[b] = m_max;
  t.exp_avg_sq_absmax[b] = v_max;
  const float m_encode = encode_factor(m_max);
  const float v_encode = encode_factor(v_max);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    m_codes[i] = encode_signed(m[i], m_encode);
    v_codes[i] = encode_unsigned(v[i], v_encode);
  }
}

#if defined(FUSEDOFF_AVX512_LANES)
// Whether a moment's codes decode exactly with its factor folded into the steps: where the products
// are normal, or, with scale 0, where every code is 0 or non-finite (the only codes a block of scale 0
// is given; the underflowed steps would read any other one wrongly).
template <bool kSigned>
static FUSEDOFF_AVX512_INLINE bool decodes_folded(float absmax, const uint8_t* codes) {
  if (avx512_codec::steps_scale_exactly(decode_factor(absmax))) return true;
  if (absmax != 0.0f) return false;
  const __m512i first_special = _mm512_set1_epi8(static_cast<char>(kSigned ? kSignedInf : kUnsignedInf));
  for (int64_t i = 0; i < kQuantBlock; i += 64) {
    __m512i magnitude = _mm512_loadu_si512(codes + i);
    if (kSigned) magnitude = _mm512_and_si512(magnitude, _mm512_set1_epi8(0x7f));
    const __mmask64 zero = _mm512_testn_epi8_mask(magnitude, magnitude);
    if ((zero | _mm512_cmpge_epu8_mask(magnitude, first_special)) != ~__mmask64{0}) return false;
  }
  return true;
}

// The codes of a whole block's fp32 moments m and v under the block's encode factors; kMembers: every
// value is finite (and every v >= +0), state_codec_avx512.h's forms for a block's members.
template <bool kMembers>
static FUSEDOFF_AVX512_INLINE void encode_block8_avx512(const float* m, const float* v, __m512 m_encode,
                                                        __m512 v_encode, uint8_t* m_codes, uint8_t* v_codes) {
  using namespace avx512_codec;
  for (int64_t i = 0; i < kQuantBlock; i += 16) {
    const __m512 m16 = _mm512_load_ps(m + i);
    const __m512 v16 = _mm512_load_ps(v + i);
    const __m512i m_code = kMembers ? encode_signed_block_member(m16, m_encode) : encode_signed(m16, m_encode);
    const __m512i v_code = kMembers ? encode_unsigned_block_member(v16, v_encode) : encode_unsigned(v16, v_encode);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m_codes + i), _mm512_cvtepi32_epi8(m_code));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v_codes + i), _mm512_cvtepi32_epi8(v_code));
  }
}

// update_block8 in AVX-512, bit for bit, for a whole block. The scalar code leaves the compiler a
// loop it vectorises poorly (the codes' bytes set its vector width, and the codec's selects become
// mask juggling); here one pass decodes 16 codes of each moment (state_codec_avx512.h), runs adam.h's
// update on the 16 lanes (float_lanes.h) and keeps the largest magnitudes, so that the divisions and
// the square root overlap the codec's integer work; a second pass encodes. Parameters other than
// fp32 without a master are read and written in passes of their own around it: bf16 ones with a
// master and bf16 gradients 16 at a time (MasterVectors), the others by the scalar MasterWeight. The block's decode factors are folded into the map's steps, which is exact unless a
// moment's scale is below about 2^-93 (then the caller takes update_block8; see decodes_folded).
static FUSEDOFF_AVX512_INLINE void update_whole_block8_avx512(const CompressedAdamTensorPtrs& t, int64_t block,
                                                              float scale, const AdamScalars& s) {
  using namespace avx512_codec;
  constexpr int64_t n = kQuantBlock;
  constexpr bool kFloatParams =
      std::is_same<P, float>::value && std::is_same<G, float>::value && kMaster == MasterPrecision::None;
  P* __restrict__ param = static_cast<P*>(t.param) + block;
  const G* __restrict__ grad = static_cast<const G*>(t.grad) + block;
  uint8_t* m_codes = static_cast<uint8_t*>(t.exp_avg) + block;
  uint8_t* v_codes = static_cast<uint8_t*>(t.exp_avg_sq) + block;
  const int64_t b = block / kQuantBlock;
  alignas(64) float p[n];  // the parameters (masters) and gradients in fp32, unless kFloatParams
  alignas(64) float g[n];
  alignas(64) float m[n];
  alignas(64) float v[n];
  // bf16 parameters with a master and bf16 gradients: 16 at a time (MasterVectors, master_lanes.h);
  // other parameters through the scalar MasterWeight (a split8 master widened by MasterLanes).
  constexpr bool kMasterVectors = MasterVectors<P, kMaster>::kOn && std::is_same<G, bfloat16_t>::value;
  MasterLanes<kMasterVectors ? MasterPrecision::None : kMaster, n> lanes(t.master, block, block + n);
  using Master = MasterWeight<kMaster, P, typename decltype(lanes)::Lane>;
  void* block_master = kMasterVectors ? master_at<kMaster>(t.master, block) : lanes.lanes();
  uint16_t* const param_bits = reinterpret_cast<uint16_t*>(param);
  if constexpr (kMasterVectors) {
    for (int64_t i = 0; i < n; i += 16) {
      _mm512_store_ps(p + i, as_m512(MasterVectors<P, kMaster>::load(block_master, param_bits, i)));
      _mm512_store_ps(g + i, as_m512(load_float_lanes(grad + i)));
    }
  } else if constexpr (!kFloatParams) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      p[i] = Master::load(block_master, param, i);
      g[i] = load_float(grad + i);
    }
  }
  float* const p_lanes = kFloatParams ? reinterpret_cast<float*>(param) : p;
  const float* const g_lanes = kFloatParams ? reinterpret_cast<const float*>(grad) : g;
  const ScaledDecodeSteps steps =
      scaled_decode_steps(decode_factor(t.exp_avg_absmax[b]), decode_factor(t.exp_avg_sq_absmax[b]));
  // The largest magnitude bits of each moment, unfiltered: a maximum of 0x7f800000 or more says a
  // first moment is inf or NaN, or a second one too or negative; the scales then take a second look.
  __m512i m_most = _mm512_setzero_si512();
  __m512i v_most = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    Float16Lanes m16 = as_lanes(decode_signed(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m_codes + i))), steps));
    Float16Lanes v16 = as_lanes(decode_unsigned(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v_codes + i))), steps));
    Float16Lanes p16 = as_lanes(_mm512_loadu_ps(p_lanes + i));
    Float16Lanes unused = p16;
    adam_update<false>(p16, as_lanes(_mm512_loadu_ps(g_lanes + i)), m16, v16, unused, scale, s);
    _mm512_storeu_ps(p_lanes + i, as_m512(p16));
    _mm512_store_ps(m + i, as_m512(m16));
    _mm512_store_ps(v + i, as_m512(v16));
    m_most = _mm512_max_epu32(m_most, _mm512_and_si512(_mm512_castps_si512(as_m512(m16)), _mm512_set1_epi32(0x7fffffff)));
    v_most = _mm512_max_epu32(v_most, _mm512_castps_si512(as_m512(v16)));
  }
  if constexpr (kMasterVectors) {
    const uint32_t salt = split8_salt(*t.step);
    for (int64_t i = 0; i < n; i += 16) {
      MasterVectors<P, kMaster>::store(block_master, param_bits, i, as_lanes(_mm512_load_ps(p + i)), salt);
    }
  } else if constexpr (!kFloatParams) {
    const uint32_t salt = split8_salt(*t.step);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) Master::store(block_master, param, i, p[i], salt);
  }
  lanes.write_back();
  const uint32_t m_most_bits = static_cast<uint32_t>(_mm512_reduce_max_epu32(m_most));
  const uint32_t v_most_bits = static_cast<uint32_t>(_mm512_reduce_max_epu32(v_most));
  const bool members = m_most_bits < 0x7f800000u && v_most_bits < 0x7f800000u;  // all finite, v >= +0
  const float m_max = members ? bits_to_float(m_most_bits) : block_absmax(m, n);
  const float v_max = members ? bits_to_float(v_most_bits) : block_absmax(v, n);
  t.exp_avg_absmax[b] = m_max;
  t.exp_avg_sq_absmax[b] = v_max;
  const __m512 m_encode = _mm512_set1_ps(encode_factor(m_max));
  const __m512 v_encode = _mm512_set1_ps(encode_factor(v_max));
  if (members) {
    encode_block8_avx512<true>(m, v, m_encode, v_encode, m_codes, v_codes);
  } else {
    encode_block8_avx512<false>(m, v, m_encode, v_encode, m_codes, v_codes);
  }
}

static FUSEDOFF_AVX512_INLINE void run_avx512(const CompressedAdamTensorPtrs* tensor, int64_t begin, int64_t end,
                                              float grad_scale, const AdamScalars* scalars, uint32_t step_key) {
  if constexpr (kBlock8) {
    const CompressedAdamTensorPtrs& t = *tensor;
    const AdamScalars s = *scalars;  // a local copy: kept in registers (see adam_cpu.cpp)
    const float scale = kScaled ? grad_scale : 1.0f;
    for (int64_t block = begin; block < end; block += kQuantBlock) {
      const int64_t b = block / kQuantBlock;
      if (end - block >= kQuantBlock &&
          decodes_folded<true>(t.exp_avg_absmax[b], static_cast<const uint8_t*>(t.exp_avg) + block) &&
          decodes_folded<false>(t.exp_avg_sq_absmax[b], static_cast<const uint8_t*>(t.exp_avg_sq) + block)) {
        update_whole_block8_avx512(t, block, scale, s);
      } else {  // a tensor's last, partial block, or a scale too small to fold
        update_block8(t, block, std::min<int64_t>(kQuantBlock, end - block), scale, s);
      }
    }
  } else {
    run(tensor, begin, end, grad_scale, scalars, step_key);
  }
}
#endif

// Elements [begin, end) of one range (`begin` a multiple of kQuantBlock).
static FUSEDOFF_INLINE void run(const CompressedAdamTensorPtrs* tensor, int64_t begin, int64_t end, float grad_scale,
                                const AdamScalars* scalars, uint32_t step_key) {
  const CompressedAdamTensorPtrs& t = *tensor;
  const AdamScalars s = *scalars;  // a local copy: kept in registers (see adam_cpu.cpp)
  const float scale = kScaled ? grad_scale : 1.0f;
  if (kBlock8) {
    for (int64_t block = begin; block < end; block += kQuantBlock) {
      update_block8(t, block, std::min<int64_t>(kQuantBlock, end - block), scale, s);
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

using RangeFn = void (*)(const CompressedAdamTensorPtrs*, int64_t, int64_t, float, const AdamScalars*, uint32_t);

template <typename P, typename G, MasterPrecision kMaster, bool kScaled, bool kBlock8>
RangeFn select_range_fn() {
  return select_isa_variant<CompressedAdamRange<P, G, kMaster, kScaled, kBlock8>, const CompressedAdamTensorPtrs*,
                            int64_t, int64_t, float, const AdamScalars*, uint32_t>();
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
  for_each_block(launch.num_threads, split_into_blocks(launch.tensors, launch.num_tensors),
                 [&](int64_t, const WorkBlock& b) {
                   range_fn(&launch.tensors[b.tensor], b.begin, b.end, grad_scale, &scalars[b.tensor],
                            step_keys[b.tensor]);
                 });
}

}  // namespace fusedoff
