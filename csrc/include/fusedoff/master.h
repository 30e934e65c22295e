// Master weights, written once for every backend. ATen-free.
//
// [note: split master weights]
// A low-precision parameter keeps an fp32 master weight, which the update reads and writes; the
// parameter receives the master's rounding. `master_precision` says how the master is stored:
//   "fp32":   the whole fp32 value (4 bytes per element).
//   "split":  its low 16 bits only (2 bytes); the bf16 parameter is its upper half. Exact.
//   "split8": 8 bits (1 byte); the master is first rounded, stochastically, to 24 bits. Lossy.
//
// Why exact needs ties away from zero. With the parameter as the master rounded to nearest *even*,
// an even bf16 value u is the rounding of 2^16 + 1 fp32 values (its two ties both round to it),
// which no 16 bits tell apart. Rounded to nearest with ties away from zero, every bf16 value is the
// rounding of exactly 2^16 fp32 values: the 2^15 whose bits are u's with low half 0x0000-0x7fff,
// and the 2^15 below them, whose upper half is u - 1 (in magnitude) and low half 0x8000-0xffff. So
// the low 16 bits of the master, read as a signed offset from u << 16, give the master back, bit
// for bit: m = (u << 16) + int16(low). That is why a parameter with a master weight, in every
// master precision (fp32 included, so that "split" and "fp32" give the same bits), is the master
// rounded to nearest with ties away from zero; the two roundings differ only where the master's
// low 16 bits are exactly 0x8000 and u - 1 is even (one element in 2^17). Without a master, a
// parameter is updated in place and rounded to nearest even, as torch does.
// Special values: inf is the rounding of itself and of the 2^15 finite values just below it
// (offsets -0x8000..0); NaN keeps its upper half, quieted, so a quiet NaN master (every NaN that
// arithmetic makes) comes back bit for bit from `high | low` (a signaling one comes back quiet).
// The proof runs over all 2^32 fp32 values in tests/test_split_master.py (csrc/cpu/master_selftest.cpp).
// fp16 parameters cannot be split: an fp16 value near zero is the rounding of up to 2^30 fp32
// values (its subnormals and zero cover many fp32 binades), so "split" refuses them.
//
// [note: every write is seen]
// A step writes each parameter as its master's rounding, so a parameter that is not one of its
// master's nearest roundings was written since by something else (`copy_`, `load_state_dict`, an EMA
// swap, `p.data.copy_(w)`, which no version counter sees). The update starts, element by element,
// from the master where the parameter is one of its nearest roundings, and from the parameter
// elsewhere (`master_or_param`): every write is taken whatever made it, and an unwritten master is
// kept bit for bit. Either nearest rounding counts at a tie (fusedoff's ties away from zero, which a
// step writes, and torch's ties to even, which `.to(torch.bfloat16)` of a loaded master gives), so
// a parameter cast by torch from its master is never taken for a write. The check costs a read of
// the parameter beside the master (2 bytes per element, where the parameter lives; nothing more
// crosses the link to a streamed master). A split master ("split", "split8") cannot be checked:
// the parameter is its upper half, so every parameter with any low bits is a valid split master. A
// written element keeps its low bits: its master is the written value plus less than half a bf16
// unit in the last place (the written value is its rounding), as before the write was seen.
//
// "split8": the master, rounded stochastically to a multiple of 256 in its bit pattern (15 stored
// mantissa bits, unbiased: it rounds up with probability low8 / 256), is then split exactly as above
// and its bits 8-15 stored. Per step the stored master is within 256 units in the last place of the
// fp32 result (relative error < 2^-15), and equal to it in expectation. The random byte is a hash of
// the master's bits and the step (`split8_salt`), so it needs no state and is the same on every
// backend, placement and chunking. Rounding never overflows a finite master to inf.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fusedoff/dtypes.h"
#include "fusedoff/macros.h"
#include "fusedoff/state_codec.h"

