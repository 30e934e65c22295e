// The one file that sees torch's tensors: schemas, argument checks, device guards, and the
// translation of tensors and typed hyperparameters into the plain launch descriptions (AdamLaunch,
// ...) that the ATen-free kernels take.
//
// [note: one binary for every torch] Written against torch's stable C ABI (torch/csrc/stable:
// torch::stable::Tensor, STABLE_TORCH_LIBRARY, the aoti_torch_* shims), never ATen or c10's C++
// classes, and built with TORCH_TARGET_VERSION set to the oldest torch supported (_build.py): the
// library calls only what that torch exports, so one build loads in it and every later torch
// (tests/test_stable_abi.py holds it to that). The Python module is an empty shell on Python's
// limited API (one build for every CPython from 3.10); everything callable is an op.
//
// Compiled twice: for fusedoff._C (the host kernels, and the CUDA kernels with FUSEDOFF_WITH_CUDA),
// and, with FUSEDOFF_CUDA_EMULATION, for the test build fusedoff._C_emulated: the CUDA kernels
// compiled as host C++ (csrc/emulation), registered as torch.ops.fusedoff_emulated for CPU tensors,
// behind the same checks and launch descriptions.
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000  // CPython 3.10, as setup.py's py_limited_api (the JIT build too)
#endif
#include <Python.h>

#if defined(FUSEDOFF_WITH_CUDA) && !defined(FUSEDOFF_CUDA_EMULATION) && !defined(USE_CUDA)
#define USE_CUDA 1  // torch's shim.h declares its CUDA shims (the current stream) only with it
#endif

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "fusedoff/launchers.h"

#if defined(FUSEDOFF_CUDA_EMULATION)
#include "emulation_control.h"
#else
#define FUSEDOFF_WITH_HOST_KERNELS 1
#include "cpu/selftests.h"
#endif

