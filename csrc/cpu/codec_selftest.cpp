// The proof that state_codec_avx512.h gives state_codec.h's codes: every fp32 bit pattern encoded
// (both maps, several block factors) and every code decoded (under factors across the whole fp32
// range), each compared bit for bit with the scalar functions.
#include <omp.h>

#include <cstdint>

#include "fusedoff/launchers.h"
#include "isa.h"
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
  }
}

// Decodes all 256 codes under `factor`, both ways.
FUSEDOFF_TARGET_AVX512 void decode_all_codes(float factor, int64_t& signed_off, int64_t& unsigned_off) {
  const __m512 factors = _mm512_set1_ps(factor);
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
    signed_off += lanes_off(_mm512_castps_si512(avx512_codec::decode_signed(code, factors)), signed_values);
    unsigned_off += lanes_off(_mm512_castps_si512(avx512_codec::decode_unsigned(code, factors)), unsigned_values);
  }
}
#endif

}  // namespace

StateCodecSelftest state_codec_selftest(int num_threads) {
  StateCodecSelftest r{};
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
  // smallest subnormals to the largest finite), and of 0.
  signed_off = 0;
  unsigned_off = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(+ : signed_off, unsigned_off)
  for (int64_t scale = 0; scale < (int64_t{0x7f800000} >> 12); ++scale)
    decode_all_codes(decode_factor(bits_to_float(static_cast<uint32_t>(scale) << 12)), signed_off, unsigned_off);
  r.decode_signed_off = signed_off;
  r.decode_unsigned_off = unsigned_off;
#else
  (void)num_threads;
#endif
  return r;
}

}  // namespace fusedoff
