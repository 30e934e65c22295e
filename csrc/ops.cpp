// The one file that sees at::Tensor: schemas, argument checks, device guards, and the translation
// of tensors and typed hyperparameters into the plain launch descriptions (AdamLaunch, ...) that the
// ATen-free kernels take.
//
// Compiled twice: for fusedoff._C (the host kernels, and the CUDA kernels with FUSEDOFF_WITH_CUDA),
// and, with FUSEDOFF_CUDA_EMULATION, for the test build fusedoff._C_emulated: the CUDA kernels
// compiled as host C++ (csrc/emulation), registered as torch.ops.fusedoff_emulated for CPU tensors,
// behind the same checks and launch descriptions.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "fusedoff/launchers.h"

#if defined(FUSEDOFF_CUDA_EMULATION)
#include "emulation_control.h"
#else
#define FUSEDOFF_WITH_HOST_KERNELS 1
#include "cpu/selftests.h"
#endif

#if defined(FUSEDOFF_WITH_CUDA) && !defined(FUSEDOFF_CUDA_EMULATION)
// CUDAStream.h rather than ATen/cuda/CUDAContext.h: the latter pulls in cuBLAS/cuSPARSE headers,
// which a minimal toolkit (ours in CI) does not have.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fusedoff {
namespace {

// [note: hyperparameter lists] Each optimizer's scalar hyperparameters are written once, as a
// list FUSEDOFF_<NAME>_HYPERPARAMETERS(X, SEP) of X(C++ type, schema type, name) separated by
// SEP(). The list expands into the schema's typed arguments (fusedoff.ops unpacks its
// hyperparameter object into them by name), the ops' C++ parameters in the same order, the
// arguments they forward, and, for Adam, the fields of AdamHyperparams (adam.h) they fill.
#define FUSEDOFF_SCHEMA_ARGUMENT(cpp_type, schema_type, name) #schema_type " " #name
#define FUSEDOFF_PARAMETER(cpp_type, schema_type, name) cpp_type name
#define FUSEDOFF_ARGUMENT(cpp_type, schema_type, name) name
#define FUSEDOFF_SET_FIELD(cpp_type, schema_type, name) hyper.name = name;
#define FUSEDOFF_COMMA() ,
#define FUSEDOFF_SCHEMA_COMMA() ", "
#define FUSEDOFF_NOTHING()

DType storage_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float32;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: TORCH_CHECK(false, "fusedoff: ", what, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

const char* state_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kByte: return "uint8";
    case at::kShort: return "int16";
    default: return "a supported dtype";
  }
}

// A state tensor of `param`: fp32 with one value per element unless `dtype`/`numel` say otherwise
// (compressed states: bf16 or uint8 codes, and their block scales).
void check_state(const at::Tensor& state, const at::Tensor& param, const char* what, int64_t index,
                 at::ScalarType dtype = at::kFloat, int64_t numel = -1) {
  TORCH_CHECK(state.scalar_type() == dtype, "fusedoff: ", what, "[", index, "] must be ", state_dtype_name(dtype),
              ", got ", state.scalar_type());
  TORCH_CHECK(state.device() == param.device(), "fusedoff: ", what, "[", index, "] is on ", state.device(),
              " but its parameter is on ", param.device());
  TORCH_CHECK(state.is_contiguous(), "fusedoff: ", what, "[", index, "] must be contiguous");
  if (numel < 0) {
    TORCH_CHECK(state.numel() == param.numel(), "fusedoff: ", what, "[", index, "] has ", state.numel(),
                " elements but its parameter has ", param.numel());
  } else {
    TORCH_CHECK(state.numel() == numel, "fusedoff: ", what, "[", index, "] has ", state.numel(),
                " elements, expected ", numel);
  }
}

// How a call's master weights are stored, told by their dtype: fp32 whole; int16 or uint8 the low
// bits of a split master, whose upper half is the bf16 parameter (see [note: split master weights]).
MasterPrecision master_precision_of(at::TensorList master_params, at::TensorList params) {
  if (master_params.empty() || params.empty()) return master_params.empty() ? MasterPrecision::None : MasterPrecision::Float32;
  const at::ScalarType type = master_params[0].scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kShort || type == at::kByte,
              "fusedoff: master_params are float32 (whole), int16 or uint8 (split), got ", type);
  TORCH_CHECK(type == at::kFloat || params[0].scalar_type() == at::kBFloat16,
              "fusedoff: a split master weight (", type, " low bits) needs bfloat16 parameters, got ",
              params[0].scalar_type());
  return type == at::kFloat ? MasterPrecision::Float32 : type == at::kShort ? MasterPrecision::Split16 : MasterPrecision::Split8;
}

