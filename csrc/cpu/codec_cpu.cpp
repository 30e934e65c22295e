// The 8-bit codec on whole tensors, on the host: what checkpoints need (state_dict, fp32_state_dict,
// DCP, a loaded state converted to another precision). The codes and scales are state_codec.h's,
// bit for bit those every backend's step writes and reads (fusedoff/kernels/codec.py mirrors them
// in PyTorch). Blocks of kQuantBlock elements are counted from the tensor's first element.
#include <algorithm>
#include <cstdint>

#include "fusedoff/launchers.h"
#include "fusedoff/state_codec.h"
#include "isa.h"

namespace fusedoff {
namespace {

struct CodecRange {
  const float* values;
  const uint8_t* codes_in;
  uint8_t* codes_out;
  float* values_out;
  float* absmax;
  int64_t numel;
  bool is_signed;
  int64_t first_block;
  int64_t end_block;
};

// One block's scale (its largest finite magnitude, 0 for none) and codes.
struct EncodeBlocks {
  static FUSEDOFF_INLINE void run(CodecRange r) {
    for (int64_t b = r.first_block; b < r.end_block; ++b) {
      const int64_t begin = b * kQuantBlock, end = std::min(begin + kQuantBlock, r.numel);
      float scale = 0.0f;
      for (int64_t i = begin; i < end; ++i) {
        const float m = finite_magnitude(r.values[i]);
        scale = m > scale ? m : scale;
      }
      r.absmax[b] = scale;
      const float factor = encode_factor(scale);
      if (r.is_signed) {
        for (int64_t i = begin; i < end; ++i) r.codes_out[i] = encode_signed(r.values[i], factor);
      } else {
        for (int64_t i = begin; i < end; ++i) r.codes_out[i] = encode_unsigned(r.values[i], factor);
      }
    }
  }
};

struct DecodeBlocks {
  static FUSEDOFF_INLINE void run(CodecRange r) {
    for (int64_t b = r.first_block; b < r.end_block; ++b) {
      const int64_t begin = b * kQuantBlock, end = std::min(begin + kQuantBlock, r.numel);
      const float factor = decode_factor(r.absmax[b]);
      if (r.is_signed) {
        for (int64_t i = begin; i < end; ++i) r.values_out[i] = decode_signed(r.codes_in[i], factor);
      } else {
        for (int64_t i = begin; i < end; ++i) r.values_out[i] = decode_unsigned(r.codes_in[i], factor);
      }
    }
  }
};

template <typename Body>
void run_in_parallel(CodecRange range, int num_threads) {
  const auto fn = select_isa_variant<Body, CodecRange>();
  const int64_t blocks = (range.numel + kQuantBlock - 1) / kQuantBlock;
  const int64_t per_task = 64;  // 16K elements: enough work per task to amortise the scheduling
  const int64_t tasks = (blocks + per_task - 1) / per_task;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t task = 0; task < tasks; ++task) {
    CodecRange part = range;
    part.first_block = task * per_task;
    part.end_block = std::min(part.first_block + per_task, blocks);
    fn(part);
  }
}

}  // namespace

void encode_8bit_cpu(const float* values, int64_t numel, bool is_signed, uint8_t* codes, float* absmax,
                     int num_threads) {
  run_in_parallel<EncodeBlocks>(CodecRange{values, nullptr, codes, nullptr, absmax, numel, is_signed, 0, 0},
                                num_threads);
}

void decode_8bit_cpu(const uint8_t* codes, const float* absmax, int64_t numel, bool is_signed, float* values,
                     int num_threads) {
  run_in_parallel<DecodeBlocks>(
      CodecRange{nullptr, codes, nullptr, values, const_cast<float*>(absmax), numel, is_signed, 0, 0}, num_threads);
}

}  // namespace fusedoff
