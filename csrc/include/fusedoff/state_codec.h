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
// finite magnitude in it. Its codes are a companded map of q = |x| * kCodeTop / scale, which
// puts the block's largest element on the top code, kCodeTop = 1 + 29/32: a tapered float, each
// binade [2^e, 2^(e+1)) of q split linearly into 2^bits steps, with more bits near the block's
// maximum and fewer far below it, rounded to nearest even (the code of the nearest value; ties
// to the even code). A code reads back as its value * scale / kCodeTop.
//   first moments (signed, 1 sign bit and codes 0..125; 0x7e inf, 0x7f NaN): 5 bits for q in
//     [1, 1 + 29/32], 4 bits in [2^-2, 1), 3 in [2^-4, 2^-2), 2 in [2^-15, 2^-4), and steps of
//     2^-17 below 2^-15 (codes 0..3).
//   second moments (unsigned, codes 0..253; 0xfe inf, 0xff NaN, also for a negative value, which
//     a second moment never is): 5 bits in [2^-1, 1 + 29/32], 4 in [2^-7, 2^-1), 2 in
//     [2^-30, 2^-7), and steps of 2^-32 below. A positive value never becomes 0: what would round
//     to 0 takes code 1, and a nonzero code never decodes to 0 (an underflow reads as the smallest
//     fp32 subnormal), so no denominator sqrt(v) + eps is ever smaller than the fp32 one by more
//     than the rounding.
// Why this shape: an update divides the first moment by the square root of the second, so its
// error is about the first moment's absolute error plus half the second's relative error. Codes
// near the block's maximum carry most of the update (5 and 4 bits: 2^-6 and 2^-5 relative, where
// the float-like codes of version 1 gave 2^-4), while the long 2-bit tail keeps moments 10^5
// (first) and 10^9 (second) below the maximum alive. The update error this gives, beside
// torchao's and bitsandbytes' 8-bit maps, is in benchmarks/results/RESULTS.md
// (bench_state_precision). fusedoff/kernels/codec.py keeps version 1's decoders, to read the
// checkpoints that map wrote (a state dict records its codec version).
// The codec is branch-free integer code (a compare and two selects per piece, one variable
// shift) and has one fp32 rounding per direction besides the block's two factors, which are
// correctly rounded divisions made once per block: q = |x| * encode_factor and value =
// decode(code) * decode_factor. No product feeds an addition except by a power of two, so a
// compiler that contracts multiply-adds into FMAs (Triton's) cannot change a code. The scale is
// raised to 2^-126 where the block's largest value is smaller (kCodeTop / scale stays finite).
// Non-finite values keep their own code and do not enter the scale, so a NaN or inf stays in its
// element, as in fp32 mode.
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
// (On U = uint32_t, or on a vector of them where the host kernels hash 16 lanes at once.)
template <typename U>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE U mix32_lanes(U x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t mix32(uint32_t x) { return mix32_lanes(x); }

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
// A map is a tapered float (see the note): `Map::piece(p)`, p = 0 the lowest, gives for the values
// q whose fp32 bits are >= first_bits (and below the next piece's) the shift that keeps the piece's
// mantissa bits and the bias that makes its codes follow the piece below it; under pieces 0's first
// binade the codes count steps of 2^-kSubnormalExponent. Rounding to nearest even carries from the
// top of a piece into the first code of the next, which is the value it rounded to.
struct CodePiece {
  uint32_t first_bits;  // fp32 bits of the piece's smallest value
  uint32_t first_code;
  uint32_t shift;  // 23 - mantissa bits
  uint32_t bias;   // code = (exponent << mantissa bits | mantissa) - bias
  // Rounding to nearest even then subtracting the bias: code = (u + round_offset + lsb) >> shift.
  FUSEDOFF_HOST_DEVICE constexpr uint32_t round_offset() const {
    return (1u << (shift - 1u)) - 1u - (bias << shift);
  }
};

// Both maps put the block's scale on the code value kCodeTop (1 + 29/32, the top code of a binade
// [1, 2) with 5 mantissa bits whose codes end 2 below 256): q = |x| * kCodeTop / scale.
constexpr float kCodeTop = 1.90625f;
// The scale of a block: its largest finite magnitude, raised to the smallest normal fp32 so that
// kCodeTop / scale stays finite.
constexpr float kMinCodeScale = 1.17549435082228750797e-38f;  // 2^-126

// First moments, signed: 7 magnitude bits, codes 0..125 (0x7e inf, 0x7f NaN, 0x80 the sign).
// Binades [2^-j, 2^(1-j)) of q: j = 0 5 mantissa bits (codes 96..125), j = 1..2 4 bits, j = 3..4
// 3 bits, j = 5..15 2 bits, below 2^-15 steps of 2^-17 (codes 0..3).
struct SignedMap {
  static constexpr int kPieces = 4;
  static constexpr uint32_t kMaxCode = 125;
  static constexpr float kSubnormalScale = 131072.0f;               // 2^17
  static constexpr float kSubnormalStep = 7.62939453125e-06f;       // 2^-17
  FUSEDOFF_HOST_DEVICE static constexpr CodePiece piece(int p) {
    return p == 0   ? CodePiece{112u << 23, 4u, 21u, (112u << 2) - 4u}
           : p == 1 ? CodePiece{123u << 23, 48u, 20u, (123u << 3) - 48u}
           : p == 2 ? CodePiece{125u << 23, 64u, 19u, (125u << 4) - 64u}
                    : CodePiece{127u << 23, 96u, 18u, (127u << 5) - 96u};
  }
};

// Second moments, unsigned: codes 0..253 (0xfe inf, 0xff NaN). j = 0..1 5 mantissa bits (codes
// 192..253), j = 2..7 4 bits, j = 8..30 2 bits, below 2^-30 steps of 2^-32 (codes 0..3).
struct UnsignedMap {
  static constexpr int kPieces = 3;
  static constexpr uint32_t kMaxCode = 253;
  static constexpr float kSubnormalScale = 4294967296.0f;                   // 2^32
  static constexpr float kSubnormalStep = 2.3283064365386962890625e-10f;    // 2^-32
  FUSEDOFF_HOST_DEVICE static constexpr CodePiece piece(int p) {
    return p == 0   ? CodePiece{97u << 23, 4u, 21u, (97u << 2) - 4u}
           : p == 1 ? CodePiece{120u << 23, 96u, 19u, (120u << 4) - 96u}
                    : CodePiece{126u << 23, 192u, 18u, (126u << 5) - 192u};
  }
};

// The per-block factors: q = |x| * encode_factor, value = decode(code) * decode_factor.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float code_scale(float absmax) {
  return absmax > kMinCodeScale ? absmax : kMinCodeScale;
}
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float encode_factor(float absmax) { return kCodeTop / code_scale(absmax); }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float decode_factor(float absmax) { return code_scale(absmax) / kCodeTop; }

