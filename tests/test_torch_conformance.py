"""fusedoff.Adam/AdamW held against torch's own optimizer database and torch.optim conventions.

``optim_db`` (torch.testing._internal.common_optimizers, shipped in the torch wheel) lists, per
torch optimizer, the constructor configs torch tests itself with and the bad inputs with the
exception each must raise. Every config fusedoff supports runs beside torch.optim, with fusedoff's
states resident, streamed and split between the two; every bad input raises torch's exception.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.nn import Parameter

import fusedoff
from fusedoff.optim.validation import TORCH_FLAGS
from tests.helpers import make_params, max_abs_error, train, ulp_atol
from tests.optional_packages import require

require("expecttest")  # the whole module skips without it (the GPU machine's image has none)
_flags_were_frozen = torch.backends.flags_frozen()
from torch.testing._internal import common_optimizers  # noqa: E402  (imported with torch's test utilities)

if not _flags_were_frozen:
    # Importing torch's test utilities forbids, for the whole process, plain assignments such as
    # `torch.backends.cudnn.benchmark = False` (torch's own suite wants them bracketed), which
    # Lightning's and Hugging Face's trainers make: allow them again.
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

OPTIMIZERS = {"Adam": (fusedoff.Adam, torch.optim.Adam), "AdamW": (fusedoff.AdamW, torch.optim.AdamW)}
OPTIM_INFO = {info.name: info for info in common_optimizers.optim_db if info.name in OPTIMIZERS}
# Odd sizes, a 0-d tensor, and a tensor spanning many 32-element chunks when streamed.
SHAPES = ((), (1,), (7,), (33, 5), (263,))
STEPS = 10
RELOAD_AT = 5
# The mixed placement: the fp32 states of the first four tensors fit in the budget (three states at
# most, amsgrad's included), the last tensor's do not and stream.
MIXED_BUDGET = 3 * 4 * (1 + 1 + 7 + 33 * 5)
PLACEMENTS = {
    "resident": dict(offload="none"),
    "streamed": dict(offload="stream", chunk_size=32),
    "mixed": dict(offload="stream", chunk_size=32, device_budget=MIXED_BUDGET),
}
# What fusedoff refuses among the configs optim_db lists (only for CUDA devices): every config with
# capturable=True ("capturable", "capturable, amsgrad", "Tensor lr with capturable and amsgrad",
# "Tensor lr, Tensor betas, with capturable and amsgrad", "Tensor lr, Tensor betas, with
# capturable"). Without capturable, those configs run on the CPU here like the others.
REFUSED_FLAGS = {"capturable": "capturable=True", "differentiable": "differentiable"}


def db_configs(name: str, device: str) -> list:
    return OPTIM_INFO[name].optim_inputs_func(device=device, dtype=torch.float32)


def supported_configs() -> list:
    """(optimizer name, kwargs): the CPU configs, then the CUDA-only ones without capturable."""
    out = []
    for name in OPTIMIZERS:
        seen = set()
        for config in db_configs(name, "cpu") + db_configs(name, "cuda"):
            kwargs = {k: v for k, v in config.kwargs.items() if k != "capturable"}
            desc = config.desc if "capturable" not in config.kwargs else f"{config.desc}, capturable dropped"
            key = repr(sorted(kwargs.items()))
            if key not in seen:
                seen.add(key)
                out.append(pytest.param(name, kwargs, id=f"{name}-{desc}"))
    return out


def refused_configs() -> list:
    return [pytest.param(name, config.kwargs, id=f"{name}-{config.desc}")
            for name in OPTIMIZERS for config in db_configs(name, "cuda")
            if config.kwargs.get("capturable") or config.kwargs.get("differentiable")]


def params_of(dtype: torch.dtype) -> list[Parameter]:
    """The parameters of SHAPES, drawn in float64: the same values in every precision."""
    return make_params(SHAPES, dtype, drawn_as=torch.float64)


def param_groups(params: list[Parameter], kwargs: dict) -> list[dict]:
    """Two groups: the config's own hyperparameters, and the same at half the learning rate."""
    lr = kwargs.get("lr", 1e-3)
    return [{"params": params[:3]}, {"params": params[3:], "lr": lr * 0.5}]


def set_grads(params: list[Parameter], step: int) -> None:
    """The gradient of sum(c * p**2 / 2) + noise . p: it depends on the parameters, so differences
    between two runs feed back as they would in training, and is the same in every precision."""
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        p.grad = (i + 1) * 0.3 * p.detach() + noise


