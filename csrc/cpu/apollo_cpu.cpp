// Host Apollo kernel: the phases of fusedoff/apollo.h over flat ranges, OpenMP across cores and
// SIMD within a core (instruction set picked at run time, see isa.h).
//
// Reductions are deterministic: each fixed-size block sums in double (in a fixed SIMD order), and
// the block partials of a tensor are added in block order into its stats.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "fusedoff/apollo.h"
#include "fusedoff/launchers.h"
#include "blocks.h"
#include "isa.h"
#include "master_lanes.h"

namespace fusedoff {
namespace {

struct RangeArgs {
  const ApolloTensorPtrs* t;
  int64_t begin;
  int64_t end;
  float grad_scale;
  const ApolloStepConstants* c;  // Full/Moments/Finish; for Reduce only alpha..l2_decay are set
  float decay;                   // Full/Finish
};

// Pass 1: returns this range's partial sums; NaN in y is counted so that max|y| propagates it.
using HostPartials = ApolloPartialsT<double>;

template <typename P, typename G, MasterPrecision kMaster, bool kL2>
struct ReduceRange {
static FUSEDOFF_INLINE HostPartials run(RangeArgs a) {
  const ApolloTensorPtrs& t = *a.t;
  const G* __restrict__ grad = static_cast<const G*>(t.grad);
  const float* __restrict__ m = t.exp_avg_grad;
  const float* __restrict__ hessian = t.approx_hessian;
  const float* __restrict__ d = t.update;
  const P* __restrict__ param = static_cast<const P*>(t.param);
  // The master is read only with L2 decay (widened for the loop where split8, see master_lanes.h).
  constexpr MasterPrecision kRead = kL2 ? kMaster : MasterPrecision::None;
  MasterLanes<kRead, kBlockElements> lanes(t.master, a.begin, a.end);
  using Master = MasterWeight<kRead, P, typename decltype(lanes)::Lane>;
  const void* range_master = lanes.lanes();
  const P* __restrict__ range_param = param + a.begin;
  const ApolloStepScalars s{a.c->alpha, a.c->curr_lr, a.c->l2_decay, 0.0};  // apollo_grad reads l2_decay only
  double sum_d4 = 0.0, sum_yd = 0.0, sum_bdd = 0.0;
  float max_abs_y = 0.0f;
  int nan_count = 0;
#pragma omp simd reduction(+ : sum_d4, sum_yd, sum_bdd, nan_count) reduction(max : max_abs_y)
  for (int64_t i = a.begin; i < a.end; ++i) {
    // NOTE: the parameter is read through local restrict pointers: through `t` (load_param) GCC
    // left this loop scalar, about half as fast (see 'CPU kernel tuning' in benchmarks/results/RESULTS.md).
    const float p = kL2 ? Master::load(range_master, range_param, i - a.begin) : 0.0f;
    const float g = apollo_grad(load_float(grad + i), p, a.grad_scale, s);
    float d4, yd, bdd, abs_y;
    apollo_reduce_terms(g, m[i], hessian[i], d[i], d4, yd, bdd, abs_y);
    sum_d4 += d4;
    sum_yd += yd;
    sum_bdd += bdd;
    nan_count += abs_y != abs_y;
    max_abs_y = std::max(max_abs_y, abs_y);
  }
  return {sum_d4, sum_yd, sum_bdd, nan_count > 0 ? NAN : max_abs_y};
}
};

// Pass 2 ('Full' or 'Moments'): updates m and B (and, when kFinish, d and p); returns sum D.
template <typename P, typename G, MasterPrecision kMaster, bool kFinish, bool kL2>
struct ApplyRange {
static FUSEDOFF_INLINE double run(RangeArgs a) {
  const ApolloTensorPtrs& t = *a.t;
  const G* __restrict__ grad = static_cast<const G*>(t.grad);
  P* __restrict__ param = static_cast<P*>(t.param);
  // The master is read with L2 decay or to finish (widened for the loop where split8, see master_lanes.h).
  constexpr MasterPrecision kUsed = (kFinish || kL2) ? kMaster : MasterPrecision::None;
  MasterLanes<kUsed, kBlockElements> lanes(t.master, a.begin, a.end);
  using Master = MasterWeight<kUsed, P, typename decltype(lanes)::Lane>;
  void* range_master = lanes.lanes();
  P* __restrict__ range_param = param + a.begin;
  const uint32_t salt = split8_salt(*t.step);
  float* __restrict__ m = t.exp_avg_grad;
  float* __restrict__ hessian = t.approx_hessian;
  float* __restrict__ d = t.update;
  const ApolloStepConstants c = *a.c;
  const ApolloStepScalars s{c.alpha, c.curr_lr, c.l2_decay, 0.0};  // apollo_grad reads l2_decay only
  double sum_rebound = 0.0;
#pragma omp simd reduction(+ : sum_rebound)
  for (int64_t i = a.begin; i < a.end; ++i) {
    // 'Moments' without L2 decay needs no parameter: skip its load (4 of 28 bytes per element).
    float p = (kFinish || kL2) ? Master::load(range_master, range_param, i - a.begin) : 0.0f;
    const float g = apollo_grad(load_float(grad + i), p, a.grad_scale, s);
    float mi = m[i];
    float bi = hessian[i];
    float di = d[i];
    apollo_update_moments(g, mi, bi, di, c);
    m[i] = mi;
    hessian[i] = bi;
    if (kFinish) {
      apollo_finish_element(p, mi, bi, di, a.decay, c);
      d[i] = di;
      Master::store(range_master, range_param, i - a.begin, p, salt);
    } else {
      sum_rebound += apollo_rebound(bi, c);
    }
  }
  if constexpr (kFinish) lanes.write_back();
  return sum_rebound;
}
};

// 'Finish' ('stable' pass 3): d and p from the new m and B.
template <typename P, MasterPrecision kMaster>
struct FinishRange {
static FUSEDOFF_INLINE double run(RangeArgs a) {
  const ApolloTensorPtrs& t = *a.t;
  P* __restrict__ param = static_cast<P*>(t.param);
  MasterLanes<kMaster, kBlockElements> lanes(t.master, a.begin, a.end);  // see master_lanes.h
  using Master = MasterWeight<kMaster, P, typename decltype(lanes)::Lane>;
  void* range_master = lanes.lanes();
  P* __restrict__ range_param = param + a.begin;
  const uint32_t salt = split8_salt(*t.step);
  const float* __restrict__ m = t.exp_avg_grad;
  const float* __restrict__ hessian = t.approx_hessian;
  float* __restrict__ d = t.update;
  const ApolloStepConstants c = *a.c;
#pragma omp simd
  for (int64_t i = a.begin; i < a.end; ++i) {
    float p = Master::load(range_master, range_param, i - a.begin);
    float di;
    apollo_finish_element(p, m[i], hessian[i], di, a.decay, c);
    d[i] = di;
    Master::store(range_master, range_param, i - a.begin, p, salt);
  }
  lanes.write_back();
  return 0.0;
}
};

template <typename P, typename G, MasterPrecision kMaster>
void apollo_phase(const ApolloLaunch& launch) {
  const float grad_scale = launch.grad_scale != nullptr ? *launch.grad_scale : 1.0f;
  const int64_t n = launch.num_tensors;
  std::vector<ApolloStepConstants> constants(n);
  std::vector<float> decay(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const ApolloTensorPtrs& t = launch.tensors[i];
    const ApolloStepScalars s = apollo_step_scalars(launch.hyper, *t.step);
    if (launch.phase == ApolloPhase::Reduce) {
      constants[i] = ApolloStepConstants{s.alpha, s.curr_lr, s.l2_decay, 0.0f, 0.0f, 0.0f, 0.0f};
    } else {
      constants[i] = apollo_step_constants(launch.hyper, s, t.stats);
      decay[i] = apollo_decay_coefficient(launch.hyper, t.stats, t.total_numel);
    }
  }
  const std::vector<WorkBlock> blocks = split_into_blocks(launch.tensors, launch.num_tensors);
  auto args = [&](const WorkBlock& b) {
    return RangeArgs{&launch.tensors[b.tensor], b.begin, b.end, grad_scale, &constants[b.tensor], decay[b.tensor]};
  };

  const bool l2 = launch.hyper.decay == ApolloDecay::L2;
  switch (launch.phase) {
    case ApolloPhase::Reduce: {
      const auto fn = l2 ? select_isa_variant<ReduceRange<P, G, kMaster, true>, RangeArgs>()
                         : select_isa_variant<ReduceRange<P, G, kMaster, false>, RangeArgs>();
      const auto partials = run_blocks<HostPartials>(launch.num_threads, blocks, [&](const WorkBlock& b) { return fn(args(b)); });
      for (size_t b = 0; b < blocks.size(); ++b) {  // in block order: deterministic
        double* stats = launch.tensors[blocks[b].tensor].stats;
        stats[kSumD4] += partials[b].sum_d4;
        stats[kSumYD] += partials[b].sum_yd;
        stats[kSumBDD] += partials[b].sum_bdd;
        const double y = partials[b].max_abs_y;
        stats[kMaxAbsY] = (y > stats[kMaxAbsY] || y != y) ? y : stats[kMaxAbsY];
      }
      break;
    }
    case ApolloPhase::Full: {
      const auto fn = (l2 ? select_isa_variant<ApplyRange<P, G, kMaster, true, true>, RangeArgs>()
                         : select_isa_variant<ApplyRange<P, G, kMaster, true, false>, RangeArgs>());
      run_blocks<double>(launch.num_threads, blocks, [&](const WorkBlock& b) { return fn(args(b)); });
      break;
    }
    case ApolloPhase::Moments: {
      const auto fn = (l2 ? select_isa_variant<ApplyRange<P, G, kMaster, false, true>, RangeArgs>()
                         : select_isa_variant<ApplyRange<P, G, kMaster, false, false>, RangeArgs>());
      const auto sums = run_blocks<double>(launch.num_threads, blocks, [&](const WorkBlock& b) { return fn(args(b)); });
      for (size_t b = 0; b < blocks.size(); ++b) launch.tensors[blocks[b].tensor].stats[kSumD] += sums[b];
      break;
    }
    case ApolloPhase::Finish: {
      const auto fn = select_isa_variant<FinishRange<P, kMaster>, RangeArgs>();
      run_blocks<double>(launch.num_threads, blocks, [&](const WorkBlock& b) { return fn(args(b)); });
      break;
    }
  }
}

}  // namespace

void apollo_step_cpu(const ApolloLaunch& launch) {
  if (launch.found_inf != nullptr && *launch.found_inf != 0.0f) return;  // AMP overflow: skip
  dispatch_storage_type(launch.param_dtype, [&](auto param_tag) {
    dispatch_storage_type(launch.grad_dtype, [&](auto grad_tag) {
      using P = decltype(param_tag);
      using G = decltype(grad_tag);
      dispatch_master<P>(launch.master, [&](auto master) { apollo_phase<P, G, decltype(master)::value>(launch); });
    });
  });
}

}  // namespace fusedoff
