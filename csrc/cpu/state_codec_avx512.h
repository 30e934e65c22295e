// The 8-bit codes of state_codec.h, 16 lanes at a time in AVX-512: the same codes, bit for bit, in
// fewer instructions than the compiler makes of the scalar code (see 'CPU kernel tuning' in
// benchmarks/results/RESULTS.md). The tables below are derived from the maps' pieces
// (SignedMap, UnsignedMap), so the codec is still defined once, in state_codec.h;
// `torch.ops.fusedoff_testing.state_codec_selftest` (tests/test_compressed_states.py) compares these
// functions with the scalar ones over every fp32 bit pattern and every code.
//
// [note: the codec as float arithmetic]
// The scalar code rounds a binade's mantissa in integer arithmetic. The same code is a float
// computation: for q in the binade [2^(e-127), 2^(e-126)) of a piece with k mantissa bits,
//   code = round_to_nearest_even(q * 2^(k - (e - 127))) + base(e),
// where the product is exact (a power of two times q lands in [2^k, 2^(k+1)]) and the rounding to
// an integer rounds ties to the even integer, as the scalar rounding does (its integer u >> shift
// has the same parity). base(e) puts the binade's first code where the map has it, and a mantissa
// that rounds up to 2^(k+1) carries into the next binade's first code, as in the scalar code. Below
// the first piece the codes count steps of kSubnormalStep: the same form, with the scale of
// the first piece's lowest binade and base 0. So one lookup by exponent (32 entries, one two-source
// permute per table) gives scale and base. Values of 2 and more (never a finite member of a block,
// whose largest element maps to kCodeTop) and inf/NaN land on the largest code or above it, and the
// clamp to kMaxCode takes them, as in the scalar code; inf, NaN and (unsigned) negative values are
// then fixed up on a rare path.
// Decoding is the inverse: a code's value is (code - base) * 2^(e - 127 - k), exact, looked up by
// code / 4 (every binade's codes start at a multiple of 4), then times the block's decode factor, as
// in the scalar code.
#pragma once

#include <cstdint>

#include "fusedoff/state_codec.h"
#include "isa.h"

#if defined(FUSEDOFF_X86_DISPATCH)