def run_torch(name: str, kwargs: dict, dtype: torch.dtype) -> tuple[list[Parameter], torch.optim.Optimizer]:
    params = params_of(dtype)
    opt = OPTIMIZERS[name][1](param_groups(params, kwargs), foreach=False, **copy.deepcopy(kwargs))
    train(params, opt, STEPS, set_grads)
    return params, opt


def run_fusedoff(name: str, kwargs: dict, placement: dict) -> tuple[list[Parameter], torch.optim.Optimizer]:
    """fp32, with a state_dict() save and a reload into a new optimizer halfway."""
    cls = OPTIMIZERS[name][0]
    params = params_of(torch.float32)
    opt = cls(param_groups(params, kwargs), **copy.deepcopy(kwargs), **placement)
    for step in range(STEPS):
        if step == RELOAD_AT:
            saved = copy.deepcopy(opt.state_dict())
            opt = cls(param_groups(params, kwargs), **copy.deepcopy(kwargs), **placement)
            opt.load_state_dict(saved)
        set_grads(params, step)
        opt.step()
    return params, opt


def states_of(opt: torch.optim.Optimizer, key: str) -> list[torch.Tensor]:
    states = opt.state_dict()["state"]
    return [states[pid][key] for pid in sorted(states)]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name,kwargs", supported_configs())
def test_every_supported_config_matches_torch(name, kwargs, placement):
    """Guards the update math of each config (lr, weight decay either way, maximize, amsgrad,
    tensor lr and betas) over two param groups, a reload, and every placement: fusedoff in fp32 may
    be off the float64 run of torch.optim by at most twice what torch.optim's own fp32 run is, plus
    one fp32 ulp (one rounding decision)."""
    oracle_params, oracle = run_torch(name, kwargs, torch.float64)
    base_params, base = run_torch(name, kwargs, torch.float32)
    params, opt = run_fusedoff(name, kwargs, PLACEMENTS[placement])
    if placement == "mixed":
        stats = opt.memory_stats()
        assert stats["resident_bytes"] > 0 and stats["streamed_bytes"] > 0, stats

    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kwargs.get("amsgrad") else [])
    pairs = [("param", params, base_params, oracle_params)]
    pairs += [(key, states_of(opt, key), states_of(base, key), states_of(oracle, key)) for key in keys]
    for key, got, baseline, want in pairs:
        err, base_err = max_abs_error(got, want), max_abs_error(baseline, want)
        assert err <= 2 * base_err + ulp_atol(torch.float32, want), f"{key}: {err:.3e} vs torch {base_err:.3e}"
    assert [s.item() for s in states_of(opt, "step")] == [STEPS] * len(SHAPES)
    # The groups hold torch's keys and values, less its implementation flags (see check_torch_flags).
    for group, torch_group in zip(opt.state_dict()["param_groups"], base.state_dict()["param_groups"]):
        for key, value in torch_group.items():
            assert key in TORCH_FLAGS or _same(group[key], value), key


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("name,kwargs", refused_configs())
def test_configs_fusedoff_cannot_run_are_refused_clearly(name, kwargs):
    match = next(text for flag, text in REFUSED_FLAGS.items() if kwargs.get(flag))
    with pytest.raises(RuntimeError, match=match):
        OPTIMIZERS[name][0](params_of(torch.float32), **kwargs)


def error_inputs(device_type: str) -> list:
    return [pytest.param(name, error, id=f"{name}-{device_type}-{error.optimizer_error_input.desc}")
            for name in OPTIMIZERS
            for error in _db_error_inputs(name, device_type)]


def _db_error_inputs(name: str, device_type: str) -> list:
    """optim_db's error inputs; those it lists for CUDA only (about `fused`) are built on the CPU
    by having optim_db take the CPU for a CUDA device."""
    if device_type == "cpu":
        return OPTIM_INFO[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)
    real = common_optimizers._get_device_type
    common_optimizers._get_device_type = lambda device: "cuda"
    try:
        return OPTIM_INFO[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)
    finally:
        common_optimizers._get_device_type = real


@pytest.mark.parametrize("name,error", error_inputs("cpu") + error_inputs("cuda"))
def test_every_error_input_raises_torchs_exception(name, error):
    optim_input = error.optimizer_error_input
    assert error.error_on == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR
    for cls in reversed(OPTIMIZERS[name]):  # torch first: the database and torch agree
        params = optim_input.params if optim_input.params is not None else params_of(torch.float32)
        if issubclass(error.error_type, Warning):
            with pytest.warns(error.error_type, match=error.error_regex):
                cls(params, **optim_input.kwargs)
        else:
            with pytest.raises(error.error_type, match=error.error_regex):
                cls(params, **optim_input.kwargs)


