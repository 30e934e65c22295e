// Device Adam/AdamW with compressed moments: per element the math of adam.h (`adam_update`), the
// states decoded before and encoded after it in the same pass (state_codec.h). ATen-free.
//
// Design:
//  - The multi-tensor scheme of multi_tensor.cuh (one block of kThreads per chunk of
//    kChunkElements, a by-value table of tensors, block -> tensor by binary search). A chunk is a
//    whole number of 8-bit blocks (kChunkElements is a multiple of kQuantBlock, and a range starts
//    on a block), so no 8-bit block is shared by two thread blocks.
//  - Each warp takes one 8-bit block (kQuantBlock elements) at a time, kQuantBlock / 32 elements
//    per lane at lane + 32 k (coalesced), keeps the decoded-and-updated values in registers,
//    finds the block's new absmax with warp shuffles, then encodes. bf16 states take the same
//    loop without the reduction.
//  - Scalar (not 16-byte) accesses: codes are one byte, and a warp's 32 consecutive elements make
//    whole 32- to 128-byte transactions already.
//  - The master weight is read and written as master.h's MasterWeight for the launch's
//    MasterPrecision (a template parameter).
//  - Thread 0 reads found_inf, grad_scale and the step and computes the AdamScalars, the random
//    stream's step key and the split8 salt once per block; shared memory broadcasts them. A skipped step
//    (*found_inf != 0) returns before touching a tensor.
#include <cuda_runtime.h>

#include <cstdint>

#include "fusedoff/adam.h"
#include "fusedoff/launchers.h"
#include "launch.cuh"
#include "multi_tensor.cuh"

namespace fusedoff {
namespace {

using namespace multi_tensor;

constexpr int kWarps = kThreads / 32;
constexpr int kPerLane = kQuantBlock / 32;
static_assert(kChunkElements % kQuantBlock == 0, "a thread block's chunk is whole 8-bit blocks");
static_assert(kQuantBlock % 32 == 0, "a warp covers an 8-bit block in whole rows");

struct CompressedAdamLaunchArgs {
  const float* grad_scale;
  const float* found_inf;
  AdamHyperparams hyper;
};

using CompressedAdamChunkTable = ChunkTable<CompressedAdamTensorPtrs, CompressedAdamLaunchArgs, 40>;
static_assert(sizeof(CompressedAdamChunkTable) <= 4096, "the kernel argument must stay under 4 KB");

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int lanes = 16; lanes > 0; lanes /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, lanes));
  return x;
}