namespace fusedoff {
namespace {

using torch::headeronly::Layout;
using torch::headeronly::ScalarType;
using torch::stable::Device;
using torch::stable::Tensor;
using Library = torch::stable::detail::StableLibrary;
// The argument types TORCH_BOX unboxes a schema's Tensor[] and int[] into.
using TensorList = std::vector<Tensor>;
using IntList = std::vector<int64_t>;

// For error messages: torch::stable::Device has no printer of its own.
std::string device_name(const Device& device) {
  std::string name = device.is_cpu()    ? "cpu"
                     : device.is_cuda() ? "cuda"
                                        : "device type " + std::to_string(static_cast<int>(device.type()));
  return device.has_index() ? name + ":" + std::to_string(device.index()) : name;
}

std::string shape_text(torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  std::ostringstream text;
  text << "[";
  for (size_t i = 0; i < sizes.size(); ++i) text << (i ? ", " : "") << sizes[i];
  text << "]";
  return text.str();
}

// ATen's intra-op thread count (torch.get_num_threads()), for the host kernels' OpenMP teams.
int host_threads() { return static_cast<int>(torch::stable::get_num_threads()); }

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

DType storage_dtype(const Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case ScalarType::Float: return DType::Float32;
    case ScalarType::Half: return DType::Float16;
    case ScalarType::BFloat16: return DType::BFloat16;
    default: STD_TORCH_CHECK(false, "fusedoff: ", what, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

const char* state_dtype_name(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::Float: return "float32";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Short: return "int16";
    default: return "a supported dtype";
  }
}

// A state tensor of `param`: fp32 with one value per element unless `dtype`/`numel` say otherwise
// (compressed states: bf16 or uint8 codes, and their block scales).
void check_state(const Tensor& state, const Tensor& param, const char* what, int64_t index,
                 ScalarType dtype = ScalarType::Float, int64_t numel = -1) {
  STD_TORCH_CHECK(state.scalar_type() == dtype, "fusedoff: ", what, "[", index, "] must be ", state_dtype_name(dtype),
                  ", got ", state.scalar_type());
  STD_TORCH_CHECK(state.device() == param.device(), "fusedoff: ", what, "[", index, "] is on ",
                  device_name(state.device()), " but its parameter is on ", device_name(param.device()));
  STD_TORCH_CHECK(state.is_contiguous(), "fusedoff: ", what, "[", index, "] must be contiguous");
  if (numel < 0) {
    STD_TORCH_CHECK(state.numel() == param.numel(), "fusedoff: ", what, "[", index, "] has ", state.numel(),
                    " elements but its parameter has ", param.numel());
  } else {
    STD_TORCH_CHECK(state.numel() == numel, "fusedoff: ", what, "[", index, "] has ", state.numel(),
                    " elements, expected ", numel);
  }
}

// How a call's master weights are stored, told by their dtype: fp32 whole; int16 or uint8 the low
// bits of a split master, whose upper half is the bf16 parameter (see [note: split master weights]).
MasterPrecision master_precision_of(const TensorList& master_params, const TensorList& params) {
  if (master_params.empty() || params.empty()) {
    return master_params.empty() ? MasterPrecision::None : MasterPrecision::Float32;
  }
  const ScalarType type = master_params[0].scalar_type();
  STD_TORCH_CHECK(type == ScalarType::Float || type == ScalarType::Short || type == ScalarType::Byte,
                  "fusedoff: master_params are float32 (whole), int16 or uint8 (split), got ", type);
  STD_TORCH_CHECK(type == ScalarType::Float || params[0].scalar_type() == ScalarType::BFloat16,
                  "fusedoff: a split master weight (", type, " low bits) needs bfloat16 parameters, got ",
                  params[0].scalar_type());
  return type == ScalarType::Float   ? MasterPrecision::Float32
         : type == ScalarType::Short ? MasterPrecision::Split16
                                     : MasterPrecision::Split8;
}

ScalarType master_storage_type(MasterPrecision precision) {
  return precision == MasterPrecision::Split16  ? ScalarType::Short
         : precision == MasterPrecision::Split8 ? ScalarType::Byte
                                                : ScalarType::Float;
}

void check_scalar(const std::optional<Tensor>& t, const Device& device, const char* what) {
  if (!t.has_value()) return;
  STD_TORCH_CHECK(t->numel() == 1 && t->scalar_type() == ScalarType::Float, "fusedoff: ", what,
                  " must be a one-element float32 tensor");
  STD_TORCH_CHECK(t->device() == device, "fusedoff: ", what, " is on ", device_name(t->device()),
                  " but the parameters are on ", device_name(device));
}

// The checks every fused op makes on the i-th parameter, its gradient and its step count.
void check_param_grad_step(const TensorList& params, const TensorList& grads, const TensorList& steps, int64_t i,
                           const Device& device) {
  const Tensor& p = params[i];
  const Tensor& g = grads[i];
  STD_TORCH_CHECK(p.device() == device, "fusedoff: all params of one call must be on one device; params[", i,
                  "] is on ", device_name(p.device()), ", params[0] on ", device_name(device));
  STD_TORCH_CHECK(p.scalar_type() == params[0].scalar_type(), "fusedoff: all params of one call must share a dtype");
  STD_TORCH_CHECK(g.scalar_type() == grads[0].scalar_type(), "fusedoff: all grads of one call must share a dtype");
  storage_dtype(g, "grads");
  STD_TORCH_CHECK(g.layout() == Layout::Strided, "fusedoff: sparse gradients are not supported");
  STD_TORCH_CHECK(p.is_contiguous() && g.is_contiguous(), "fusedoff: params[", i, "] and grads[", i,
                  "] must be contiguous");
  STD_TORCH_CHECK(g.device() == device, "fusedoff: grads[", i, "] is on ", device_name(g.device()),
                  " but its parameter is on ", device_name(device));
  STD_TORCH_CHECK(g.numel() == p.numel(), "fusedoff: grads[", i, "] has ", g.numel(),
                  " elements but its parameter has ", p.numel());
  STD_TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == ScalarType::Float && steps[i].device() == device,
                  "fusedoff: steps[", i, "] must be a one-element float32 tensor on ", device_name(device));
}

// What every launch description takes once its tensors are checked: the per-tensor pointers and
// the device scalars GradScaler sets (read by the kernels on the device, never on the host).
template <typename Launch, typename Ptrs>
void attach_tensors(Launch& launch, const std::vector<Ptrs>& ptrs, const std::optional<Tensor>& grad_scale,
                    const std::optional<Tensor>& found_inf) {
  launch.tensors = ptrs.data();
  launch.grad_scale = grad_scale.has_value() ? grad_scale->mutable_data_ptr<float>() : nullptr;
  launch.found_inf = found_inf.has_value() ? found_inf->mutable_data_ptr<float>() : nullptr;
}

#if defined(FUSEDOFF_WITH_HOST_KERNELS)
// Runs a checked launch on the host kernels, with ATen's thread count.
template <typename Launch>
void run_on_cpu(Launch& launch, const TensorList& params, void (*kernel)(const Launch&)) {
  if (launch.num_tensors == 0) return;
  STD_TORCH_CHECK(params[0].device().is_cpu(), "fusedoff: the cpu kernel got tensors on ",
                  device_name(params[0].device()));
  launch.num_threads = host_threads();
  kernel(launch);
}
#endif

#if defined(FUSEDOFF_WITH_CUDA)
// Runs a checked launch on the parameters' device, on its current stream; emulated, on CPU tensors,
// each launch finished before the next (there is one queue).
template <typename Launch, typename Kernel>
void run_on_cuda(Launch& launch, const TensorList& params, Kernel&& kernel) {
  if (launch.num_tensors == 0) return;
#if defined(FUSEDOFF_CUDA_EMULATION)
  STD_TORCH_CHECK(params[0].device().is_cpu(), "fusedoff: the emulated CUDA kernels take CPU tensors, got ",
                  device_name(params[0].device()));
  launch.stream = nullptr;
#else
  const int32_t index = params[0].get_device_index();
  const torch::stable::accelerator::DeviceGuard device_guard(index);
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(index, &launch.stream));
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
AdamLaunch describe_adam_call(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                              const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs,
                              const TensorList& master_params, const TensorList& steps, const AdamHyperparams& hyper,
                              bool amsgrad, const std::optional<Tensor>& grad_scale,
                              const std::optional<Tensor>& found_inf, std::vector<AdamTensorPtrs>& ptrs) {
  const int64_t n = static_cast<int64_t>(params.size());
  STD_TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                      exp_avg_sqs.size() == params.size() && steps.size() == params.size(),
                  "fusedoff: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  STD_TORCH_CHECK(max_exp_avg_sqs.size() == (amsgrad ? params.size() : 0),
                  "fusedoff: max_exp_avg_sqs must have one tensor per parameter with amsgrad, none without");
  STD_TORCH_CHECK(master_params.empty() || master_params.size() == params.size(),
                  "fusedoff: master_params must be empty or have one tensor per parameter");
  AdamLaunch launch{};
  launch.num_tensors = n;
  launch.amsgrad = amsgrad;
  launch.master = master_precision_of(master_params, params);
  launch.hyper = hyper;
  if (n == 0) return launch;