TORCH_GROUP_ERRORS = {  # a bad group for add_param_group: torch's exception and message
    "names-mix": (lambda ps: {"params": [("w", ps[3])]}, ValueError,
                  "all optimizer param groups should be with/without names"),
    "duplicate": (lambda ps: {"params": [ps[0]]}, ValueError, "some parameters appear in more than one parameter group"),
    "set": (lambda ps: {"params": {ps[3]}}, TypeError, "ordered collections"),
    "not-a-tensor": (lambda ps: {"params": [ps[3], "w"]}, TypeError, "optimizer can only optimize Tensors"),
    "not-a-dict": (lambda ps: [ps[3]], TypeError, "param_group must be a dict"),
    "non-leaf": (lambda ps: {"params": [ps[3] * 2]}, ValueError, "can't optimize a non-leaf Tensor"),
}
FUSEDOFF_GROUP_ERRORS = {  # groups torch accepts and fusedoff refuses
    "capturable": (lambda ps: {"params": [ps[3]], "capturable": True}, RuntimeError, "capturable=True"),
    "differentiable": (lambda ps: {"params": [ps[3]], "differentiable": True}, RuntimeError, "differentiable"),
    "fused-foreach": (lambda ps: {"params": [ps[3]], "fused": True, "foreach": True}, RuntimeError,
                      "cannot be `True` together"),
    "float64": (lambda ps: {"params": [Parameter(torch.zeros(2, dtype=torch.float64))]}, ValueError, "float32"),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("case", [*TORCH_GROUP_ERRORS, *FUSEDOFF_GROUP_ERRORS])
def test_a_refused_param_group_leaves_the_optimizer_as_it_was(name, case):
    """torch's exception for a bad add_param_group, raised before anything changes, as in torch."""
    make_group, error, match = {**TORCH_GROUP_ERRORS, **FUSEDOFF_GROUP_ERRORS}[case]
    for cls in OPTIMIZERS[name] if case in TORCH_GROUP_ERRORS else OPTIMIZERS[name][:1]:
        params = params_of(torch.float32)
        opt = cls(params[:3], lr=1e-2)
        set_grads(params, 0)
        opt.step()
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(error, match=match):
            opt.add_param_group(make_group(params))
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"]
        assert all(torch.equal(after["state"][pid][k], v) for pid, s in before["state"].items() for k, v in s.items())


# ---- named parameters ----------------------------------------------------------------------------

def named_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_named_parameters_keep_their_names_in_the_state_dict(name):
    groups = {}
    for cls in OPTIMIZERS[name]:
        model = named_model()
        named = list(model.named_parameters())
        opt = cls([{"params": named[:2]}, {"params": named[2:], "lr": 1e-2}])
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        groups[cls] = opt.state_dict()["param_groups"]
        assert [g["param_names"] for g in groups[cls]] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
        assert opt.param_groups[0]["params"][0] is model[0].weight

        # A state dict with names loads into an optimizer built from plain parameters, names and all.
        plain = cls([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}])
        plain.load_state_dict(opt.state_dict())
        assert plain.state_dict()["param_groups"] == groups[cls]


def test_named_parameters_with_one_group_match_torch():
    for cls in OPTIMIZERS["AdamW"]:
        opt = cls(named_model().named_parameters())
        assert opt.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


# ---- state dict round trip -----------------------------------------------------------------------

@pytest.mark.parametrize("cls", [fusedoff.AdamW, fusedoff.Adam, fusedoff.Apollo], ids=lambda c: c.__name__)
def test_save_load_save_gives_the_same_param_groups(cls):
    """No group gains a key by being loaded (torch's __setstate__ adds 'differentiable' to the
    defaults), nor does a group added after the load."""
    model = named_model()
    kwargs = dict(lr=1e-2)
    opt = cls(model.parameters(), **kwargs)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    first = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(copy.deepcopy(first))
    assert opt.state_dict()["param_groups"] == first["param_groups"]
    fresh = cls(named_model().parameters(), **kwargs)
    fresh.load_state_dict(copy.deepcopy(first))
    assert fresh.state_dict()["param_groups"] == first["param_groups"]
    fresh.add_param_group({"params": [Parameter(torch.zeros(2))]})
    assert fresh.param_groups[-1].keys() == fresh.param_groups[0].keys()
    assert "differentiable" not in fresh.defaults
    copied = pickle.loads(pickle.dumps(opt))
    assert copied.state_dict()["param_groups"] == first["param_groups"]