at::ScalarType master_storage_type(MasterPrecision precision) {
  return precision == MasterPrecision::Split16 ? at::kShort : precision == MasterPrecision::Split8 ? at::kByte : at::kFloat;
}

void check_scalar(const std::optional<at::Tensor>& t, const at::Device& device, const char* what) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->numel() == 1 && t->scalar_type() == at::kFloat, "fusedoff: ", what,
              " must be a one-element float32 tensor");
  TORCH_CHECK(t->device() == device, "fusedoff: ", what, " is on ", t->device(), " but the parameters are on ",
              device);
}

// The checks every fused op makes on the i-th parameter, its gradient and its step count.
void check_param_grad_step(at::TensorList params, at::TensorList grads, at::TensorList steps, int64_t i,
                           const at::Device& device) {
  const at::Tensor& p = params[i];
  const at::Tensor& g = grads[i];
  TORCH_CHECK(p.device() == device, "fusedoff: all params of one call must be on one device; params[", i,
              "] is on ", p.device(), ", params[0] on ", device);
  TORCH_CHECK(p.scalar_type() == params[0].scalar_type(), "fusedoff: all params of one call must share a dtype");
  TORCH_CHECK(g.scalar_type() == grads[0].scalar_type(), "fusedoff: all grads of one call must share a dtype");
  storage_dtype(g, "grads");
  TORCH_CHECK(!g.is_sparse(), "fusedoff: sparse gradients are not supported");
  TORCH_CHECK(p.is_contiguous() && g.is_contiguous(), "fusedoff: params[", i, "] and grads[", i,
              "] must be contiguous");
  TORCH_CHECK(g.device() == device, "fusedoff: grads[", i, "] is on ", g.device(), " but its parameter is on ",
              device);
  TORCH_CHECK(g.numel() == p.numel(), "fusedoff: grads[", i, "] has ", g.numel(), " elements but its parameter has ",
              p.numel());
  TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat && steps[i].device() == device,
              "fusedoff: steps[", i, "] must be a one-element float32 tensor on ", device);
}

// What every launch description takes once its tensors are checked: the per-tensor pointers and
// the device scalars GradScaler sets (read by the kernels on the device, never on the host).
template <typename Launch, typename Ptrs>
void attach_tensors(Launch& launch, const std::vector<Ptrs>& ptrs, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  launch.tensors = ptrs.data();
  launch.grad_scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  launch.found_inf = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
}

#if defined(FUSEDOFF_WITH_HOST_KERNELS)
// Runs a checked launch on the host kernels, with ATen's thread count.
template <typename Launch>
void run_on_cpu(Launch& launch, at::TensorList params, void (*kernel)(const Launch&)) {
  if (launch.num_tensors == 0) return;
  TORCH_CHECK(params[0].device().is_cpu(), "fusedoff: the cpu kernel got tensors on ", params[0].device());
  launch.num_threads = at::get_num_threads();
  kernel(launch);
}
#endif

#if defined(FUSEDOFF_WITH_CUDA)
// Runs a checked launch on the parameters' device, on its current stream; emulated, on CPU tensors,
// each launch finished before the next (there is one queue).
template <typename Launch, typename Kernel>
void run_on_cuda(Launch& launch, at::TensorList params, Kernel&& kernel) {
  if (launch.num_tensors == 0) return;
#if defined(FUSEDOFF_CUDA_EMULATION)
  TORCH_CHECK(params[0].device().is_cpu(), "fusedoff: the emulated CUDA kernels take CPU tensors, got ",
              params[0].device());
  launch.stream = nullptr;
#else
  const c10::cuda::CUDAGuard device_guard(params[0].device());
  launch.stream = c10::cuda::getCurrentCUDAStream().stream();
#endif
  kernel(launch);
}
#endif

// ---- Adam ---------------------------------------------------------------------------------------

// The Adam hyperparameters of both Adam ops (see [note: hyperparameter lists]). amsgrad is not one
// of them: it says which states a call has (the compressed op has no max_exp_avg_sqs).
#define FUSEDOFF_ADAM_HYPERPARAMETERS(X, SEP)                                                   \
  X(double, float, lr) SEP() X(double, float, beta1) SEP() X(double, float, beta2) SEP()         \
  X(double, float, eps) SEP() X(double, float, weight_decay) SEP()                               \
  X(bool, bool, decoupled_weight_decay) SEP() X(bool, bool, maximize)