  const Device device = params[0].device();
  launch.param_dtype = storage_dtype(params[0], "params");
  launch.grad_dtype = storage_dtype(grads[0], "grads");
  check_scalar(grad_scale, device, "grad_scale");
  check_scalar(found_inf, device, "found_inf");
  ptrs.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    check_param_grad_step(params, grads, steps, i, device);
    const Tensor& p = params[i];
    const Tensor& g = grads[i];
    check_state(exp_avgs[i], p, "exp_avgs", i);
    check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i);
    if (amsgrad) check_state(max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i);
    if (launch.master != MasterPrecision::None) {
      check_state(master_params[i], p, "master_params", i, master_storage_type(launch.master));
    }
    ptrs[i] = AdamTensorPtrs{p.mutable_data_ptr(),
                             g.mutable_data_ptr(),
                             exp_avgs[i].mutable_data_ptr<float>(),
                             exp_avg_sqs[i].mutable_data_ptr<float>(),
                             amsgrad ? max_exp_avg_sqs[i].mutable_data_ptr<float>() : nullptr,
                             launch.master != MasterPrecision::None ? master_params[i].mutable_data_ptr() : nullptr,
                             steps[i].mutable_data_ptr<float>(),
                             p.numel()};
  }
  attach_tensors(launch, ptrs, grad_scale, found_inf);
  return launch;
}

