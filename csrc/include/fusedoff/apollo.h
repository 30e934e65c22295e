// The Apollo update (Ma, arXiv 2009.13586; reference: XuezheMax/apollo optim/apollo.py, the
// revision with sigma = 0.01), written once for every backend. ATen-free.
//
// Not the 2024 "APOLLO" low-rank AdamW variant: this is the diagonal quasi-Newton method.
//
// One step of one tensor (k = its step count before the step, t = k + 1):
//   curr_lr = k < warmup ? (base_lr - init_lr) * k / warmup + init_lr : lr
//   g = grad / grad_scale (+ wd * p with L2 decay)
//   alpha = (1 - beta) / (1 - beta^t)
//   y = g - m
//   constant: R = 0.01, e = eps / 0.01            belief: R = max_i |y_i|, e = eps
//   m = m + alpha * y
//   den = (sum_i d_i^4)^(1/4) + e
//   dh = d / den ; v = dh * dh
//   delta = -alpha * sum_i (y_i / den) * dh_i - sum_i B_i * v_i
//   B = B + delta * v
//   constant: D = max(|B|, 0.01)                  belief: D = max(|B|, R) + eps / alpha
//   u = m / D  (+ wd * p decoupled; + (wd / mean_i D) * p stable)
//   d = u ; p = p - curr_lr * u
//
// The sums, the max and the mean run over the whole tensor, so a step is reduce-then-apply and
// works on any split of a tensor into ranges (chunks of the offload engine, later ranks):
//   1. reduce: from the old states and the gradient, sum d^4, sum y*d, sum B*d^2 and max|y|
//      (`apollo_reduce_element`, accumulated per range, combined across ranges in double);
//   2. `apollo_step_constants` turns the whole-tensor sums into den, delta and R;
//   3. apply (`apollo_apply_element`). With 'stable' decay the apply splits in two: the first
//      updates m and B and sums D = f(B) over the tensor (`apollo_rebound`), the second
//      (`apollo_finish_element`) writes d and p once mean(D) is known.
// Since sum_i (y_i / den) * (d_i / den) = sum_i y_i d_i / den^2, the reduction needs no den.
// fusedoff/kernels/reference.py and fusedoff/kernels/triton_apollo.py mirror this file.
#pragma once

#include <cmath>
#include <cstdint>

#include "fusedoff/dtypes.h"
#include "fusedoff/macros.h"
#include "fusedoff/master.h"

namespace fusedoff {

enum class ApolloRebound : int { Constant = 0, Belief = 1 };
enum class ApolloDecay : int { None = 0, L2 = 1, Decoupled = 2, Stable = 3 };

// The rebound floor of the 'constant' mode (sigma in the paper's later revision).
constexpr double kApolloSigma = 0.01;

struct ApolloHyperparams {
  double lr;
  double base_lr;
  double init_lr;
  double warmup;
  double beta;
  double eps;
  double weight_decay;
  ApolloRebound rebound;
  ApolloDecay decay;
};

// Per-tensor sums of one step, in this order in the `stats` tensors of the ops (float64, 5 per
// tensor); the last slot holds sum D for 'stable' decay.
enum ApolloStat : int { kSumD4 = 0, kSumYD = 1, kSumBDD = 2, kMaxAbsY = 3, kSumD = 4, kNumApolloStats = 5 };

// Scalars that depend on the tensor's step count only.
struct ApolloStepScalars {
  float alpha;
  float curr_lr;
  float l2_decay;       // wd with L2 decay, else 0
  double alpha_exact;   // alpha before its rounding to fp32: see apollo_step_constants
};

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE ApolloStepScalars apollo_step_scalars(const ApolloHyperparams& h, float step) {
  ApolloStepScalars s;
  const double t = static_cast<double>(step);
  const double k = t - 1.0;
  const double curr_lr = k < h.warmup ? (h.base_lr - h.init_lr) * k / h.warmup + h.init_lr : h.lr;
  s.alpha = static_cast<float>((1.0 - h.beta) / (1.0 - pow(h.beta, t)));
  s.curr_lr = static_cast<float>(curr_lr);
  s.l2_decay = h.decay == ApolloDecay::L2 ? static_cast<float>(h.weight_decay) : 0.0f;
  s.alpha_exact = (1.0 - h.beta) / (1.0 - pow(h.beta, t));
  return s;
}

// The gradient the step sees: unscaled, with L2 decay added.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float apollo_grad(float grad, float param, float grad_scale,
                                                       const ApolloStepScalars& s) {
  return grad / grad_scale + s.l2_decay * param;
}

// max that propagates NaN like torch.maximum/clamp (fmaxf drops it): with eps = 0 the reference
// yields NaN at step 1 in constant mode, and so must we.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float nan_max(float acc, float x) { return (x > acc || x != x) ? x : acc; }

// Pass 1, one element: accumulates into a range's partials. Acc is the accumulator type: the host
// kernel uses double, because summing n near-equal fp32 values sequentially is biased by up to
// n/2 ulps (see 'Apollo accumulation precision' in benchmarks/results/RESULTS.md).
template <typename Acc>
struct ApolloPartialsT {
  Acc sum_d4;
  Acc sum_yd;
  Acc sum_bdd;
  float max_abs_y;
};
using ApolloPartials = ApolloPartialsT<float>;

// The four per-element terms of the pass-1 sums (scalars, so that SIMD loops can keep them in
// vector registers).
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void apollo_reduce_terms(float g, float exp_avg_grad, float hessian, float update,
                                                              float& d4, float& yd, float& bdd, float& abs_y) {
  const float y = g - exp_avg_grad;
  const float d2 = update * update;
  d4 = d2 * d2;
  yd = y * update;
  bdd = hessian * d2;
  abs_y = fabsf(y);
}