// GCC 12 warns, wrongly, that the intrinsics' own undefined placeholders are read uninitialised
// (GCC bug 105593, fixed in GCC 13).
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace fusedoff {
namespace avx512_codec {

constexpr float power_of_two(int exponent) {
  float value = 1.0f;
  for (; exponent > 0; --exponent) value *= 2.0f;
  for (; exponent < 0; ++exponent) value *= 0.5f;
  return value;
}

constexpr uint32_t exponent_of(uint32_t bits) { return bits >> 23; }

// The piece (0 = lowest) holding the binade with biased exponent e; -1 below the first piece.
template <typename Map>
constexpr int piece_of_exponent(uint32_t e) {
  int piece = -1;
  for (int p = 0; p < Map::kPieces; ++p)
    if (e >= exponent_of(Map::piece(p).first_bits)) piece = p;
  return piece;
}

// The exponents an encode looks up: [kLowest, kLowest + 31], clamped; kLowest is the binade just
// below the first piece (the steps of the smallest code), the top is the binade [1, 2) of kCodeTop.
template <typename Map>
struct EncodeTable {
  static constexpr uint32_t kTop = 127;
  static constexpr uint32_t kLowest = exponent_of(Map::piece(0).first_bits) - 1;
  static_assert(kTop - kLowest <= 31, "one 32-entry lookup covers the map's exponents");
  float scale[32];
  int32_t base[32];
  constexpr EncodeTable() : scale(), base() {
    for (uint32_t e = kLowest; e <= kTop; ++e) {
      const int p = piece_of_exponent<Map>(e);
      const uint32_t slot = e & 31u;
      if (p < 0) {
        scale[slot] = Map::kSubnormalScale;
        base[slot] = 0;
        continue;
      }
      const CodePiece piece = Map::piece(p);
      const int k = 23 - static_cast<int>(piece.shift);
      const int binade = static_cast<int>(e - exponent_of(piece.first_bits));
      scale[slot] = power_of_two(k - (static_cast<int>(e) - 127));
      base[slot] = static_cast<int32_t>(piece.first_code) + (binade - 1) * (1 << k);
    }
  }
};

// Codes in groups of four (code >> 2), kGroups of them: the value of code c is (c - base) * step.
template <typename Map, int kGroups>
struct DecodeTable {
  float step[kGroups];
  int32_t base[kGroups];
  constexpr DecodeTable() : step(), base() {
    for (int g = 0; g < kGroups; ++g) {
      const uint32_t code = static_cast<uint32_t>(g) * 4u;
      int p = -1;
      for (int q = 0; q < Map::kPieces; ++q)
        if (code >= Map::piece(q).first_code) p = q;
      if (p < 0) {
        step[g] = Map::kSubnormalStep;
        base[g] = 0;
        continue;
      }
      const CodePiece piece = Map::piece(p);
      const int k = 23 - static_cast<int>(piece.shift);
      const int binade = static_cast<int>(code - piece.first_code) >> k;
      const int e = static_cast<int>(exponent_of(piece.first_bits)) + binade;
      step[g] = power_of_two(e - 127 - k);
      base[g] = static_cast<int32_t>(piece.first_code) + (binade - 1) * (1 << k);
    }
  }
};

inline constexpr EncodeTable<SignedMap> kSignedEncode{};
inline constexpr EncodeTable<UnsignedMap> kUnsignedEncode{};
inline constexpr DecodeTable<SignedMap, 32> kSignedDecode{};    // magnitudes 0..127
inline constexpr DecodeTable<UnsignedMap, 64> kUnsignedDecode{};  // codes 0..255

// Every code of a group of four lies in one binade (the groups above assume it).
template <typename Map>
constexpr bool binades_start_at_multiples_of_four() {
  for (int p = 0; p < Map::kPieces; ++p)
    if (Map::piece(p).first_code % 4 != 0 || Map::piece(p).shift > 21) return false;
  return true;
}
static_assert(binades_start_at_multiples_of_four<SignedMap>() && binades_start_at_multiples_of_four<UnsignedMap>());

// Table entries [32 * half, 32 * half + 32) at index & 31 (two-source permutes).
FUSEDOFF_AVX512_INLINE __m512 lookup(const float* table, __m512i index) {
  return _mm512_permutex2var_ps(_mm512_loadu_ps(table), index, _mm512_loadu_ps(table + 16));
}
FUSEDOFF_AVX512_INLINE __m512i lookup(const int32_t* table, __m512i index) {
  return _mm512_permutex2var_epi32(_mm512_loadu_si512(table), index, _mm512_loadu_si512(table + 16));
}

// The magnitude code of q >= 0 (magnitude_code<Map>), before the fix-ups of non-finite values.
template <typename Map>
FUSEDOFF_AVX512_INLINE __m512i magnitude_code(__m512 q, const EncodeTable<Map>& table) {
  using Table = EncodeTable<Map>;
  __m512i e = _mm512_srli_epi32(_mm512_castps_si512(q), 23);
  e = _mm512_min_epu32(_mm512_max_epu32(e, _mm512_set1_epi32(Table::kLowest)), _mm512_set1_epi32(Table::kTop));
  const __m512 scaled = _mm512_mul_ps(q, lookup(table.scale, e));
  // Out of range (2^31 and more, inf, NaN) gives 0x80000000, which the unsigned clamp takes.
  const __m512i rounded = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i code = _mm512_add_epi32(rounded, lookup(table.base, e));
  return _mm512_min_epu32(code, _mm512_set1_epi32(static_cast<int>(Map::kMaxCode)));
}

// encode_signed of 16 values, as 32-bit lanes.
FUSEDOFF_AVX512_INLINE __m512i encode_signed(__m512 x, __m512 encode_factor) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i magnitude_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  __m512i code = magnitude_code(_mm512_mul_ps(_mm512_castsi512_ps(magnitude_bits), encode_factor), kSignedEncode);
  const __mmask16 special = _mm512_cmpge_epu32_mask(magnitude_bits, _mm512_set1_epi32(0x7f800000));
  if (__builtin_expect(special != 0, 0)) {
    code = _mm512_mask_mov_epi32(code, special, _mm512_set1_epi32(kSignedInf));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude_bits, _mm512_set1_epi32(0x7f800000));
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(kSignedNan));
  }
  // code | ((bits >> 24) & 0x80)
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xf8);
}