#define FUSEDOFF_ADAM_HYPERPARAMETER_PARAMETERS FUSEDOFF_ADAM_HYPERPARAMETERS(FUSEDOFF_PARAMETER, FUSEDOFF_COMMA)
#define FUSEDOFF_ADAM_HYPERPARAMETER_ARGUMENTS FUSEDOFF_ADAM_HYPERPARAMETERS(FUSEDOFF_ARGUMENT, FUSEDOFF_COMMA)
#define FUSEDOFF_ADAM_HYPERPARAMETER_SCHEMA FUSEDOFF_ADAM_HYPERPARAMETERS(FUSEDOFF_SCHEMA_ARGUMENT, FUSEDOFF_SCHEMA_COMMA)

// What the kernels read, from the typed arguments of either Adam op.
AdamHyperparams adam_hyperparams(FUSEDOFF_ADAM_HYPERPARAMETER_PARAMETERS) {
  AdamHyperparams hyper{};
  FUSEDOFF_ADAM_HYPERPARAMETERS(FUSEDOFF_SET_FIELD, FUSEDOFF_NOTHING)
  return hyper;
}

// Validates a whole call before anything is written, then builds the launch description.
AdamLaunch describe_adam_call(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                              at::TensorList master_params, at::TensorList steps, const AdamHyperparams& hyper,
                              bool amsgrad, const std::optional<at::Tensor>& grad_scale,
                              const std::optional<at::Tensor>& found_inf, std::vector<AdamTensorPtrs>& ptrs) {
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                  exp_avg_sqs.size() == params.size() && steps.size() == params.size(),
              "fusedoff: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  TORCH_CHECK(max_exp_avg_sqs.size() == (amsgrad ? params.size() : 0),
              "fusedoff: max_exp_avg_sqs must have one tensor per parameter with amsgrad, none without");
  TORCH_CHECK(master_params.empty() || master_params.size() == params.size(),
              "fusedoff: master_params must be empty or have one tensor per parameter");
  AdamLaunch launch{};
  launch.num_tensors = n;
  launch.amsgrad = amsgrad;
  launch.master = master_precision_of(master_params, params);
  launch.hyper = hyper;
  if (n == 0) return launch;

  const at::Device device = params[0].device();
  launch.param_dtype = storage_dtype(params[0], "params");
  launch.grad_dtype = storage_dtype(grads[0], "grads");
  check_scalar(grad_scale, device, "grad_scale");
  check_scalar(found_inf, device, "found_inf");
  ptrs.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    check_param_grad_step(params, grads, steps, i, device);
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    check_state(exp_avgs[i], p, "exp_avgs", i);
    check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i);
    if (amsgrad) check_state(max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i);
    if (launch.master != MasterPrecision::None) {
      check_state(master_params[i], p, "master_params", i, master_storage_type(launch.master));
    }
    ptrs[i] = AdamTensorPtrs{p.data_ptr(),
                             g.data_ptr(),
                             exp_avgs[i].data_ptr<float>(),
                             exp_avg_sqs[i].data_ptr<float>(),
                             amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr,
                             launch.master != MasterPrecision::None ? master_params[i].data_ptr() : nullptr,
                             steps[i].data_ptr<float>(),
                             p.numel()};
  }
  attach_tensors(launch, ptrs, grad_scale, found_inf);
  return launch;
}

#define FUSEDOFF_ADAM_ARGS                                                                                        \
  at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,             \
      at::TensorList max_exp_avg_sqs, at::TensorList master_params, at::TensorList steps,                       \
      FUSEDOFF_ADAM_HYPERPARAMETER_PARAMETERS, bool amsgrad, const std::optional<at::Tensor>&grad_scale,         \
      const std::optional<at::Tensor>&found_inf
#define FUSEDOFF_ADAM_FORWARD                                                                                    \
  params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps,                                  \
      adam_hyperparams(FUSEDOFF_ADAM_HYPERPARAMETER_ARGUMENTS), amsgrad, grad_scale, found_inf

#if defined(FUSEDOFF_WITH_HOST_KERNELS)
void adam_step_cpu_op(FUSEDOFF_ADAM_ARGS) {
  std::vector<AdamTensorPtrs> ptrs;
  AdamLaunch launch = describe_adam_call(FUSEDOFF_ADAM_FORWARD, ptrs);
  run_on_cpu(launch, params, &adam_step_cpu);
}
#endif

