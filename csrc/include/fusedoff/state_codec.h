// Compressed optimizer states, written once for every backend. ATen-free.
//
// [note: compressed states]
// With state_precision != "fp32" the moment states are stored compressed and decoded in registers;
// the update math (adam.h) runs in fp32 as always, and the results are encoded in the same pass.
//
// "bf16": each state is a bf16 tensor, written with stochastic rounding: the fp32 bit pattern plus
// 16 random bits, truncated to its upper half, rounds the magnitude up with probability equal to
// the dropped fraction, so a stored value is unbiased (E[stored] = fp32 value) and small EMA
// increments are not lost, as they would be with round-to-nearest. NaN stays NaN, inf stays inf.
//
// The random bits come from a counter-based stream: `rounding_bits(step_key, index)` is a hash
// of the element's index in its tensor and of a per-tensor, per-step key
// (`rounding_step_key(tensor_key, step)`, with tensor_key derived on the host from the optimizer's
// seed and the parameter's position, see fusedoff/kernels/codec.py). No state is kept: a chunk of
// a streamed tensor draws the same bits as the resident tensor, on any backend. One 32-bit draw
// serves both moments: its low half rounds exp_avg, its high half exp_avg_sq.
//
// "8bit": each state is a uint8 code per element plus one fp32 scale (`absmax`) per block of
// kQuantBlock elements, counted from the tensor's first element. A block's scale is the largest
// finite magnitude in it; an element is stored as the code of x / absmax (a correctly rounded
// division) and read back as decode(code) * absmax. Codes are 8-bit floats, rounded to nearest even:
//   first moments (signed):   1 sign, 4 exponent, 3 mantissa bits; |q| from 2^-17 to 1 (1.0 is
//     code 0x78). It is float8_e4m3fn of q * 2^8 (the codes above 1.0 are unused); 0x7e is +inf,
//     0xfe -inf, 0x7f/0xff NaN.
//   second moments (unsigned): 5 exponent, 3 mantissa bits; q from 2^-33 to 1 (1.0 is code 0xf8);
//     0xfe is +inf, 0xff NaN (also for a negative value, which a second moment never is). A
//     positive value never becomes 0: what would round to 0 takes the smallest code, 2^-33, so no
//     denominator sqrt(v) + eps is ever smaller than the fp32 one by more than the rounding.
// Relative error: at most 2^-4 of the value for normal codes (3 mantissa bits, half a step), and
// at most half the smallest step (2^-18 or 2^-34 of absmax) below them; the block's largest element
// is exact. Non-finite values keep their own code and do not enter the scale, so a NaN or inf
// stays in its element, as in fp32 mode.
#pragma once

#include <cstdint>

#include "fusedoff/dtypes.h"
#include "fusedoff/macros.h"

namespace fusedoff {

constexpr int kQuantBlock = 256;  // elements per 8-bit scale

enum class StatePrecision : int { Float32 = 0, BFloat16 = 1, Block8 = 2 };

// ---- the counter-based random stream ----------------------------------------------------------
// A bijective 32-bit mixer (xor-shift / multiply, "lowbias32"): consecutive inputs give
// uncorrelated outputs.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The key of one tensor at one step (`step` the count after this step's increment).
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t rounding_step_key(uint32_t tensor_key, uint32_t step) {
  return mix32(tensor_key ^ mix32(step));
}

// The key of the 2^32 indices that share the high half of `index` (a loop over a range of indices
// computes it once and then only 32-bit arithmetic per element).
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t rounding_span_key(uint32_t step_key, int64_t index) {
  return step_key ^ (static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32) * 0x9e3779b9u);
}

// 32 random bits for the element whose index has low half `index_low`, under its span's key.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t rounding_bits_in_span(uint32_t span_key, uint32_t index_low) {
  return mix32(index_low ^ span_key);
}

// 32 random bits for element `index` of the tensor.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t rounding_bits(uint32_t step_key, int64_t index) {
  return rounding_bits_in_span(rounding_span_key(step_key, index), static_cast<uint32_t>(index));
}