#define FUSEDOFF_ADAM_ARGS                                                                               \
  const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,                         \
      const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& master_params, \
      const TensorList& steps, FUSEDOFF_ADAM_HYPERPARAMETER_PARAMETERS, bool amsgrad,                    \
      const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf
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
    const TensorList& params, const TensorList& grads, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
    const TensorList& exp_avg_absmaxs, const TensorList& exp_avg_sq_absmaxs, const TensorList& master_params,
    const TensorList& steps, const IntList& offsets, const IntList& tensor_keys, const AdamHyperparams& hyper,
    const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf,
    std::vector<CompressedAdamTensorPtrs>& ptrs) {
  const int64_t n = static_cast<int64_t>(params.size());
  STD_TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                      exp_avg_sqs.size() == params.size() && steps.size() == params.size() &&
                      offsets.size() == params.size() && tensor_keys.size() == params.size(),
                  "fusedoff: params, grads, exp_avgs, exp_avg_sqs, steps, offsets and tensor_keys must have the same "
                  "length");
  STD_TORCH_CHECK(master_params.empty() || master_params.size() == params.size(),
                  "fusedoff: master_params must be empty or have one tensor per parameter");
  CompressedAdamLaunch launch{};
  launch.num_tensors = n;
  launch.master = master_precision_of(master_params, params);
  launch.hyper = hyper;
  if (n == 0) return launch;

  const ScalarType state_type = exp_avgs[0].scalar_type();
  STD_TORCH_CHECK(state_type == ScalarType::BFloat16 || state_type == ScalarType::Byte,
                  "fusedoff: compressed states are bfloat16 or uint8 (8-bit codes), got ", state_type);
  const bool block8 = state_type == ScalarType::Byte;
  launch.precision = block8 ? StatePrecision::Block8 : StatePrecision::BFloat16;
  STD_TORCH_CHECK(exp_avg_absmaxs.size() == (block8 ? params.size() : 0) &&
                      exp_avg_sq_absmaxs.size() == exp_avg_absmaxs.size(),
                  "fusedoff: 8-bit states need one exp_avg_absmax and exp_avg_sq_absmax per parameter, bf16 states "
                  "none");
  const Device device = params[0].device();
  launch.param_dtype = storage_dtype(params[0], "params");
  launch.grad_dtype = storage_dtype(grads[0], "grads");
  check_scalar(grad_scale, device, "grad_scale");
  check_scalar(found_inf, device, "found_inf");
  ptrs.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    check_param_grad_step(params, grads, steps, i, device);
    const Tensor& p = params[i];
    const int64_t blocks = (p.numel() + kQuantBlock - 1) / kQuantBlock;
    check_state(exp_avgs[i], p, "exp_avgs", i, state_type, p.numel());
    check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i, state_type, p.numel());
    if (block8) {
      check_state(exp_avg_absmaxs[i], p, "exp_avg_absmaxs", i, ScalarType::Float, blocks);
      check_state(exp_avg_sq_absmaxs[i], p, "exp_avg_sq_absmaxs", i, ScalarType::Float, blocks);
    }
    if (launch.master != MasterPrecision::None) {
      check_state(master_params[i], p, "master_params", i, master_storage_type(launch.master));
    }
    STD_TORCH_CHECK(offsets[i] >= 0 && (!block8 || offsets[i] % kQuantBlock == 0), "fusedoff: offsets[", i, "] is ",
                    offsets[i], "; ranges of 8-bit states start on a block of ", kQuantBlock, " elements");
    STD_TORCH_CHECK(tensor_keys[i] >= 0 && tensor_keys[i] <= 0xffffffffLL, "fusedoff: tensor_keys[", i,
                    "] must be a 32-bit unsigned value");
    ptrs[i] = CompressedAdamTensorPtrs{p.mutable_data_ptr(),
                                       grads[i].mutable_data_ptr(),
                                       exp_avgs[i].mutable_data_ptr(),
                                       exp_avg_sqs[i].mutable_data_ptr(),
                                       block8 ? exp_avg_absmaxs[i].mutable_data_ptr<float>() : nullptr,
                                       block8 ? exp_avg_sq_absmaxs[i].mutable_data_ptr<float>() : nullptr,
                                       launch.master != MasterPrecision::None ? master_params[i].mutable_data_ptr()
                                                                              : nullptr,
                                       steps[i].mutable_data_ptr<float>(),
                                       p.numel(),
                                       offsets[i],
                                       static_cast<uint32_t>(tensor_keys[i])};
  }
  attach_tensors(launch, ptrs, grad_scale, found_inf);
  return launch;
}

#define FUSEDOFF_COMPRESSED_ADAM_ARGS                                                                               \
  const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,                                    \
      const TensorList& exp_avg_sqs, const TensorList& exp_avg_absmaxs, const TensorList& exp_avg_sq_absmaxs,       \
      const TensorList& master_params, const TensorList& steps, const IntList& offsets, const IntList& tensor_keys, \
      FUSEDOFF_ADAM_HYPERPARAMETER_PARAMETERS, const std::optional<Tensor>& grad_scale,                             \
      const std::optional<Tensor>& found_inf
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