// The code of q >= 0 (at most kMaxCode; inf and NaN give some code). Branch-free: each piece is a compare and two
// selects, then one variable shift.
template <typename Map>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t magnitude_code(float q) {
  const uint32_t u = float_to_bits(q);
  uint32_t shift = Map::piece(0).shift;
  uint32_t offset = Map::piece(0).round_offset();
  for (int p = 1; p < Map::kPieces; ++p) {
    const bool in = u >= Map::piece(p).first_bits;
    shift = in ? Map::piece(p).shift : shift;
    offset = in ? Map::piece(p).round_offset() : offset;
  }
  // ((u + half - 1 + lsb) >> shift) - bias, the bias folded into the offset (mod 2^32: in the piece
  // the sum does not wrap; outside it the result is not taken).
  const uint32_t normal = (u + offset + ((u >> shift) & 1u)) >> shift;
  // Below the first piece: an integer count of the smallest step, rounded to nearest even by the
  // fp32 addition of 2^23 (the scaling by a power of two is exact).
  const uint32_t subnormal = float_to_bits(q * Map::kSubnormalScale + 8388608.0f) - 0x4b000000u;
  const uint32_t code = u >= Map::piece(0).first_bits ? normal : subnormal;
  return code < Map::kMaxCode ? code : Map::kMaxCode;
}