// ---- bf16 with stochastic rounding --------------------------------------------------------------
// `random16` in [0, 65536).
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint16_t float_to_bf16_stochastic(float value, uint32_t random16) {
  const uint32_t u = float_to_bits(value);
  const uint32_t nan = (u >> 16) | 0x0040u;  // quiet, as round-to-nearest makes it
  const uint32_t rounded = (u + random16) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// ---- 8-bit codes --------------------------------------------------------------------------------
// |q| rounded to nearest even on a grid of 3 mantissa bits: `bias_bits` is (127 - exponent of the
// smallest normal + 1) << 3 in fp32's exponent-and-mantissa bits shifted right by 20, and
// `subnormal_scale` 2^(3 - exponent of the smallest normal). The code of the magnitude.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t magnitude_code(float magnitude, uint32_t min_normal_bits,
                                                             uint32_t bias_bits, float subnormal_scale) {
  const uint32_t u = float_to_bits(magnitude);
  const uint32_t normal = ((u + 0x7ffffu + ((u >> 20) & 1u)) >> 20) - bias_bits;
  // Below the smallest normal: an integer count of the smallest step, rounded to nearest even by
  // the fp32 addition of 2^23 (the scaling by a power of two is exact).
  const uint32_t subnormal = float_to_bits(magnitude * subnormal_scale + 8388608.0f) - 0x4b000000u;
  return u >= min_normal_bits ? normal : subnormal;
}

// Signed codes (first moments): q = x / absmax in [-1, 1].
constexpr uint32_t kSignedNan = 0x7fu;
constexpr uint32_t kSignedInf = 0x7eu;

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint8_t encode_signed(float x, float absmax) {
  const uint32_t bits = float_to_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  const float q = bits_to_float(magnitude_bits) / (absmax > 0.0f ? absmax : 1.0f);
  // Smallest normal 2^-14: exponent bits 113 << 23; 113 << 3 less one field = 112 << 3.
  uint32_t code = magnitude_code(q, 113u << 23, 112u << 3, 131072.0f /* 2^17 */);
  code = magnitude_bits == 0x7f800000u ? kSignedInf : code;
  code = magnitude_bits > 0x7f800000u ? kSignedNan : code;
  return static_cast<uint8_t>(code | sign);
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float decode_signed(uint8_t code, float absmax) {
  const uint32_t magnitude = code & 0x7fu;
  const uint32_t field = magnitude >> 3;
  const uint32_t mantissa = magnitude & 7u;
  const float normal = bits_to_float(((field + 112u) << 23) | (mantissa << 20));
  const float subnormal = static_cast<float>(mantissa) * 7.62939453125e-06f;  // 2^-17
  float value = (field != 0 ? normal : subnormal) * absmax;
  value = magnitude == kSignedInf ? bits_to_float(0x7f800000u) : value;
  value = magnitude == kSignedNan ? bits_to_float(0x7fc00000u) : value;
  return bits_to_float(float_to_bits(value) | (static_cast<uint32_t>(code & 0x80u) << 24));
}

// Unsigned codes (second moments): q = x / absmax in [0, 1].
constexpr uint32_t kUnsignedNan = 0xffu;
constexpr uint32_t kUnsignedInf = 0xfeu;

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint8_t encode_unsigned(float x, float absmax) {
  const uint32_t bits = float_to_bits(x);
  const float q = bits_to_float(bits & 0x7fffffffu) / (absmax > 0.0f ? absmax : 1.0f);
  // Smallest normal 2^-30: exponent bits 97 << 23; 97 << 3 less one field = 96 << 3.
  uint32_t code = magnitude_code(q, 97u << 23, 96u << 3, 8589934592.0f /* 2^33 */);
  code = (code == 0 && (bits & 0x7fffffffu) != 0) ? 1u : code;  // positive stays positive
  code = (bits & 0x7fffffffu) == 0x7f800000u ? kUnsignedInf : code;
  // NaN, -inf and negative values (never a second moment): NaN. -0.0 is 0.
  code = ((bits & 0x7fffffffu) > 0x7f800000u || (bits > 0x80000000u)) ? kUnsignedNan : code;
  return static_cast<uint8_t>(code);
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float decode_unsigned(uint8_t code, float absmax) {
  const uint32_t c = code;
  const uint32_t field = c >> 3;
  const uint32_t mantissa = c & 7u;
  const float normal = bits_to_float(((field + 96u) << 23) | (mantissa << 20));
  const float subnormal = static_cast<float>(mantissa) * 1.16415321826934814453125e-10f;  // 2^-33
  float value = (field != 0 ? normal : subnormal) * absmax;
  value = c == kUnsignedInf ? bits_to_float(0x7f800000u) : value;
  value = c == kUnsignedNan ? bits_to_float(0x7fc00000u) : value;
  return value;
}

// A block's scale contribution of one value: its magnitude if finite, else 0.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float finite_magnitude(float x) {
  const uint32_t magnitude_bits = float_to_bits(x) & 0x7fffffffu;
  return magnitude_bits < 0x7f800000u ? bits_to_float(magnitude_bits) : 0.0f;
}

}  // namespace fusedoff