// encode_unsigned of 16 values, as 32-bit lanes.
FUSEDOFF_AVX512_INLINE __m512i encode_unsigned(__m512 x, __m512 encode_factor) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i magnitude_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  __m512i code = magnitude_code(_mm512_mul_ps(_mm512_castsi512_ps(magnitude_bits), encode_factor), kUnsignedEncode);
  // A positive value never becomes 0: max(code, 1) where the magnitude is not 0.
  code = _mm512_mask_max_epu32(code, _mm512_test_epi32_mask(magnitude_bits, magnitude_bits), code,
                               _mm512_set1_epi32(1));
  // inf, NaN and every value with the sign bit (-0.0 included, whose code is 0)
  const __mmask16 special = _mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32(0x7f800000));
  if (__builtin_expect(special != 0, 0)) {
    code = _mm512_mask_mov_epi32(code, _mm512_cmpeq_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)),
                                 _mm512_set1_epi32(kUnsignedInf));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude_bits, _mm512_set1_epi32(0x7f800000)) |
                          _mm512_cmpgt_epu32_mask(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(kUnsignedNan));
  }
  return code;
}

// A block's decode factor times each table step, where each product is exact (a power of two times
// the factor, neither subnormal nor inf): then a code's value times the factor is one rounding of
// (code - base) * (step * factor), as decode's two multiplications give it (the first is exact).
struct ScaledDecodeSteps {
  __m512 signed_steps[2];
  __m512 unsigned_steps[4];
};

constexpr float kSmallestDecodeStep = 2.3283064365386962890625e-10f;  // 2^-32, UnsignedMap::kSubnormalStep
static_assert(SignedMap::kSubnormalStep >= kSmallestDecodeStep && UnsignedMap::kSubnormalStep >= kSmallestDecodeStep);

// Whether every step times `decode_factor` is a normal float. (No step is above 2^-5, so a product
// never overflows: a block's factor is finite.)
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE bool steps_scale_exactly(float decode_factor) {
  return decode_factor >= 1.17549435082228750797e-38f / kSmallestDecodeStep;
}

// The steps of both maps times the decode factors of a block's two moments.
FUSEDOFF_AVX512_INLINE ScaledDecodeSteps scaled_decode_steps(float signed_factor, float unsigned_factor) {
  ScaledDecodeSteps steps;
  for (int k = 0; k < 2; ++k)
    steps.signed_steps[k] = _mm512_mul_ps(_mm512_loadu_ps(kSignedDecode.step + 16 * k), _mm512_set1_ps(signed_factor));
  for (int k = 0; k < 4; ++k)
    steps.unsigned_steps[k] =
        _mm512_mul_ps(_mm512_loadu_ps(kUnsignedDecode.step + 16 * k), _mm512_set1_ps(unsigned_factor));
  return steps;
}

// The values of signed codes' magnitudes, times the block's factor (folded into the steps).
FUSEDOFF_AVX512_INLINE __m512 signed_magnitude(__m512i magnitude, __m512 step_low, __m512 step_high) {
  const __m512i group = _mm512_srli_epi32(magnitude, 2);
  const __m512i steps = _mm512_sub_epi32(magnitude, lookup(kSignedDecode.base, group));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(steps), _mm512_permutex2var_ps(step_low, group, step_high));
}

// The sign, inf and NaN of signed codes on their magnitudes' values.
FUSEDOFF_AVX512_INLINE __m512 finish_signed(__m512i code, __m512i magnitude, __m512 value_of_magnitude) {
  __m512i value = _mm512_castps_si512(value_of_magnitude);
  const __mmask16 special = _mm512_cmpge_epu32_mask(magnitude, _mm512_set1_epi32(kSignedInf));
  if (__builtin_expect(special != 0, 0)) {
    value = _mm512_mask_mov_epi32(value, special, _mm512_set1_epi32(0x7f800000));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(kSignedNan));
    value = _mm512_mask_mov_epi32(value, nan, _mm512_set1_epi32(0x7fc00000));
  }
  // value | ((code << 24) & 0x80000000)
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(value, _mm512_slli_epi32(code, 24),
                                                       _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xf8));
}

// decode_signed of 16 codes given as 32-bit lanes, the block's factor folded into the steps
// (steps_scale_exactly).
FUSEDOFF_AVX512_INLINE __m512 decode_signed(__m512i code, const ScaledDecodeSteps& steps) {
  const __m512i magnitude = _mm512_and_si512(code, _mm512_set1_epi32(0x7f));
  return finish_signed(code, magnitude, signed_magnitude(magnitude, steps.signed_steps[0], steps.signed_steps[1]));
}