template <typename P, typename G, MasterPrecision kMaster, bool kBlock8>
__global__ void __launch_bounds__(kThreads)
    adam_compressed_chunks_kernel(const __grid_constant__ CompressedAdamChunkTable table) {
  __shared__ AdamScalars block_scalars;
  __shared__ float block_grad_scale;
  __shared__ uint32_t block_step_key;
  __shared__ uint32_t block_salt;
  __shared__ bool block_skips;

  const BlockWork work = block_work(table, static_cast<int>(blockIdx.x));
  const CompressedAdamTensorPtrs& t = table.tensors[work.slot];
  if (threadIdx.x == 0) {
    const bool skip = table.args.found_inf != nullptr && *table.args.found_inf != 0.0f;
    block_skips = skip;
    if (!skip) {
      const float step = *t.step;
      block_scalars = adam_scalars(table.args.hyper, step);
      block_grad_scale = table.args.grad_scale != nullptr ? *table.args.grad_scale : 1.0f;
      block_step_key = rounding_step_key(t.tensor_key, static_cast<uint32_t>(step));
      block_salt = split8_salt(step);
    }
  }
  __syncthreads();
  if (block_skips) return;  // AMP overflow: change nothing
  const AdamScalars s = block_scalars;
  const float grad_scale = block_grad_scale;
  const uint32_t step_key = block_step_key;
  const uint32_t salt = block_salt;

  P* param = static_cast<P*>(t.param);
  const G* grad = static_cast<const G*>(t.grad);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int quant_blocks = (work.numel + kQuantBlock - 1) / kQuantBlock;
  for (int qb = warp; qb < quant_blocks; qb += kWarps) {
    const int64_t first = work.begin + static_cast<int64_t>(qb) * kQuantBlock;  // in the range
    const int64_t b = first / kQuantBlock;
    const int n = min(kQuantBlock, work.numel - qb * kQuantBlock);
    float m[kPerLane];
    float v[kPerLane];
    const float m_decode = kBlock8 ? decode_factor(t.exp_avg_absmax[b]) : 0.0f;
    const float v_decode = kBlock8 ? decode_factor(t.exp_avg_sq_absmax[b]) : 0.0f;
    float m_max = 0.0f;
    float v_max = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int i = lane + 32 * k;
      m[k] = 0.0f;
      v[k] = 0.0f;
      if (i >= n) continue;
      const int64_t e = first + i;
      float p = MasterWeight<kMaster, P>::load(t.master, param, e);
      if (kBlock8) {
        m[k] = decode_signed(static_cast<const uint8_t*>(t.exp_avg)[e], m_decode);
        v[k] = decode_unsigned(static_cast<const uint8_t*>(t.exp_avg_sq)[e], v_decode);
      } else {
        m[k] = load_float(static_cast<const bfloat16_t*>(t.exp_avg) + e);
        v[k] = load_float(static_cast<const bfloat16_t*>(t.exp_avg_sq) + e);
      }
      float unused = 0.0f;
      adam_update<false>(p, load_float(grad + e), m[k], v[k], unused, grad_scale, s);
      MasterWeight<kMaster, P>::store(t.master, param, e, p, salt);
      if (kBlock8) {
        m_max = fmaxf(m_max, finite_magnitude(m[k]));
        v_max = fmaxf(v_max, finite_magnitude(v[k]));
      } else {
        const uint32_t bits = rounding_bits(step_key, t.offset + e);
        static_cast<bfloat16_t*>(t.exp_avg)[e].bits = float_to_bf16_stochastic(m[k], bits & 0xffffu);
        static_cast<bfloat16_t*>(t.exp_avg_sq)[e].bits = float_to_bf16_stochastic(v[k], bits >> 16);
      }
    }
    if (!kBlock8) continue;
    m_max = warp_max(m_max);
    v_max = warp_max(v_max);
    if (lane == 0) {
      t.exp_avg_absmax[b] = m_max;
      t.exp_avg_sq_absmax[b] = v_max;
    }
    const float m_encode = encode_factor(m_max);
    const float v_encode = encode_factor(v_max);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int i = lane + 32 * k;
      if (i >= n) continue;
      static_cast<uint8_t*>(t.exp_avg)[first + i] = encode_signed(m[k], m_encode);
      static_cast<uint8_t*>(t.exp_avg_sq)[first + i] = encode_unsigned(v[k], v_encode);
    }
  }
}

template <typename P, typename G, MasterPrecision kMaster, bool kBlock8>
void launch_compressed_chunks(const CompressedAdamLaunch& launch) {
  const cudaStream_t stream = static_cast<cudaStream_t>(launch.stream);
  CompressedAdamChunkTable table{};
  table.args = CompressedAdamLaunchArgs{launch.grad_scale, launch.found_inf, launch.hyper};
  const auto no_vectors = [](const CompressedAdamTensorPtrs&) { return -1; };
  int64_t next_tensor = 0;
  while (const int64_t blocks = fill_chunk_table(launch.tensors, launch.num_tensors, next_tensor, table, no_vectors,
                                                 "adam_compressed_step_cuda")) {
    launch_kernel(adam_compressed_chunks_kernel<P, G, kMaster, kBlock8>, static_cast<unsigned int>(blocks), kThreads,
                  stream, table);
    check_launch("adam_compressed_step_cuda");
  }
}

}  // namespace

void adam_compressed_step_cuda(const CompressedAdamLaunch& launch) {
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      const bool block8 = launch.precision == StatePrecision::Block8;
      dispatch_master<P>(launch.master, [&](auto master) {
        constexpr MasterPrecision kMaster = decltype(master)::value;
        block8 ? launch_compressed_chunks<P, G, kMaster, true>(launch)
               : launch_compressed_chunks<P, G, kMaster, false>(launch);
      });
    });
  });
}

}  // namespace fusedoff