namespace fusedoff {

enum class MasterPrecision : int { None = 0, Float32 = 1, Split16 = 2, Split8 = 3 };

// The functions below are written on the bits, U = uint32_t, and as templates so that the host
// kernels run the same source on 16 lanes at once (csrc/cpu/master_lanes.h: U a vector of uint32,
// every operation lane-wise, a comparison's "true" all ones); every backend's scalar form is the
// U = uint32_t one. The 16-bit values are held zero-extended in U.

// The bf16 parameter of the master with bits `u`: rounded to nearest, ties away from zero; NaN quieted.
template <typename U>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE U master_to_bf16_lanes(U u) {
  const U nan = (u >> 16) | 0x0040u;
  const U rounded = (u + 0x8000u) >> 16;  // sign-magnitude: adding rounds the magnitude half up
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint16_t master_to_bf16_bits(float value) {
  return static_cast<uint16_t>(master_to_bf16_lanes(float_to_bits(value)));
}

// The bits the update starts from for an fp32 master with bits `u` beside its bf16 parameter `param`
// (see [note: every write is seen]): `u` where the parameter is one of the master's nearest roundings,
// within half a bf16 step of it and of its sign (a bit-pattern distance of at most 0x8000, which
// takes in both at a tie), or for a NaN master its quieted upper half; else the parameter's value.
// (One comparison on a distance: GCC 12 turns a vector select whose condition is the `|` or `&` of
// comparisons into scalar code.)
template <typename U>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE U master_or_bf16_param_lanes(U u, U param) {
  const U reference = (u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x0040u) << 16 : u;
  const U high = param << 16;
  return reference - high + 0x8000u <= 0x10000u ? u : high;  // mod 2^32: distances -0x8000..0x8000
}

// The bits of the master whose rounding is the bf16 `param_bits` and whose low 16 bits are `low_bits`.
template <typename U>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE U join_master_lanes(U param_bits, U low_bits) {
  const U high = param_bits << 16;
  const U offset = (low_bits ^ 0x8000u) - 0x8000u;  // the low half as a signed 16-bit offset, mod 2^32
  return (param_bits & 0x7fffu) > 0x7f80u ? (high | low_bits) : high + offset;
}
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float join_master(uint16_t param_bits, uint16_t low_bits) {
  return bits_to_float(join_master_lanes<uint32_t>(param_bits, low_bits));
}

// The key of one step's random bytes for "split8" (`step` the count after this step's increment).
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint32_t split8_salt(float step) {
  return rounding_step_key(0x5b1175a8u, static_cast<uint32_t>(step));
}

// The bits of master `u` rounded stochastically to a multiple of 256 in its bit pattern (see the note).
template <typename U>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE U round_master_split8_lanes(U u, uint32_t salt) {
  const U magnitude = u & 0x7fffffffu;
  const U random = mix32_lanes(u ^ salt) & 0xffu;
  // A finite master whose rounding up would reach the exponent of inf (magnitude below inf's bits,
  // magnitude + random at or above them: in 32-bit arithmetic, magnitude + random - inf < random)
  // rounds down instead: it adds 0. (Not a select between the two roundings: GCC 12 turns a vector
  // select whose operand is another select into scalar code.)
  const U added = (magnitude + random - 0x7f800000u) < random ? U{} : random;
  const U rounded = (u + added) & 0xffffff00u;
  const U nan = (u | 0x00400000u) & 0xffffff00u;
  return magnitude > 0x7f800000u ? nan : rounded;
}
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float round_master_split8(float value, uint32_t salt) {
  return bits_to_float(round_master_split8_lanes(float_to_bits(value), salt));
}

// The parameter of a master weight: bf16 as above; fp16 rounded to nearest even (fp16 is never split).
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void store_param_of_master(bfloat16_t* p, float v) { p->bits = master_to_bf16_bits(v); }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void store_param_of_master(half_t* p, float v) { store_float(p, v); }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void store_param_of_master(float* p, float v) { *p = v; }

// The value the update starts from for an fp32 master beside parameter `p` (see [note: every write
// is seen]). fp16: the master where `p` is its rounding to nearest even or, at a tie, the other
// nearest fp16 value (the next bit pattern either way, of the same sign, exactly as far from the
// master: the differences are exact, both values being within a factor of 2 of the master or
// subnormal); else `p`. An fp32 parameter has no rounding to check (and no master in the optimizers).
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float master_or_param(float master, const bfloat16_t& p) {
  return bits_to_float(master_or_bf16_param_lanes<uint32_t>(float_to_bits(master), p.bits));
}
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float master_or_param(float master, const half_t& p) {
  const uint32_t rounded = float_to_half_bits(master);
  const float value = half_bits_to_float(p.bits);
  const uint32_t apart = static_cast<uint32_t>(p.bits) - rounded + 1u;  // 0 or 2: the next bit pattern
  const float nearest_even = half_bits_to_float(static_cast<uint16_t>(rounded));
  const bool other_at_tie = (apart == 0u || apart == 2u) && value - master == master - nearest_even;
  return (p.bits == rounded || other_at_tie) ? master : value;
}
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float master_or_param(float master, const float&) { return master; }

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint16_t storage_bits(const bfloat16_t& p) { return p.bits; }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint16_t storage_bits(const half_t& p) { return p.bits; }
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE uint16_t storage_bits(const float&) { return 0; }  // never split

// Element i of a parameter of storage type P and its master weight stored as M: `load` is the fp32
// value the update starts from (an fp32 master, or the parameter where it was written: see [note:
// every write is seen]), `store` writes the updated value to both. `master` points at the
// master's storage (float, or the uint16/uint8 low bits), null with None. `salt`: split8_salt.
// `Split8Lane`: the type a split8 master's byte is held in (the host kernels widen it, see
// csrc/cpu/master_lanes.h).
template <MasterPrecision M, typename P, typename Split8Lane = uint8_t>
struct MasterWeight {
  static FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float load(const void* master, const P* param, int64_t i) {
    if (M == MasterPrecision::Float32) return master_or_param(static_cast<const float*>(master)[i], param[i]);
    if (M == MasterPrecision::Split16) return join_master(storage_bits(param[i]), static_cast<const uint16_t*>(master)[i]);
    if (M == MasterPrecision::Split8) {
      const uint32_t low = static_cast<uint32_t>(static_cast<const Split8Lane*>(master)[i]) << 8;
      return join_master(storage_bits(param[i]), static_cast<uint16_t>(low));
    }
    return load_float(param + i);
  }

  static FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void store(void* master, P* param, int64_t i, float value, uint32_t salt) {
    if (M == MasterPrecision::None) {
      store_float(param + i, value);
      return;
    }
    if (M == MasterPrecision::Split8) value = round_master_split8(value, salt);
    store_param_of_master(param + i, value);
    const uint32_t bits = float_to_bits(value);
    if (M == MasterPrecision::Float32) static_cast<float*>(master)[i] = value;
    if (M == MasterPrecision::Split16) static_cast<uint16_t*>(master)[i] = static_cast<uint16_t>(bits);
    if (M == MasterPrecision::Split8) static_cast<Split8Lane*>(master)[i] = static_cast<Split8Lane>((bits >> 8) & 0xffu);
  }
};

// The storage of one element of a master weight stored as M (None: none is stored; float stands in).
template <MasterPrecision M>
struct MasterStorage {
  using type = float;
};
template <>
struct MasterStorage<MasterPrecision::Split16> {
  using type = uint16_t;
};
template <>
struct MasterStorage<MasterPrecision::Split8> {
  using type = uint8_t;
};
template <MasterPrecision M>
using master_storage_t = typename MasterStorage<M>::type;

// `master` advanced by `offset` elements of its storage.
template <MasterPrecision M>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void* master_at(void* master, int64_t offset) {
  const int64_t bytes = static_cast<int64_t>(sizeof(master_storage_t<M>));
  return master == nullptr ? nullptr : static_cast<void*>(static_cast<char*>(master) + offset * bytes);
}

// Calls `fn(std::integral_constant<MasterPrecision, M>{})` for the run-time `precision`; the split
// ones only for bf16 parameters (P), which ops.cpp checks.
template <typename P, typename Fn>
inline void dispatch_master(MasterPrecision precision, Fn&& fn) {
  using MP = MasterPrecision;
  switch (precision) {
    case MP::None: fn(std::integral_constant<MP, MP::None>{}); break;
    case MP::Float32: fn(std::integral_constant<MP, MP::Float32>{}); break;
    case MP::Split16:
      if constexpr (std::is_same<P, bfloat16_t>::value) fn(std::integral_constant<MP, MP::Split16>{});
      break;
    case MP::Split8:
      if constexpr (std::is_same<P, bfloat16_t>::value) fn(std::integral_constant<MP, MP::Split8>{});
      break;
  }
}

}  // namespace fusedoff