#if defined(FUSEDOFF_WITH_CUDA)
void adam_step_cuda_op(FUSEDOFF_ADAM_ARGS) {
  std::vector<AdamTensorPtrs> ptrs;
  AdamLaunch launch = describe_adam_call(FUSEDOFF_ADAM_FORWARD, ptrs);
  run_on_cuda(launch, params, adam_step_cuda);
}
#endif

// ---- Adam with compressed moments (state_codec.h) ----------------------------------------------

CompressedAdamLaunch describe_compressed_adam_call(
    at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
    at::TensorList exp_avg_absmaxs, at::TensorList exp_avg_sq_absmaxs, at::TensorList master_params,
    at::TensorList steps, at::IntArrayRef offsets, at::IntArrayRef tensor_keys, const AdamHyperparams& hyper,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
    std::vector<CompressedAdamTensorPtrs>& ptrs) {
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                  exp_avg_sqs.size() == params.size() && steps.size() == params.size() &&
                  offsets.size() == params.size() && tensor_keys.size() == params.size(),
              "fusedoff: params, grads, exp_avgs, exp_avg_sqs, steps, offsets and tensor_keys must have the same "
              "length");
  TORCH_CHECK(master_params.empty() || master_params.size() == params.size(),
              "fusedoff: master_params must be empty or have one tensor per parameter");
  CompressedAdamLaunch launch{};
  launch.num_tensors = n;
  launch.master = master_precision_of(master_params, params);
  launch.hyper = hyper;
  if (n == 0) return launch;

  const at::ScalarType state_type = exp_avgs[0].scalar_type();
  TORCH_CHECK(state_type == at::kBFloat16 || state_type == at::kByte,
              "fusedoff: compressed states are bfloat16 or uint8 (8-bit codes), got ", state_type);
  const bool block8 = state_type == at::kByte;
  launch.precision = block8 ? StatePrecision::Block8 : StatePrecision::BFloat16;
  TORCH_CHECK(exp_avg_absmaxs.size() == (block8 ? params.size() : 0) &&
                  exp_avg_sq_absmaxs.size() == exp_avg_absmaxs.size(),
              "fusedoff: 8-bit states need one exp_avg_absmax and exp_avg_sq_absmax per parameter, bf16 states none");
  const at::Device device = params[0].device();
  launch.param_dtype = storage_dtype(params[0], "params");
  launch.grad_dtype = storage_dtype(grads[0], "grads");
  check_scalar(grad_scale, device, "grad_scale");
  check_scalar(found_inf, device, "found_inf");
  ptrs.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    check_param_grad_step(params, grads, steps, i, device);
    const at::Tensor& p = params[i];
    const int64_t blocks = (p.numel() + kQuantBlock - 1) / kQuantBlock;
    check_state(exp_avgs[i], p, "exp_avgs", i, state_type, p.numel());
    check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i, state_type, p.numel());
    if (block8) {
      check_state(exp_avg_absmaxs[i], p, "exp_avg_absmaxs", i, at::kFloat, blocks);
      check_state(exp_avg_sq_absmaxs[i], p, "exp_avg_sq_absmaxs", i, at::kFloat, blocks);
    }
    if (launch.master != MasterPrecision::None) {
      check_state(master_params[i], p, "master_params", i, master_storage_type(launch.master));
    }
    TORCH_CHECK(offsets[i] >= 0 && (!block8 || offsets[i] % kQuantBlock == 0), "fusedoff: offsets[", i, "] is ",
                offsets[i], "; ranges of 8-bit states start on a block of ", kQuantBlock, " elements");
    TORCH_CHECK(tensor_keys[i] >= 0 && tensor_keys[i] <= 0xffffffffLL, "fusedoff: tensor_keys[", i,
                "] must be a 32-bit unsigned value");
    ptrs[i] = CompressedAdamTensorPtrs{p.data_ptr(),
                                       grads[i].data_ptr(),
                                       exp_avgs[i].data_ptr(),
                                       exp_avg_sqs[i].data_ptr(),
                                       block8 ? exp_avg_absmaxs[i].data_ptr<float>() : nullptr,
                                       block8 ? exp_avg_sq_absmaxs[i].data_ptr<float>() : nullptr,
                                       launch.master != MasterPrecision::None ? master_params[i].data_ptr() : nullptr,
                                       steps[i].data_ptr<float>(),
                                       p.numel(),
                                       offsets[i],
                                       static_cast<uint32_t>(tensor_keys[i])};
  }
  attach_tensors(launch, ptrs, grad_scale, found_inf);
  return launch;
}

