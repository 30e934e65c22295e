// How the host kernels share out work: every tensor of a call is cut into fixed-size blocks, and
// OpenMP threads take the blocks in a static schedule. Fixed blocks also fix the order of the
// partial sums of reductions, so results do not depend on the thread count.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fusedoff {

// NOTE: 32K elements is 128 KiB per fp32 stream: big enough that OpenMP scheduling is noise,
// small enough that a 64M-element call splits into ~2K blocks and both cores stay busy to the end.
constexpr int64_t kBlockElements = 32768;

struct WorkBlock {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

// Blocks of `tensors[0..n)` (anything with a `numel`), in tensor order.
template <typename TensorPtrs>
std::vector<WorkBlock> split_into_blocks(const TensorPtrs* tensors, int64_t n) {
  std::vector<WorkBlock> blocks;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t begin = 0; begin < tensors[i].numel; begin += kBlockElements)
      blocks.push_back({static_cast<int32_t>(i), begin, std::min(tensors[i].numel, begin + kBlockElements)});
  return blocks;
}

// fn(index, block) for every block on up to `num_threads` threads.
// NOTE: static, not dynamic: on a multi-socket host each thread then updates the same part of the
// state every step (NUMA first touch), and dynamic scheduling was no faster on this repository's CPU
// machine, even under load (see 'CPU kernel tuning' in benchmarks/results/RESULTS.md).
template <typename Fn>
void for_each_block(int num_threads, const std::vector<WorkBlock>& blocks, Fn&& fn) {
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_blocks)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < num_blocks; ++b) fn(b, blocks[b]);
}

// The results of fn(block) for every block, in block order (reductions combine them in that order).
template <typename Result, typename Fn>
std::vector<Result> run_blocks(int num_threads, const std::vector<WorkBlock>& blocks, Fn&& fn) {
  std::vector<Result> results(blocks.size());
  for_each_block(num_threads, blocks, [&](int64_t b, const WorkBlock& block) { results[b] = fn(block); });
  return results;
}

}  // namespace fusedoff