ApolloRebound parse_rebound(std::string_view rebound) {
  if (rebound == "constant") return ApolloRebound::Constant;
  if (rebound == "belief") return ApolloRebound::Belief;
  STD_TORCH_CHECK(false, "fusedoff: rebound must be 'constant' or 'belief', got '", rebound, "'");
}

ApolloDecay parse_decay(double weight_decay, std::string_view type) {
  ApolloDecay decay;
  if (type == "L2") decay = ApolloDecay::L2;
  else if (type == "decoupled") decay = ApolloDecay::Decoupled;
  else if (type == "stable") decay = ApolloDecay::Stable;
  else STD_TORCH_CHECK(false, "fusedoff: weight_decay_type must be 'L2', 'decoupled' or 'stable', got '", type, "'");
  return weight_decay == 0.0 ? ApolloDecay::None : decay;
}

ApolloPhase parse_phase(std::string_view phase) {
  if (phase == "reduce") return ApolloPhase::Reduce;
  if (phase == "full") return ApolloPhase::Full;
  if (phase == "moments") return ApolloPhase::Moments;
  if (phase == "finish") return ApolloPhase::Finish;
  STD_TORCH_CHECK(false, "fusedoff: phase must be 'reduce', 'full', 'moments' or 'finish', got '", phase, "'");
}

// The Apollo hyperparameters (see [note: hyperparameter lists]); the phase is the call's, not one of them.
#define FUSEDOFF_APOLLO_HYPERPARAMETERS(X, SEP)                                                  \
  X(double, float, lr) SEP() X(double, float, base_lr) SEP() X(double, float, init_lr) SEP()     \
  X(double, float, warmup) SEP() X(double, float, beta) SEP() X(double, float, eps) SEP()        \
  X(double, float, weight_decay) SEP() X(std::string_view, str, rebound) SEP()                   \
  X(std::string_view, str, weight_decay_type)

// What the kernels read, from the op's typed arguments: the modes parsed from their names.
ApolloHyperparams apollo_hyperparams(FUSEDOFF_APOLLO_HYPERPARAMETERS(FUSEDOFF_PARAMETER, FUSEDOFF_COMMA)) {
  return ApolloHyperparams{lr, base_lr, init_lr, warmup, beta, eps, weight_decay, parse_rebound(rebound),
                           parse_decay(weight_decay, weight_decay_type)};
}

ApolloLaunch describe_apollo_call(const TensorList& params, const TensorList& grads, const TensorList& exp_avg_grads,
                                  const TensorList& approx_hessians, const TensorList& updates,
                                  const TensorList& master_params, const TensorList& steps, const TensorList& stats,
                                  const IntList& total_numels, std::string_view phase,
                                  const ApolloHyperparams& hyper, const std::optional<Tensor>& grad_scale,
                                  const std::optional<Tensor>& found_inf, std::vector<ApolloTensorPtrs>& ptrs) {
  const size_t n = params.size();
  STD_TORCH_CHECK(grads.size() == n && exp_avg_grads.size() == n && approx_hessians.size() == n && updates.size() == n &&
                      steps.size() == n && stats.size() == n && total_numels.size() == n,
                  "fusedoff: params, grads, exp_avg_grads, approx_hessians, updates, steps, stats and total_numels must "
                  "have the same length");
  STD_TORCH_CHECK(master_params.empty() || master_params.size() == n,
                  "fusedoff: master_params must be empty or have one tensor per parameter");
  ApolloLaunch launch{};
  launch.num_tensors = static_cast<int64_t>(n);
  launch.master = master_precision_of(master_params, params);
  launch.phase = parse_phase(phase);
  launch.hyper = hyper;
  if (n == 0) return launch;
  const Device device = params[0].device();
  launch.param_dtype = storage_dtype(params[0], "params");
  launch.grad_dtype = storage_dtype(grads[0], "grads");
  check_scalar(grad_scale, device, "grad_scale");
  check_scalar(found_inf, device, "found_inf");
  ptrs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t idx = static_cast<int64_t>(i);
    check_param_grad_step(params, grads, steps, idx, device);
    const Tensor& p = params[i];
    const Tensor& g = grads[i];
    check_state(exp_avg_grads[i], p, "exp_avg_grads", idx);
    check_state(approx_hessians[i], p, "approx_hessians", idx);
    check_state(updates[i], p, "updates", idx);
    if (launch.master != MasterPrecision::None) {
      check_state(master_params[i], p, "master_params", idx, master_storage_type(launch.master));
    }
    STD_TORCH_CHECK(stats[i].numel() == kNumApolloStats && stats[i].scalar_type() == ScalarType::Double &&
                        stats[i].device() == device && stats[i].is_contiguous(),
                    "fusedoff: stats[", i, "] must be a contiguous float64 tensor of ", kNumApolloStats,
                  " elements on ", device_name(device));
    STD_TORCH_CHECK(total_numels[i] >= p.numel(), "fusedoff: total_numels[", i, "] = ", total_numels[i],
                    " is smaller than the range's ", p.numel(), " elements");
    ptrs[i] = ApolloTensorPtrs{p.mutable_data_ptr(),
                               g.mutable_data_ptr(),
                               exp_avg_grads[i].mutable_data_ptr<float>(),
                               approx_hessians[i].mutable_data_ptr<float>(),
                               updates[i].mutable_data_ptr<float>(),
                               launch.master != MasterPrecision::None ? master_params[i].mutable_data_ptr() : nullptr,
                               steps[i].mutable_data_ptr<float>(),
                               stats[i].mutable_data_ptr<double>(),
                               p.numel(),
                               total_numels[i]};
  }
  attach_tensors(launch, ptrs, grad_scale, found_inf);
  return launch;
}