#define FUSEDOFF_COMPRESSED_ADAM_ARGS                                                                            \
  at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,             \
      at::TensorList exp_avg_absmaxs, at::TensorList exp_avg_sq_absmaxs, at::TensorList master_params,          \
      at::TensorList steps, at::IntArrayRef offsets, at::IntArrayRef tensor_keys,                               \
      FUSEDOFF_ADAM_HYPERPARAMETER_PARAMETERS, const std::optional<at::Tensor>&grad_scale,                       \
      const std::optional<at::Tensor>&found_inf
#define FUSEDOFF_COMPRESSED_ADAM_FORWARD                                                                         \
  params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmaxs, exp_avg_sq_absmaxs, master_params, steps, offsets,    \
      tensor_keys, adam_hyperparams(FUSEDOFF_ADAM_HYPERPARAMETER_ARGUMENTS), grad_scale, found_inf

#if defined(FUSEDOFF_WITH_HOST_KERNELS)
void adam_compressed_step_cpu_op(FUSEDOFF_COMPRESSED_ADAM_ARGS) {
  std::vector<CompressedAdamTensorPtrs> ptrs;
  CompressedAdamLaunch launch = describe_compressed_adam_call(FUSEDOFF_COMPRESSED_ADAM_FORWARD, ptrs);
  run_on_cpu(launch, params, &adam_compressed_step_cpu);
}
#endif

#if defined(FUSEDOFF_WITH_CUDA)
void adam_compressed_step_cuda_op(FUSEDOFF_COMPRESSED_ADAM_ARGS) {
  std::vector<CompressedAdamTensorPtrs> ptrs;
  CompressedAdamLaunch launch = describe_compressed_adam_call(FUSEDOFF_COMPRESSED_ADAM_FORWARD, ptrs);
  run_on_cuda(launch, params, adam_compressed_step_cuda);
}
#endif

// ---- Apollo -------------------------------------------------------------------------------

ApolloRebound parse_rebound(c10::string_view rebound) {
  if (rebound == "constant") return ApolloRebound::Constant;
  if (rebound == "belief") return ApolloRebound::Belief;
  TORCH_CHECK(false, "fusedoff: rebound must be 'constant' or 'belief', got '", rebound, "'");
}

ApolloDecay parse_decay(double weight_decay, c10::string_view type) {
  ApolloDecay decay;
  if (type == "L2") decay = ApolloDecay::L2;
  else if (type == "decoupled") decay = ApolloDecay::Decoupled;
  else if (type == "stable") decay = ApolloDecay::Stable;
  else TORCH_CHECK(false, "fusedoff: weight_decay_type must be 'L2', 'decoupled' or 'stable', got '", type, "'");
  return weight_decay == 0.0 ? ApolloDecay::None : decay;
}

ApolloPhase parse_phase(c10::string_view phase) {
  if (phase == "reduce") return ApolloPhase::Reduce;
  if (phase == "full") return ApolloPhase::Full;
  if (phase == "moments") return ApolloPhase::Moments;
  if (phase == "finish") return ApolloPhase::Finish;
  TORCH_CHECK(false, "fusedoff: phase must be 'reduce', 'full', 'moments' or 'finish', got '", phase, "'");
}

// The Apollo hyperparameters (see [note: hyperparameter lists]); the phase is the call's, not one of them.
#define FUSEDOFF_APOLLO_HYPERPARAMETERS(X, SEP)                                                  \
  X(double, float, lr) SEP() X(double, float, base_lr) SEP() X(double, float, init_lr) SEP()     \
  X(double, float, warmup) SEP() X(double, float, beta) SEP() X(double, float, eps) SEP()        \
  X(double, float, weight_decay) SEP() X(c10::string_view, str, rebound) SEP()                   \
  X(c10::string_view, str, weight_decay_type)

// What the kernels read, from the op's typed arguments: the modes parsed from their names.
ApolloHyperparams apollo_hyperparams(FUSEDOFF_APOLLO_HYPERPARAMETERS(FUSEDOFF_PARAMETER, FUSEDOFF_COMMA)) {
  return ApolloHyperparams{lr, base_lr, init_lr, warmup, beta, eps, weight_decay, parse_rebound(rebound),
                           parse_decay(weight_decay, weight_decay_type)};
}