template <typename Acc>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void apollo_reduce_element(float g, float exp_avg_grad, float hessian,
                                                                float update, ApolloPartialsT<Acc>& acc) {
  float d4, yd, bdd, abs_y;
  apollo_reduce_terms(g, exp_avg_grad, hessian, update, d4, yd, bdd, abs_y);
  acc.sum_d4 += static_cast<Acc>(d4);
  acc.sum_yd += static_cast<Acc>(yd);
  acc.sum_bdd += static_cast<Acc>(bdd);
  acc.max_abs_y = nan_max(acc.max_abs_y, abs_y);
}

// Whole-tensor constants of the apply pass, from the reduced sums.
struct ApolloStepConstants {
  float alpha;
  float curr_lr;
  float l2_decay;
  float den;             // ||d||_4 + e
  float delta;           // the scalar of the B update
  float rebound_floor;   // R
  float rebound_shift;   // eps / alpha for 'belief', else 0
};

FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE ApolloStepConstants apollo_step_constants(const ApolloHyperparams& h,
                                                                               const ApolloStepScalars& s,
                                                                               const double* stats) {
  ApolloStepConstants c;
  const bool belief = h.rebound == ApolloRebound::Belief;
  const double e = belief ? h.eps : h.eps / kApolloSigma;
  const double den = sqrt(sqrt(stats[kSumD4])) + e;
  // NOTE: the unrounded alpha, as the reference computes delta and eps / alpha in double: rounding
  // alpha to fp32 first can flip delta's own rounding, and where B + delta * v cancels that one ulp
  // became several ulps of B and d (see 'Apollo accumulation precision' in
  // benchmarks/results/RESULTS.md).
  const double alpha = s.alpha_exact;
  c.alpha = s.alpha;
  c.curr_lr = s.curr_lr;
  c.l2_decay = s.l2_decay;
  c.den = static_cast<float>(den);
  c.delta = static_cast<float>((-alpha * stats[kSumYD] - stats[kSumBDD]) / (den * den));
  c.rebound_floor = belief ? static_cast<float>(stats[kMaxAbsY]) : static_cast<float>(kApolloSigma);
  c.rebound_shift = belief ? static_cast<float>(h.eps / alpha) : 0.0f;
  return c;
}

// The coefficient of p added to u: wd ('decoupled'), wd / mean(D) ('stable', once stats[kSumD]
// holds the whole tensor's sum of D over `numel` elements), else 0.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float apollo_decay_coefficient(const ApolloHyperparams& h, const double* stats,
                                                                    int64_t numel) {
  if (h.decay == ApolloDecay::Decoupled) return static_cast<float>(h.weight_decay);
  if (h.decay == ApolloDecay::Stable) return static_cast<float>(h.weight_decay / (stats[kSumD] / static_cast<double>(numel)));
  return 0.0f;
}

// D, the rebounded curvature, from the new B.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float apollo_rebound(float hessian, const ApolloStepConstants& c) {
  return nan_max(c.rebound_floor, fabsf(hessian)) + c.rebound_shift;
}

// Pass 2, one element: updates m and B (all modes).
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void apollo_update_moments(float g, float& exp_avg_grad, float& hessian,
                                                                float update, const ApolloStepConstants& c) {
  const float y = g - exp_avg_grad;
  exp_avg_grad = exp_avg_grad + c.alpha * y;
  const float dh = update / c.den;
  const float v = dh * dh;
  hessian = hessian + c.delta * v;
}

// Pass 2 (or 3 for 'stable'), one element: the update direction and the parameter, from the new
// m and B; `decay` is apollo_decay_coefficient.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void apollo_finish_element(float& param, float exp_avg_grad, float hessian,
                                                                float& update, float decay,
                                                                const ApolloStepConstants& c) {
  float u = exp_avg_grad / apollo_rebound(hessian, c);
  u = u + decay * param;
  update = u;
  param = param - c.curr_lr * u;
}

// ---- launch description (shared by the host and device launchers) --------------------------

enum class ApolloPhase : int {
  Reduce = 0,   // pass 1: add this range's sums into stats (sum d^4, sum y*d, sum B*d^2, max |y|)
  Full = 1,     // pass 2 for every decay but 'stable': update m, B, d and p
  Moments = 2,  // 'stable' pass 2: update m and B, add sum D into stats[kSumD]
  Finish = 3,   // 'stable' pass 3: write d and p with wd / mean(D)
};

// The pointers of one tensor (or one contiguous range of a tensor) of a fused call.
struct ApolloTensorPtrs {
  void* param;
  const void* grad;
  float* exp_avg_grad;
  float* approx_hessian;
  float* update;
  void* master;        // nullptr without master weights (see master.h)
  const float* step;   // the tensor's step count after this step's increment
  double* stats;       // kNumApolloStats whole-tensor sums, shared by every range of the tensor
  int64_t numel;       // elements in this range
  int64_t total_numel; // elements in the whole tensor (for mean D)
};

struct ApolloLaunch {
  const ApolloTensorPtrs* tensors;
  int64_t num_tensors;
  DType param_dtype;
  DType grad_dtype;
  MasterPrecision master;
  ApolloPhase phase;
  ApolloHyperparams hyper;
  const float* grad_scale;  // nullptr: no scaling
  const float* found_inf;   // nullptr: always step; *found_inf != 0: change nothing
  int num_threads;          // host only
  void* stream;             // device only
  void* workspace;          // device only: apollo_cuda_workspace_bytes(*this) bytes of device memory
};

}  // namespace fusedoff