def test_adamw_groups_stay_decoupled_after_loading_an_adam_state_dict():
    params = params_of(torch.float32)
    adam = torch.optim.Adam(params, weight_decay=0.1)
    adamw = fusedoff.AdamW(params, weight_decay=0.1)
    adamw.load_state_dict(adam.state_dict())
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True


# ---- torch's keywords ----------------------------------------------------------------------------

def test_adam_with_decoupled_weight_decay_is_adamw():
    """fusedoff.Adam(decoupled_weight_decay=True) runs fusedoff.AdamW's step bit for bit, and
    torch.optim.Adam with the same flag within the oracle bound of the config test."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    decoupled = {**kwargs, "decoupled_weight_decay": True}
    runs = {label: run_fusedoff(name, config, PLACEMENTS["resident"])[0]
            for label, name, config in [("adam", "Adam", decoupled), ("adamw", "AdamW", kwargs), ("l2", "Adam", kwargs)]}
    assert all(torch.equal(a, b) for a, b in zip(runs["adam"], runs["adamw"]))
    assert not all(torch.equal(a, b) for a, b in zip(runs["adam"], runs["l2"]))
    oracle, _ = run_torch("Adam", decoupled, torch.float64)
    base, _ = run_torch("Adam", decoupled, torch.float32)
    err, base_err = max_abs_error(runs["adam"], oracle), max_abs_error(base, oracle)
    assert err <= 2 * base_err + ulp_atol(torch.float32, oracle), (err, base_err)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("flags", [dict(fused=True), dict(fused=False), dict(foreach=True), dict(foreach=False),
                                   dict(fused=None, foreach=None, capturable=False, differentiable=False)],
                         ids=["fused", "not-fused", "foreach", "not-foreach", "torch-defaults"])
def test_torchs_implementation_flags_choose_nothing(name, flags):
    results = []
    for extra in ({}, flags):
        params = params_of(torch.float32)
        opt = OPTIMIZERS[name][0](params, lr=1e-2, **extra)
        for step in range(3):
            set_grads(params, step)
            opt.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_fusedoff_adam_errors_name_adam():
    with pytest.raises(TypeError, match=r"^Adam\.__init__\(\) got an unexpected keyword argument 'nesterov'"):
        fusedoff.Adam(params_of(torch.float32), nesterov=True)
    with pytest.raises(TypeError, match=r"^AdamW\.__init__\(\) got an unexpected keyword argument"):
        fusedoff.AdamW(params_of(torch.float32), decoupled_weight_decay=False)  # as torch.optim.AdamW


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_dtypes_torch_supports_and_fusedoff_does_not_are_refused_clearly(dtype):
    with pytest.raises(ValueError, match="fusedoff supports float32, float16 and bfloat16 parameters"):
        fusedoff.AdamW([Parameter(torch.zeros(3, dtype=dtype))])


# ---- GradScaler and training loops ---------------------------------------------------------------

def test_grad_scaler_leaves_unscaling_to_the_kernel():
    """GradScaler hands the scale to the step: the gradients stay scaled, and the update is the
    one of the unscaled gradients, bit for bit (the scale is a power of 2)."""
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**8), None):
        params = params_of(torch.float32)
        opt = fusedoff.AdamW(params, lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        loss = sum(((p * p) * 0.15 * (i + 1) + p * torch.randn(p.shape, generator=gen)).sum()
                   for i, p in enumerate(params))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaled = [p.grad.clone() for p in params]
            scaler.step(opt)
            assert all(torch.equal(p.grad, g) for p, g in zip(params, scaled)), "GradScaler unscaled in place"
        else:
            loss.backward()
            opt.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_only_grad_scaler_is_told_that_the_step_unscales():
    """Training loops read `_step_supports_amp_scaling` as "cannot clip before the step"
    (Lightning refuses gradient_clip_val then): only GradScaler sees it true."""
    opt = fusedoff.AdamW(params_of(torch.float32))
    assert getattr(opt, "_step_supports_amp_scaling", False) is False

    class Scaler(torch.amp.GradScaler):
        def asks(self, optimizer):
            return getattr(optimizer, "_step_supports_amp_scaling", False)

    assert Scaler("cpu").asks(opt) is True


def test_importing_torchs_test_utilities_leaves_backend_flags_assignable():
    assert torch.backends.flags_frozen() == _flags_were_frozen