ApolloLaunch describe_apollo_call(at::TensorList params, at::TensorList grads, at::TensorList exp_avg_grads,
                                  at::TensorList approx_hessians, at::TensorList updates,
                                  at::TensorList master_params, at::TensorList steps, at::TensorList stats,
                                  at::IntArrayRef total_numels, c10::string_view phase,
                                  const ApolloHyperparams& hyper, const std::optional<at::Tensor>& grad_scale,
                                  const std::optional<at::Tensor>& found_inf, std::vector<ApolloTensorPtrs>& ptrs) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avg_grads.size() == n && approx_hessians.size() == n && updates.size() == n &&
                  steps.size() == n && stats.size() == n && total_numels.size() == n,
              "fusedoff: params, grads, exp_avg_grads, approx_hessians, updates, steps, stats and total_numels must "
              "have the same length");
  TORCH_CHECK(master_params.empty() || master_params.size() == n,
              "fusedoff: master_params must be empty or have one tensor per parameter");
  ApolloLaunch launch{};
  launch.num_tensors = static_cast<int64_t>(n);
  launch.master = master_precision_of(master_params, params);
  launch.phase = parse_phase(phase);
  launch.hyper = hyper;
  if (n == 0) return launch;
  const at::Device device = params[0].device();
  launch.param_dtype = storage_dtype(params[0], "params");
  launch.grad_dtype = storage_dtype(grads[0], "grads");
  check_scalar(grad_scale, device, "grad_scale");
  check_scalar(found_inf, device, "found_inf");
  ptrs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t idx = static_cast<int64_t>(i);
    check_param_grad_step(params, grads, steps, idx, device);
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    check_state(exp_avg_grads[i], p, "exp_avg_grads", idx);
    check_state(approx_hessians[i], p, "approx_hessians", idx);
    check_state(updates[i], p, "updates", idx);
    if (launch.master != MasterPrecision::None) {
      check_state(master_params[i], p, "master_params", idx, master_storage_type(launch.master));
    }
    TORCH_CHECK(stats[i].numel() == kNumApolloStats && stats[i].scalar_type() == at::kDouble &&
                    stats[i].device() == device && stats[i].is_contiguous(),
                "fusedoff: stats[", i, "] must be a contiguous float64 tensor of ", kNumApolloStats, " elements on ",
                device);
    TORCH_CHECK(total_numels[i] >= p.numel(), "fusedoff: total_numels[", i, "] = ", total_numels[i],
                " is smaller than the range's ", p.numel(), " elements");
    ptrs[i] = ApolloTensorPtrs{p.data_ptr(),
                               g.data_ptr(),
                               exp_avg_grads[i].data_ptr<float>(),
                               approx_hessians[i].data_ptr<float>(),
                               updates[i].data_ptr<float>(),
                               launch.master != MasterPrecision::None ? master_params[i].data_ptr() : nullptr,
                               steps[i].data_ptr<float>(),
                               stats[i].data_ptr<double>(),
                               p.numel(),
                               total_numels[i]};
  }
  attach_tensors(launch, ptrs, grad_scale, found_inf);
  return launch;
}

#define FUSEDOFF_APOLLO_ARGS                                                                                     \
  at::TensorList params, at::TensorList grads, at::TensorList exp_avg_grads, at::TensorList approx_hessians,    \
      at::TensorList updates, at::TensorList master_params, at::TensorList steps, at::TensorList stats,         \
      at::IntArrayRef total_numels, c10::string_view phase,                                                     \
      FUSEDOFF_APOLLO_HYPERPARAMETERS(FUSEDOFF_PARAMETER, FUSEDOFF_COMMA),                                       \
      const std::optional<at::Tensor>&grad_scale, const std::optional<at::Tensor>&found_inf
#define FUSEDOFF_APOLLO_FORWARD                                                                                  \
  params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, stats, total_numels, phase,      \
      apollo_hyperparams(FUSEDOFF_APOLLO_HYPERPARAMETERS(FUSEDOFF_ARGUMENT, FUSEDOFF_COMMA)), grad_scale,        \
      found_inf

#if defined(FUSEDOFF_WITH_HOST_KERNELS)
void apollo_step_cpu_op(FUSEDOFF_APOLLO_ARGS) {
  std::vector<ApolloTensorPtrs> ptrs;
  ApolloLaunch launch = describe_apollo_call(FUSEDOFF_APOLLO_FORWARD, ptrs);
  run_on_cpu(launch, params, &apollo_step_cpu);
}
#endif