FUSEDOFF_AVX512_INLINE __m512 unsigned_value(__m512i code, const __m512* step_table) {
  const __m512i group = _mm512_srli_epi32(code, 2);  // 0..63: the upper half of the table where bit 5 is set
  const __mmask16 upper = _mm512_test_epi32_mask(group, _mm512_set1_epi32(32));
  const __m512i base = _mm512_mask_blend_epi32(upper, lookup(kUnsignedDecode.base, group),
                                               lookup(kUnsignedDecode.base + 32, group));
  const __m512 step = _mm512_mask_blend_ps(upper, _mm512_permutex2var_ps(step_table[0], group, step_table[1]),
                                           _mm512_permutex2var_ps(step_table[2], group, step_table[3]));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(code, base)), step);
}

// A positive code never decodes to 0 (underflow), inf, NaN.
FUSEDOFF_AVX512_INLINE __m512 finish_unsigned(__m512i code, __m512 scaled_value) {
  __m512i value = _mm512_castps_si512(scaled_value);
  value = _mm512_mask_max_epu32(value, _mm512_test_epi32_mask(code, code), value, _mm512_set1_epi32(1));
  const __mmask16 special = _mm512_cmpge_epu32_mask(code, _mm512_set1_epi32(kUnsignedInf));
  if (__builtin_expect(special != 0, 0)) {
    value = _mm512_mask_mov_epi32(value, special, _mm512_set1_epi32(0x7f800000));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(kUnsignedNan));
    value = _mm512_mask_mov_epi32(value, nan, _mm512_set1_epi32(0x7fc00000));
  }
  return _mm512_castsi512_ps(value);
}

// decode_unsigned of 16 codes given as 32-bit lanes, the block's factor folded into the steps
// (steps_scale_exactly).
FUSEDOFF_AVX512_INLINE __m512 decode_unsigned(__m512i code, const ScaledDecodeSteps& steps) {
  return finish_unsigned(code, unsigned_value(code, steps.unsigned_steps));
}

// ---- encoding the members of a block ----------------------------------------------------------------
// Where every value of a block is finite (second moments: and not negative, -0.0 included), each
// value's q = |x| * encode_factor(absmax) is at most kCodeTop times two roundings up, below
// kBlockMemberLimit, the midpoint between the top code (kCodeTop) and the value after it. Then the
// exponent needs no upper clamp, the code no clamp to kMaxCode, and no value a fix-up.
constexpr float kBlockMemberLimit = kCodeTop + 0.015625f;  // + 2^-6: half a step of the binade [1, 2)
FUSEDOFF_AVX512_INLINE __m512i block_member_code(__m512 q, const float* scale_table, const int32_t* base_table,
                                                 uint32_t lowest_exponent) {
  const __m512i e = _mm512_max_epu32(_mm512_srli_epi32(_mm512_castps_si512(q), 23), _mm512_set1_epi32(static_cast<int>(lowest_exponent)));
  const __m512 scaled = _mm512_mul_ps(q, lookup(scale_table, e));
  const __m512i rounded = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_add_epi32(rounded, lookup(base_table, e));
}

// encode_signed of finite x with |x| * encode_factor < kBlockMemberLimit.
FUSEDOFF_AVX512_INLINE __m512i encode_signed_block_member(__m512 x, __m512 encode_factor) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512 q = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff))), encode_factor);
  const __m512i code = block_member_code(q, kSignedEncode.scale, kSignedEncode.base, EncodeTable<SignedMap>::kLowest);
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xf8);
}

// encode_unsigned of finite x >= +0 with x * encode_factor < kBlockMemberLimit.
FUSEDOFF_AVX512_INLINE __m512i encode_unsigned_block_member(__m512 x, __m512 encode_factor) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i code = block_member_code(_mm512_mul_ps(x, encode_factor), kUnsignedEncode.scale, kUnsignedEncode.base,
                                         EncodeTable<UnsignedMap>::kLowest);
  return _mm512_mask_max_epu32(code, _mm512_test_epi32_mask(bits, bits), code, _mm512_set1_epi32(1));
}

}  // namespace avx512_codec
}  // namespace fusedoff

#endif  // FUSEDOFF_X86_DISPATCH
