// The Adam/AdamW update, written once for every backend. ATen-free.
//
// Per element, in fp32 whatever the storage dtypes, with t the step count after increment:
//   g = grad / grad_scale;  if maximize: g = -g
//   Adam (L2):       g = g + wd * p
//   AdamW (decoupled): p = p * (1 - lr * wd)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   vhat = amsgrad ? (vmax = max(vmax, v)) : v
//   p = p - (lr / (1 - beta1^t)) * m / (sqrt(vhat) / sqrt(1 - beta2^t) + eps)
// which is torch.optim.Adam/AdamW's single-tensor algorithm. The CPU (csrc/cpu) and CUDA
// (csrc/cuda) kernels call `adam_update`; the Triton kernel (fusedoff/kernels/triton_adam.py) and
// the reference (fusedoff/kernels/reference.py) mirror it line for line.
#pragma once

#include <cmath>
#include <cstdint>

#include "fusedoff/dtypes.h"
#include "fusedoff/macros.h"
#include "fusedoff/master.h"
#include "fusedoff/state_codec.h"

namespace fusedoff {

// Hyperparameters of one fused call; identical for every tensor in it.
struct AdamHyperparams {
  // Kept in double, as given from Python, so that derived constants such as 1 - beta2 are exact
  // before their single rounding to fp32 (1 - 0.99f is 1e-6 off from 0.01f: a bias that shows).
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled_weight_decay;  // AdamW; otherwise L2 (Adam)
  bool maximize;
};

// Scalars that depend on one tensor's step count, computed once per tensor (or CUDA block) and
// folded so that weight decay, maximize and grad scaling cost no branch per element.
struct AdamScalars {
  float grad_sign;     // -1 with maximize
  float l2_decay;      // wd for Adam's L2 decay, else 0
  float decay_factor;  // 1 - lr * wd for AdamW's decoupled decay, else 1
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float eps;
};

// Bias corrections are computed in double, as torch.optim does in Python, then rounded once.
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE AdamScalars adam_scalars(const AdamHyperparams& h, float step) {
  AdamScalars s;
  const double t = static_cast<double>(step);
  s.grad_sign = h.maximize ? -1.0f : 1.0f;
  s.l2_decay = h.decoupled_weight_decay ? 0.0f : static_cast<float>(h.weight_decay);
  s.decay_factor = h.decoupled_weight_decay ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.step_size = static_cast<float>(h.lr / (1.0 - pow(h.beta1, t)));
  s.bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(h.beta2, t)));
  s.eps = static_cast<float>(h.eps);
  return s;
}

// The elementwise functions the update calls besides arithmetic, for F = float. The host kernels
// specialise it for a vector type (csrc/cpu/float_lanes.h: F holds 16 elements, and every operation
// is the float one in each lane), so that the update below is written once for them too.
template <typename F>
struct LaneMath;
template <>
struct LaneMath<float> {
  static FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float sqrt(float x) { return sqrtf(x); }
  static FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE float max(float a, float b) { return fmaxf(a, b); }
};

// One element (or one vector of them, see LaneMath). `grad_scale` is 1 when there is no AMP scaler.
// `max_exp_avg_sq` is read and written only when kAmsgrad.
template <bool kAmsgrad, typename F>
FUSEDOFF_HOST_DEVICE FUSEDOFF_INLINE void adam_update(F& param, const F& grad, F& exp_avg, F& exp_avg_sq, F& max_exp_avg_sq,
                                                      float grad_scale, const AdamScalars& s) {
  F g = s.grad_sign * (grad / grad_scale);
  g = g + s.l2_decay * param;
  param = param * s.decay_factor;
  exp_avg = s.beta1 * exp_avg + s.one_minus_beta1 * g;
  exp_avg_sq = s.beta2 * exp_avg_sq + s.one_minus_beta2 * g * g;
  F vhat = exp_avg_sq;
  if constexpr (kAmsgrad) {
    max_exp_avg_sq = LaneMath<F>::max(max_exp_avg_sq, exp_avg_sq);
    vhat = max_exp_avg_sq;
  }
  const F denom = LaneMath<F>::sqrt(vhat) / s.bias_correction2_sqrt + s.eps;
  param = param - s.step_size * (exp_avg / denom);
}

// The pointers of one tensor of a fused call. `param` has the storage type P and `grad` the type G
// (possibly different). With `master` set, the master weight (stored as the launch's
// MasterPrecision, see master.h) is the parameter the math updates and `param` receives its
// rounding; otherwise `param` is updated in place.
// `step` points at the tensor's step count after this step's increment (a float, like torch's
// `state["step"]`).
struct AdamTensorPtrs {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr unless amsgrad
  void* master;           // nullptr without master weights (see master.h)
  const float* step;
  int64_t numel;
};

// Everything a backend launcher needs for one fused call.
struct AdamLaunch {
  const AdamTensorPtrs* tensors;
  int64_t num_tensors;
  DType param_dtype;
  DType grad_dtype;
  bool amsgrad;
  MasterPrecision master;
  AdamHyperparams hyper;
  const float* grad_scale;  // nullptr: no scaling
  const float* found_inf;   // nullptr: always step; *found_inf != 0: change nothing
  int num_threads;          // host only
  void* stream;             // device only: the cudaStream_t to launch on
};

// ---- compressed states (see [note: compressed states] in state_codec.h) -----------------------
// One tensor, or the range of one that starts at element `offset` of it (a multiple of
// kQuantBlock): moments stored as bf16, or as uint8 codes with one fp32 absmax per block.
struct CompressedAdamTensorPtrs {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  float* exp_avg_absmax;     // 8-bit only: ceil(numel / kQuantBlock) scales
  float* exp_avg_sq_absmax;  // 8-bit only
  void* master;              // nullptr without master weights (see master.h)
  const float* step;
  int64_t numel;
  int64_t offset;       // the range's first element in its tensor: origin of the blocks and random indices
  uint32_t tensor_key;  // bf16: the tensor's key of the random stream
};

struct CompressedAdamLaunch {
  const CompressedAdamTensorPtrs* tensors;
  int64_t num_tensors;
  DType param_dtype;
  DType grad_dtype;
  StatePrecision precision;  // BFloat16 or Block8
  MasterPrecision master;
  AdamHyperparams hyper;
  const float* grad_scale;
  const float* found_inf;
  int num_threads;
  void* stream;
};

}  // namespace fusedoff