#if defined(FUSEDOFF_WITH_CUDA)
void apollo_step_cuda_op(FUSEDOFF_APOLLO_ARGS) {
  std::vector<ApolloTensorPtrs> ptrs;
  ApolloLaunch launch = describe_apollo_call(FUSEDOFF_APOLLO_FORWARD, ptrs);
  run_on_cuda(launch, params, [&](ApolloLaunch& l) {
    // From the caching allocator, on the current stream (set by run_on_cuda): freed when the op
    // returns, handed out again only to work queued after these kernels on that stream.
    const at::Tensor workspace = at::empty({apollo_cuda_workspace_bytes(l)}, params[0].options().dtype(at::kByte));
    l.workspace = workspace.data_ptr();
    apollo_step_cuda(l);
  });
}
#endif

#if defined(FUSEDOFF_WITH_HOST_KERNELS)
// ---- the 8-bit codec on whole tensors (checkpoints) ------------------------------------------------
void check_flat(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype, "fusedoff: ", what, " must be ", state_dtype_name(dtype), ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "fusedoff: ", what, " must be flat and contiguous, got shape ",
              t.sizes(), " and strides ", t.strides());
}

int64_t quant_blocks(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

std::tuple<at::Tensor, at::Tensor> encode_8bit_cpu_op(const at::Tensor& values, bool is_signed) {
  check_flat(values, at::kFloat, "values");
  at::Tensor codes = at::empty({values.numel()}, values.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({quant_blocks(values.numel())}, values.options());
  encode_8bit_cpu(values.data_ptr<float>(), values.numel(), is_signed, codes.data_ptr<uint8_t>(),
                  absmax.data_ptr<float>(), at::get_num_threads());
  return {codes, absmax};
}

at::Tensor decode_8bit_cpu_op(const at::Tensor& codes, const at::Tensor& absmax, bool is_signed) {
  check_flat(codes, at::kByte, "codes");
  check_flat(absmax, at::kFloat, "absmax");
  TORCH_CHECK(absmax.numel() == quant_blocks(codes.numel()), "fusedoff: ", codes.numel(), " codes need ",
              quant_blocks(codes.numel()), " block scales, got ", absmax.numel());
  at::Tensor values = at::empty({codes.numel()}, absmax.options());
  decode_8bit_cpu(codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), codes.numel(), is_signed,
                  values.data_ptr<float>(), at::get_num_threads());
  return values;
}

// Host only: a checkpoint's states are in host memory, or decoded where they are by the PyTorch codec.
void define_codec_ops(torch::Library& m) {
  m.def("encode_8bit(Tensor values, bool is_signed) -> (Tensor codes, Tensor absmax)");
  m.def("decode_8bit(Tensor codes, Tensor absmax, bool is_signed) -> Tensor");
}
#endif

// The schemas, the same for fusedoff._C and the emulated build.
void define_fused_ops(torch::Library& m) {
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] master_params, Tensor[] steps, *, " FUSEDOFF_ADAM_HYPERPARAMETER_SCHEMA
      ", bool amsgrad, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  // Adam with compressed moments: bf16 (stochastic rounding) or 8-bit codes with block scales, by
  // the states' dtype (csrc/include/fusedoff/state_codec.h).
  m.def(
      "adam_compressed_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] exp_avg_absmaxs, Tensor(e!)[] exp_avg_sq_absmaxs, Tensor(f!)[] master_params, Tensor[] steps, "
      "int[] offsets, int[] tensor_keys, *, " FUSEDOFF_ADAM_HYPERPARAMETER_SCHEMA
      ", Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
  // One phase of an Apollo step over tensors or ranges of tensors (see csrc/include/fusedoff/apollo.h):
  // 'reduce' adds into `stats` (mutated), 'full' and 'finish' write params and states, 'moments'
  // writes m, B and stats.
  m.def(
      "apollo_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg_grads, Tensor(c!)[] approx_hessians, "
      "Tensor(d!)[] updates, Tensor(e!)[] master_params, Tensor[] steps, Tensor(f!)[] stats, int[] total_numels, *, "
      "str phase, " FUSEDOFF_APOLLO_HYPERPARAMETERS(FUSEDOFF_SCHEMA_ARGUMENT, FUSEDOFF_SCHEMA_COMMA)
      ", Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
}

#if defined(FUSEDOFF_WITH_CUDA)
void register_device_kernels(torch::Library& m) {
  m.impl("adam_step_", &adam_step_cuda_op);
  m.impl("adam_compressed_step_", &adam_compressed_step_cuda_op);
  m.impl("apollo_step_", &apollo_step_cuda_op);
}
#endif

}  // namespace
}  // namespace fusedoff