#define FUSEDOFF_APOLLO_ARGS                                                                                 \
  const TensorList& params, const TensorList& grads, const TensorList& exp_avg_grads,                        \
      const TensorList& approx_hessians, const TensorList& updates, const TensorList& master_params,         \
      const TensorList& steps, const TensorList& stats, const IntList& total_numels, std::string_view phase, \
      FUSEDOFF_APOLLO_HYPERPARAMETERS(FUSEDOFF_PARAMETER, FUSEDOFF_COMMA),                                   \
      const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf
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
    const Tensor workspace = torch::stable::new_empty(params[0], {apollo_cuda_workspace_bytes(l)}, ScalarType::Byte);
    l.workspace = workspace.mutable_data_ptr();
    apollo_step_cuda(l);
  });
}
#endif

#if defined(FUSEDOFF_WITH_HOST_KERNELS)
// ---- the 8-bit codec on whole tensors (checkpoints) ------------------------------------------------
void check_flat(const Tensor& t, ScalarType dtype, const char* what) {
  STD_TORCH_CHECK(t.scalar_type() == dtype, "fusedoff: ", what, " must be ", state_dtype_name(dtype), ", got ",
                  t.scalar_type());
  STD_TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "fusedoff: ", what, " must be flat and contiguous, got shape ",
                  shape_text(t.sizes()), " and strides ", shape_text(t.strides()));
}