// The value of magnitude code `c` <= kMaxCode, before the block's decode factor.
template <typename Map>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float magnitude_value(uint32_t c) {
  uint32_t shift = Map::piece(0).shift;
  uint32_t bias = Map::piece(0).bias;
  for (int p = 1; p < Map::kPieces; ++p) {
    const bool in = c >= Map::piece(p).first_code;
    shift = in ? Map::piece(p).shift : shift;
    bias = in ? Map::piece(p).bias : bias;
  }
  const float normal = bits_to_float((c + bias) << shift);
  const float subnormal = static_cast<float>(c) * Map::kSubnormalStep;
  return c >= Map::piece(0).first_code ? normal : subnormal;
}

// Signed codes (first moments).
constexpr uint32_t kSignedNan = 0x7fu;
constexpr uint32_t kSignedInf = 0x7eu;

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint8_t encode_signed(float x, float encode_factor) {
  const uint32_t bits = float_to_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  // inf and NaN make q inf or NaN, whose code is replaced below.
  uint32_t code = magnitude_code<SignedMap>(bits_to_float(magnitude_bits) * encode_factor);
  code = magnitude_bits == 0x7f800000u ? kSignedInf : code;
  code = magnitude_bits > 0x7f800000u ? kSignedNan : code;
  return static_cast<uint8_t>(code | sign);
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float decode_signed(uint8_t code, float decode_factor) {
  const uint32_t magnitude = code & 0x7fu;
  uint32_t value = float_to_bits(magnitude_value<SignedMap>(magnitude) * decode_factor);
  value = magnitude == kSignedInf ? 0x7f800000u : value;
  value = magnitude == kSignedNan ? 0x7fc00000u : value;
  return bits_to_float(value | (static_cast<uint32_t>(code & 0x80u) << 24));
}

// Unsigned codes (second moments).
constexpr uint32_t kUnsignedNan = 0xffu;
constexpr uint32_t kUnsignedInf = 0xfeu;

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint8_t encode_unsigned(float x, float encode_factor) {
  const uint32_t bits = float_to_bits(x);
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  uint32_t code = magnitude_code<UnsignedMap>(bits_to_float(magnitude_bits) * encode_factor);
  code = (code == 0 && magnitude_bits != 0) ? 1u : code;  // positive stays positive
  code = magnitude_bits == 0x7f800000u ? kUnsignedInf : code;
  // NaN, -inf and negative values (never a second moment): NaN. -0.0 is 0.
  code = (magnitude_bits > 0x7f800000u || bits > 0x80000000u) ? kUnsignedNan : code;
  return static_cast<uint8_t>(code);
}

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float decode_unsigned(uint8_t code, float decode_factor) {
  const uint32_t c = code;
  uint32_t value = float_to_bits(magnitude_value<UnsignedMap>(c) * decode_factor);
  value = (c != 0 && value == 0) ? 1u : value;  // a positive code never decodes to 0 (underflow)
  value = c == kUnsignedInf ? 0x7f800000u : value;
  value = c == kUnsignedNan ? 0x7fc00000u : value;
  return bits_to_float(value);
}

// A block's scale contribution of one value: its magnitude if finite, else 0.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float finite_magnitude(float x) {
  const uint32_t magnitude_bits = float_to_bits(x) & 0x7fffffffu;
  return magnitude_bits < 0x7f800000u ? bits_to_float(magnitude_bits) : 0.0f;
}

}  // namespace fusedoff