#if defined(FUSEDOFF_CUDA_EMULATION)
// The device kernels on CPU tensors, under a namespace of their own beside torch.ops.fusedoff.
TORCH_LIBRARY(fusedoff_emulated, m) { fusedoff::define_fused_ops(m); }
TORCH_LIBRARY_IMPL(fusedoff_emulated, CPU, m) { fusedoff::register_device_kernels(m); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedoff's CUDA kernels run on the host by the CUDA emulation (tests only); the ops are "
            "registered under torch.ops.fusedoff_emulated";
  m.attr("torch_version") = std::string(TORCH_VERSION);
  m.def("set_schedule_seed", &fusedoff::emulation::set_schedule_seed,
        "order the blocks, and the threads between barriers, by this seed (0: index order)");
  m.def("launches", &fusedoff::emulation::launch_count, "kernel launches run so far (failed ones included)");
  m.def("selftest_names", &fusedoff::emulation_selftest::selftest_names);
  m.def("selftest", &fusedoff::emulation_selftest::selftest,
        "run one of the emulator's self-test kernels: (outputs, the launch's error message or '')");
}
#else
TORCH_LIBRARY(fusedoff, m) {
  fusedoff::define_fused_ops(m);
  fusedoff::define_codec_ops(m);
}

TORCH_LIBRARY_IMPL(fusedoff, CPU, m) {
  m.impl("adam_step_", &fusedoff::adam_step_cpu_op);
  m.impl("adam_compressed_step_", &fusedoff::adam_compressed_step_cpu_op);
  m.impl("apollo_step_", &fusedoff::apollo_step_cpu_op);
  m.impl("encode_8bit", &fusedoff::encode_8bit_cpu_op);
  m.impl("decode_8bit", &fusedoff::decode_8bit_cpu_op);
}

#if defined(FUSEDOFF_WITH_CUDA)
TORCH_LIBRARY_IMPL(fusedoff, CUDA, m) { fusedoff::register_device_kernels(m); }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedoff native kernels; the ops themselves are registered under torch.ops.fusedoff";
  m.attr("torch_version") = std::string(TORCH_VERSION);
#if defined(FUSEDOFF_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("cpu_isa", &fusedoff::cpu_isa_name, "instruction set the host kernels dispatch to on this CPU");
  // The host kernels' self-tests (cpu/selftests.h), for the tests only: a submodule of their own,
  // never ops.
  py::module_ testing = m.def_submodule("testing", "the host kernels' self-tests (tests only; not an API)");
  testing.def(
      "split_master_selftest",
      [](uint32_t salt, int num_threads) {
        const fusedoff::selftests::SplitMaster r = fusedoff::selftests::split_master(salt, num_threads);
        return std::make_tuple(r.split_failures, r.split8_failures, r.split8_outside_bound, r.roundings_off);
      },
      "over all 2^32 fp32 values: failures of (split round trip, split8 round trip, split8 bound, "
      "parameter rounding); see [note: split master weights]");
  testing.def("written_param_selftest", &fusedoff::selftests::written_param,
              "over all 2^32 fp32 masters and 4 bf16 parameters each: pairs where master_or_param keeps a "
              "master it should take from the parameter or the reverse; see [note: every write is seen]");
  testing.def(
      "split_master_lanes_selftest",
      [](uint32_t salt, int num_threads) -> py::object {
        const fusedoff::selftests::SplitMasterLanes r = fusedoff::selftests::split_master_lanes(salt, num_threads);
        if (!r.checked) return py::none();
        return py::make_tuple(r.split_off, r.split8_off);
      },
      "over all 2^32 fp32 values: the host kernels' 16-lane (split, split8) masters that differ from "
      "master.h's scalar ones; None without AVX-512");
  testing.def(
      "state_codec_selftest",
      [](int num_threads) -> py::object {
        const fusedoff::selftests::StateCodec r = fusedoff::selftests::state_codec(num_threads);
        if (!r.checked) return py::none();
        return py::make_tuple(r.encode_signed_off, r.encode_unsigned_off, r.decode_signed_off, r.decode_unsigned_off);
      },
      "the host kernels' AVX-512 8-bit codec against state_codec.h: differing (encode signed, encode "
      "unsigned) over every fp32 value, (decode signed, decode unsigned) over every code; None without AVX-512");
}
#endif