int64_t quant_blocks(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

std::tuple<Tensor, Tensor> encode_8bit_cpu_op(const Tensor& values, bool is_signed) {
  check_flat(values, ScalarType::Float, "values");
  Tensor codes = torch::stable::new_empty(values, {values.numel()}, ScalarType::Byte);
  Tensor absmax = torch::stable::new_empty(values, {quant_blocks(values.numel())});
  encode_8bit_cpu(values.const_data_ptr<float>(), values.numel(), is_signed, codes.mutable_data_ptr<uint8_t>(),
                  absmax.mutable_data_ptr<float>(), host_threads());
  return {codes, absmax};
}

Tensor decode_8bit_cpu_op(const Tensor& codes, const Tensor& absmax, bool is_signed) {
  check_flat(codes, ScalarType::Byte, "codes");
  check_flat(absmax, ScalarType::Float, "absmax");
  STD_TORCH_CHECK(absmax.numel() == quant_blocks(codes.numel()), "fusedoff: ", codes.numel(), " codes need ",
                  quant_blocks(codes.numel()), " block scales, got ", absmax.numel());
  Tensor values = torch::stable::new_empty(absmax, {codes.numel()});
  decode_8bit_cpu(codes.const_data_ptr<uint8_t>(), absmax.const_data_ptr<float>(), codes.numel(), is_signed,
                  values.mutable_data_ptr<float>(), host_threads());
  return values;
}

// Host only: a checkpoint's states are in host memory, or decoded where they are by the PyTorch codec.
void define_codec_ops(Library& m) {
  m.def("encode_8bit(Tensor values, bool is_signed) -> (Tensor codes, Tensor absmax)");
  m.def("decode_8bit(Tensor codes, Tensor absmax, bool is_signed) -> Tensor");
}
#endif

// The schemas, the same for fusedoff._C and the emulated build.
void define_fused_ops(Library& m) {
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
void register_device_kernels(Library& m) {
  m.impl("adam_step_", TORCH_BOX(&adam_step_cuda_op));
  m.impl("adam_compressed_step_", TORCH_BOX(&adam_compressed_step_cuda_op));
  m.impl("apollo_step_", TORCH_BOX(&apollo_step_cuda_op));
}
#endif

#if defined(FUSEDOFF_WITH_HOST_KERNELS)
std::string cpu_isa_op() { return cpu_isa_name(); }

// ---- the host kernels' self-tests (cpu/selftests.h), tests only -----------------------------------
// Ops of their own namespace, torch.ops.fusedoff_testing, never of torch.ops.fusedoff. The optional
// ones return [] where there is nothing to compare (no AVX-512 form on this CPU).

std::tuple<int64_t, int64_t, int64_t, int64_t> split_master_selftest_op(int64_t salt, int64_t num_threads) {
  const selftests::SplitMaster r = selftests::split_master(static_cast<uint32_t>(salt), static_cast<int>(num_threads));
  return {r.split_failures, r.split8_failures, r.split8_outside_bound, r.roundings_off};
}

int64_t written_param_selftest_op(int64_t num_threads) {
  return selftests::written_param(static_cast<int>(num_threads));
}

IntList split_master_lanes_selftest_op(int64_t salt, int64_t num_threads) {
  const selftests::SplitMasterLanes r =
      selftests::split_master_lanes(static_cast<uint32_t>(salt), static_cast<int>(num_threads));
  return r.checked ? IntList{r.split_off, r.split8_off} : IntList{};
}

IntList state_codec_selftest_op(int64_t num_threads) {
  const selftests::StateCodec r = selftests::state_codec(static_cast<int>(num_threads));
  return r.checked ? IntList{r.encode_signed_off, r.encode_unsigned_off, r.decode_signed_off, r.decode_unsigned_off}
                   : IntList{};
}
#endif

#if defined(FUSEDOFF_CUDA_EMULATION)
// ---- the emulator's controls and self-test kernels (emulation_control.h), tests only ---------------
void set_schedule_seed_op(int64_t seed) { emulation::set_schedule_seed(static_cast<std::uint64_t>(seed)); }

int64_t launches_op() { return static_cast<int64_t>(emulation::launch_count()); }

std::vector<std::string> selftest_names_op() { return emulation_selftest::selftest_names(); }

std::tuple<IntList, std::string> selftest_op(std::string_view name) {
  auto [outputs, error] = emulation_selftest::selftest(std::string(name));
  return {IntList(outputs.begin(), outputs.end()), error};
}
#endif

}  // namespace
}  // namespace fusedoff

#if defined(FUSEDOFF_CUDA_EMULATION)
// The device kernels on CPU tensors, under a namespace of their own beside torch.ops.fusedoff.
STABLE_TORCH_LIBRARY(fusedoff_emulated, m) {
  fusedoff::define_fused_ops(m);
  // Blocks of a grid, and threads between barriers, run in an order drawn from `seed` (0: index order).
  m.def("set_schedule_seed(int seed) -> ()");
  // Kernel launches run so far in this process, failed ones included.
  m.def("launches() -> int");
  m.def("selftest_names() -> str[]");
  // Runs one of the emulator's self-test kernels: its outputs and its launch's error message ('' if none).
  m.def("selftest(str name) -> (int[] outputs, str error)");
}
STABLE_TORCH_LIBRARY_IMPL(fusedoff_emulated, CPU, m) { fusedoff::register_device_kernels(m); }
STABLE_TORCH_LIBRARY_IMPL(fusedoff_emulated, CompositeExplicitAutograd, m) {
  m.impl("set_schedule_seed", TORCH_BOX(&fusedoff::set_schedule_seed_op));
  m.impl("launches", TORCH_BOX(&fusedoff::launches_op));
  m.impl("selftest_names", TORCH_BOX(&fusedoff::selftest_names_op));
  m.impl("selftest", TORCH_BOX(&fusedoff::selftest_op));
}
#define FUSEDOFF_MODULE_DOC                                                                               \
  "fusedoff's CUDA kernels run on the host by the CUDA emulation (tests only); its ops, the emulator's " \
  "controls among them, are torch.ops.fusedoff_emulated"
