// The proof that state_codec_avx512.h gives state_codec.h's codes: every fp32 bit pattern encoded
// (both maps; the forms for a block's members on every value they are given) and every code decoded
// (under block factors across the whole fp32 range, folded into the steps where that is exact), each
// compared bit for bit with the scalar functions.
#include <omp.h>

#include <cstdint>

#include "isa.h"
#include "selftests.h"
#include "state_codec_avx512.h"

namespace fusedoff {
namespace {

#if defined(FUSEDOFF_X86_DISPATCH)
// Lanes of `vector` that differ from `expected` (both 16 x 32 bits).
FUSEDOFF_AVX512_INLINE int64_t lanes_off(__m512i vector, const uint32_t* expected) {
  return __builtin_popcount(_mm512_cmpneq_epi32_mask(vector, _mm512_loadu_si512(expected)));
}

// Encodes the 2^16 fp32 values whose upper half is `high`, under `factor`, both ways.
FUSEDOFF_TARGET_AVX512 void encode_upper_half(uint32_t high, float factor, int64_t& signed_off, int64_t& unsigned_off) {
  const __m512 factors = _mm512_set1_ps(factor);
  alignas(64) uint32_t bits[16];
  alignas(64) uint32_t signed_codes[16];
  alignas(64) uint32_t unsigned_codes[16];
  for (uint32_t low = 0; low < 65536; low += 16) {
    for (uint32_t lane = 0; lane < 16; ++lane) {
      bits[lane] = (high << 16) | (low + lane);
      signed_codes[lane] = encode_signed(bits_to_float(bits[lane]), factor);
      unsigned_codes[lane] = encode_unsigned(bits_to_float(bits[lane]), factor);
    }
    const __m512 x = _mm512_castsi512_ps(_mm512_load_si512(bits));
    signed_off += lanes_off(avx512_codec::encode_signed(x, factors), signed_codes);
    unsigned_off += lanes_off(avx512_codec::encode_unsigned(x, factors), unsigned_codes);
    // The forms for a block's members, on every value they take: q < kBlockMemberLimit (and,
    // unsigned, x >= +0).
    const __mmask16 member = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_abs_ps(x), factors),
                                                _mm512_set1_ps(avx512_codec::kBlockMemberLimit), _CMP_LT_OQ);
    const __mmask16 positive = _mm512_cmplt_epu32_mask(_mm512_castps_si512(x), _mm512_set1_epi32(0x7f800000));
    const __m512i expected_signed = _mm512_load_si512(signed_codes);
    const __m512i expected_unsigned = _mm512_load_si512(unsigned_codes);
    signed_off += __builtin_popcount(
        _mm512_mask_cmpneq_epi32_mask(member, avx512_codec::encode_signed_block_member(x, factors), expected_signed));
    unsigned_off += __builtin_popcount(_mm512_mask_cmpneq_epi32_mask(
        member & positive, avx512_codec::encode_unsigned_block_member(x, factors), expected_unsigned));
  }
}

// Decodes all 256 codes under `factor`, one whose steps scale exactly, both ways; with `zero_scale`
// (the factor of a block whose scale is 0) only the codes such a block has: 0 (and -0) and the
// non-finite ones.
FUSEDOFF_TARGET_AVX512 void decode_all_codes(float factor, bool zero_scale, int64_t& signed_off,
                                             int64_t& unsigned_off) {
  alignas(64) uint32_t codes[16];
  alignas(64) uint32_t signed_values[16];
  alignas(64) uint32_t unsigned_values[16];
  for (uint32_t first = 0; first < 256; first += 16) {
    for (uint32_t lane = 0; lane < 16; ++lane) {
      codes[lane] = first + lane;
      signed_values[lane] = float_to_bits(decode_signed(static_cast<uint8_t>(codes[lane]), factor));
      unsigned_values[lane] = float_to_bits(decode_unsigned(static_cast<uint8_t>(codes[lane]), factor));
    }
    const __m512i code = _mm512_load_si512(codes);
    const avx512_codec::ScaledDecodeSteps steps = avx512_codec::scaled_decode_steps(factor, factor);
    const __mmask16 all = 0xffff;
    const __mmask16 signed_lanes = zero_scale ? _mm512_cmpeq_epi32_mask(_mm512_and_si512(code, _mm512_set1_epi32(0x7f)), _mm512_setzero_si512()) |
                                                    _mm512_cmpge_epu32_mask(_mm512_and_si512(code, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(kSignedInf))
                                              : all;
    const __mmask16 unsigned_lanes = zero_scale ? _mm512_cmpeq_epi32_mask(code, _mm512_setzero_si512()) |
                                                      _mm512_cmpge_epu32_mask(code, _mm512_set1_epi32(kUnsignedInf))
                                                : all;
    signed_off += __builtin_popcount(_mm512_mask_cmpneq_epi32_mask(
        signed_lanes, _mm512_castps_si512(avx512_codec::decode_signed(code, steps)), _mm512_load_si512(signed_values)));
    unsigned_off += __builtin_popcount(_mm512_mask_cmpneq_epi32_mask(
        unsigned_lanes, _mm512_castps_si512(avx512_codec::decode_unsigned(code, steps)), _mm512_load_si512(unsigned_values)));
  }
}
#endif

}  // namespace

selftests::StateCodec selftests::state_codec(int num_threads) {
  StateCodec r{};
#if defined(FUSEDOFF_X86_DISPATCH)
  if (current_isa() != Isa::Avx512) return r;
  r.checked = true;
  // q = |x| * factor: factor 1 gives every q itself (the factor's multiplication is the same one
  // instruction in both); a second factor, on every 16th upper half, checks that it is applied.
  int64_t signed_off = 0, unsigned_off = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(+ : signed_off, unsigned_off)
  for (int64_t high = 0; high < 65536; ++high) {
    encode_upper_half(static_cast<uint32_t>(high), 1.0f, signed_off, unsigned_off);
    if (high % 16 == 5) encode_upper_half(static_cast<uint32_t>(high), encode_factor(3.0e-3f), signed_off, unsigned_off);
  }
  r.encode_signed_off = signed_off;
  r.encode_unsigned_off = unsigned_off;
  // The decode factor of every block scale whose bits end in 12 zeros (2^19 scales, 0 and the
  // smallest subnormals to the largest finite) that the kernels decode in AVX-512: 0, or one whose
  // steps scale exactly (the others take the scalar code).
  signed_off = 0;
  unsigned_off = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(+ : signed_off, unsigned_off)
  for (int64_t scale = 0; scale < (int64_t{0x7f800000} >> 12); ++scale) {
    const float factor = decode_factor(bits_to_float(static_cast<uint32_t>(scale) << 12));
    if (scale == 0 || avx512_codec::steps_scale_exactly(factor)) decode_all_codes(factor, scale == 0, signed_off, unsigned_off);
  }
  r.decode_signed_off = signed_off;
  r.decode_unsigned_off = unsigned_off;
#else
  (void)num_threads;
#endif
  return r;
}

}  // namespace fusedoff