#else
STABLE_TORCH_LIBRARY(fusedoff, m) {
  fusedoff::define_fused_ops(m);
  fusedoff::define_codec_ops(m);
  // The instruction set the host kernels dispatch to on this CPU ("avx512", "avx2", "baseline").
  m.def("cpu_isa() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(fusedoff, CPU, m) {
  m.impl("adam_step_", TORCH_BOX(&fusedoff::adam_step_cpu_op));
  m.impl("adam_compressed_step_", TORCH_BOX(&fusedoff::adam_compressed_step_cpu_op));
  m.impl("apollo_step_", TORCH_BOX(&fusedoff::apollo_step_cpu_op));
  m.impl("encode_8bit", TORCH_BOX(&fusedoff::encode_8bit_cpu_op));
  m.impl("decode_8bit", TORCH_BOX(&fusedoff::decode_8bit_cpu_op));
}

#if defined(FUSEDOFF_WITH_CUDA)
STABLE_TORCH_LIBRARY_IMPL(fusedoff, CUDA, m) { fusedoff::register_device_kernels(m); }
#endif

// No tensor argument: one kernel for every device.
STABLE_TORCH_LIBRARY_IMPL(fusedoff, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", TORCH_BOX(&fusedoff::cpu_isa_op));
}

// The host kernels' self-tests: over all 2^32 fp32 values, the counts of failures of [note: split
// master weights]'s claims (split round trip, split8 round trip, split8 bound, parameter rounding);
// of master_or_param keeping a master it should take from the parameter or the reverse ([note: every
// write is seen]); of the 16-lane (split, split8) masters that differ from master.h's scalar ones;
// and of the AVX-512 8-bit codec's (encode signed, encode unsigned, decode signed, decode unsigned)
// results that differ from state_codec.h's.
STABLE_TORCH_LIBRARY(fusedoff_testing, m) {
  m.def("split_master_selftest(int salt, int num_threads) -> (int, int, int, int)");
  m.def("written_param_selftest(int num_threads) -> int");
  m.def("split_master_lanes_selftest(int salt, int num_threads) -> int[]");
  m.def("state_codec_selftest(int num_threads) -> int[]");
}

STABLE_TORCH_LIBRARY_IMPL(fusedoff_testing, CompositeExplicitAutograd, m) {
  m.impl("split_master_selftest", TORCH_BOX(&fusedoff::split_master_selftest_op));
  m.impl("written_param_selftest", TORCH_BOX(&fusedoff::written_param_selftest_op));
  m.impl("split_master_lanes_selftest", TORCH_BOX(&fusedoff::split_master_lanes_selftest_op));
  m.impl("state_codec_selftest", TORCH_BOX(&fusedoff::state_codec_selftest_op));
}
#define FUSEDOFF_MODULE_DOC "fusedoff native kernels; the ops themselves are registered under torch.ops.fusedoff"
#endif

// ---- the Python module: a shell that loads the library ---------------------------------------------
// Importing it runs the registrations above. Its attributes say how it was built: the torch whose
// headers it was compiled with, the oldest torch it loads in, and whether it holds CUDA kernels.
#define FUSEDOFF_CONCATENATE_(a, b) a##b
#define FUSEDOFF_CONCATENATE(a, b) FUSEDOFF_CONCATENATE_(a, b)
#define FUSEDOFF_STRINGIZE_(a) #a
#define FUSEDOFF_STRINGIZE(a) FUSEDOFF_STRINGIZE_(a)

PyMODINIT_FUNC FUSEDOFF_CONCATENATE(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, FUSEDOFF_STRINGIZE(TORCH_EXTENSION_NAME),
                                   FUSEDOFF_MODULE_DOC, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#if defined(FUSEDOFF_WITH_CUDA) && !defined(FUSEDOFF_CUDA_EMULATION)
  PyObject* with_cuda = Py_True;
#else
  PyObject* with_cuda = Py_False;
#endif
  if (PyModule_AddStringConstant(module, "torch_version", TORCH_VERSION) < 0 ||
      PyModule_AddObjectRef(module, "with_cuda", with_cuda) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  PyObject* oldest_torch = PyUnicode_FromFormat("%d.%d", static_cast<int>(TORCH_FEATURE_VERSION >> 56),
                                                static_cast<int>((TORCH_FEATURE_VERSION >> 48) & 0xff));
  if (oldest_torch == nullptr || PyModule_AddObject(module, "oldest_torch", oldest_torch) < 0) {
    Py_XDECREF(oldest_torch);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
