"""fusedoff.Adam/AdamW as drop-in torch.optim classes."""

from __future__ import annotations

import copy

import pytest
import torch

import fusedoff
from fusedoff import memory
from tests.helpers import backend_params, drawn_batches, max_abs_error, train_model, ulp_atol

BACKENDS = backend_params(("cpu", "cuda", "triton", "torch"))
PAIRS = [(fusedoff.AdamW, torch.optim.AdamW), (fusedoff.Adam, torch.optim.Adam)]


def make_model(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))
    return model.to(device=device, dtype=dtype)


def batches(model, device, seed=1):
    """This file's batches for train_model: 16 samples of 7 features and a target, in the model's dtype."""
    return drawn_batches((16, 7), (16, 1), seed=seed, device=device, dtype=next(model.parameters()).dtype)


def tensors_of(model, opt) -> dict[str, list[torch.Tensor]]:
    """Parameters and AdamW states, on the host. States through state_dict: on CUDA the default
    offload streams, and opt.state holds only `step` there."""
    states = opt.state_dict()["state"]
    out = {"param": [p.detach().cpu() for p in model.parameters()]}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = [states[pid][key].cpu() for pid in sorted(states)]
    return out


def assert_within_oracle_bound(got: dict, base: dict, oracle: dict) -> None:
    """Per quantity: err(got) <= 2 * err(base) + one fp32 ulp of the oracle's largest value, errors
    against the float64 `oracle`, `base` torch's own fp32 run (the style guide's bound)."""
    for key, want in oracle.items():
        err, base_err = max_abs_error(got[key], want), max_abs_error(base[key], want)
        bound = 2 * base_err + ulp_atol(torch.float32, want)
        assert err <= bound, f"{key}: {err:.3e} vs torch {base_err:.3e} (bound {bound:.3e})"


def torch_runs(torch_cls, kwargs, run, init=None) -> dict[torch.dtype, dict]:
    """torch_cls in float64 (the oracle) and float32 (the baseline), from make_model's weights (or
    init(model, opt)), trained by run(model, opt): their parameters and states."""
    out = {}
    for dtype in (torch.float64, torch.float32):
        model = make_model("cpu", dtype)
        opt = torch_cls(model.parameters(), foreach=False, **kwargs)
        if init is not None:
            init(model, opt)
        run(model, opt)
        out[dtype] = tensors_of(model, opt)
    return out


def assert_close_to_float64(fused_model, fused_opt, torch_cls, kwargs, steps, device):
    """fusedoff (fp32) vs torch.optim in float64, bounded by torch.optim's own fp32 error."""
    runs = torch_runs(torch_cls, kwargs,
                      lambda model, opt: train_model(model, opt, steps, batches(model, "cpu"), loss_in_fp32=True))
    assert_within_oracle_bound(tensors_of(fused_model, fused_opt), runs[torch.float32], runs[torch.float64])


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("fused_cls,torch_cls", PAIRS, ids=["AdamW", "Adam"])
def test_matches_torch_optim(backend, device, fused_cls, torch_cls):
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=True)
    steps = 4 if backend == "triton" and device == "cpu" else 20
    model = make_model(device)
    opt = fused_cls(model.parameters(), backend=backend, **kwargs)
    train_model(model, opt, steps, batches(model, device), loss_in_fp32=True)
    assert_close_to_float64(model, opt, torch_cls, kwargs, steps, device)
    assert opt.state[next(model.parameters())]["step"].item() == steps


@pytest.mark.parametrize("direction", ["fusedoff->torch", "torch->fusedoff"])
def test_state_dict_interchange_with_torch_optim(direction):
    """A checkpoint of one continues in the other: the run that saved it and the run that loaded it
    both stay within the oracle bound of torch.optim.AdamW resumed from it in float64 (parameters
    and states; measured: at most 40% of the bound)."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    first_model = make_model("cpu")
    first = (fusedoff.AdamW if direction == "fusedoff->torch" else torch.optim.AdamW)(first_model.parameters(), **kwargs)
    train_model(first_model, first, 5, batches(first_model, "cpu", seed=1), loss_in_fp32=True)
    saved_model, saved_state = copy.deepcopy(first_model.state_dict()), copy.deepcopy(first.state_dict())
    state = saved_state["state"][0]
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}

    resumed_model = make_model("cpu")
    resumed_model.load_state_dict(saved_model)
    resumed = (torch.optim.AdamW if direction == "fusedoff->torch" else fusedoff.AdamW)(resumed_model.parameters(), **kwargs)
    resumed.load_state_dict(copy.deepcopy(saved_state))  # a loaded tensor may become the state (as in torch)
    train_model(resumed_model, resumed, 5, batches(resumed_model, "cpu", seed=2), loss_in_fp32=True)
    train_model(first_model, first, 5, batches(first_model, "cpu", seed=2), loss_in_fp32=True)

    def resume(model, opt):  # torch casts the weights and states to float64 for the oracle
        model.load_state_dict(saved_model)
        opt.load_state_dict(copy.deepcopy(saved_state))

    runs = torch_runs(torch.optim.AdamW, kwargs,
                      lambda model, opt: train_model(model, opt, 5, batches(model, "cpu", seed=2), loss_in_fp32=True),
                      resume)
    for model, opt in ((first_model, first), (resumed_model, resumed)):
        assert_within_oracle_bound(tensors_of(model, opt), runs[torch.float32], runs[torch.float64])


def test_bf16_states_stay_fp32_through_state_dict():
    model = make_model("cpu", torch.bfloat16)
    opt = fusedoff.AdamW(model.parameters(), lr=1e-2)
    train_model(model, opt, 3, batches(model, "cpu"), loss_in_fp32=True)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["master_param"].dtype == torch.float32
    clone = fusedoff.AdamW(model.parameters(), lr=1e-2)
    clone.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        got = clone.state[next(model.parameters())][key]
        assert got.dtype == torch.float32
        assert torch.equal(got, saved["state"][0][key])


def test_master_weights_are_fp32_and_params_their_rounding():
    """bf16 params: the fp32 masters carry the update (too small for bf16 alone), params are their RNE rounding."""
    model = make_model("cpu", torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    opt = fusedoff.AdamW(model.parameters(), lr=1e-5)  # updates far below one bf16 ulp
    train_model(model, opt, 3, batches(model, "cpu"), loss_in_fp32=True)
    moved = 0
    for p, p0 in zip(model.parameters(), start):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
        moved += (master != p0.float()).sum().item()
    assert moved > 0, "the masters did not accumulate the small updates"


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "torch")))
def test_grad_scaler_end_to_end(backend, device):
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    model = make_model(device)
    opt = fusedoff.AdamW(model.parameters(), backend=backend, **kwargs)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    train_model(model, opt, 10, batches(model, device), loss_in_fp32=True, scaler=scaler)
    assert_close_to_float64(model, opt, torch.optim.AdamW, kwargs, 10, device)

    # An overflow: the scaler skips the step; params, states and step counts stay as they were.
    before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    (model(torch.full((2, 7), float("inf"), device=device)).sum() * 0).backward()
    scaler.step(opt)
    scaler.update()
    for p, b in zip(model.parameters(), before[1]):
        assert torch.equal(p, b)
    for pid, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, before[0]["state"][pid][key]), key


@pytest.mark.parametrize("placement", [dict(offload="none"), dict(offload="stream", chunk_size=32)],
                         ids=["resident", "streamed"])
def test_bad_input_is_rejected_before_anything_changes(placement):
    """A bad gradient on the last parameter: the step raises before any parameter, state, master
    weight or step count changes (bf16 parameters, so master weights are among the states)."""
    model = make_model("cpu", torch.bfloat16)
    opt = fusedoff.AdamW(model.parameters(), lr=1e-2, amsgrad=True, **placement)
    train_model(model, opt, 1, batches(model, "cpu"), loss_in_fp32=True)
    params = list(model.parameters())
    snapshot = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    bad_grads = [
        ("shape", lambda g: setattr(g, "data", torch.ones(3, dtype=g.dtype))),  # .data skips torch's check
        ("sparse", lambda g: setattr(params[-1], "grad", torch.ones_like(params[-1]).to_sparse())),
    ]
    for match, spoil in bad_grads:
        spoil(params[-1].grad)
        with pytest.raises(RuntimeError, match=match):
            opt.step()
    for p, b in zip(params, snapshot[1]):
        assert torch.equal(p, b)
    after = opt.state_dict()["state"]
    assert after.keys() == snapshot[0]["state"].keys() == set(range(len(params)))
    for pid, state in snapshot[0]["state"].items():
        assert set(after[pid]) == set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"}
        for key, value in state.items():
            assert torch.equal(after[pid][key], value), (pid, key)


@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_a_parameter_with_gaps_is_rejected_before_anything_changes(backend):
    # The kernels walk a tensor's memory in order: a strided slice (gaps between its elements) is
    # refused before its step count (or any other state) moves.
    good = torch.nn.Parameter(torch.randn(5))
    gappy = torch.nn.Parameter(torch.randn(4, 6)[:, ::2])
    opt = fusedoff.AdamW([good, gappy], lr=1e-2, backend=backend, offload="none")
    good.grad = torch.randn(5)
    opt.step()  # only `good` has a gradient: fine
    snapshot = copy.deepcopy(opt.state_dict()), good.detach().clone(), gappy.detach().clone()
    good.grad, gappy.grad = torch.randn(5), torch.randn(4, 3)
    with pytest.raises(ValueError, match="dense"):
        opt.step()
    assert torch.equal(good, snapshot[1]) and torch.equal(gappy, snapshot[2])
    after = opt.state_dict()["state"]
    assert after.keys() == snapshot[0]["state"].keys()
    for key, value in snapshot[0]["state"][0].items():
        assert torch.equal(after[0][key], value), key


def _dense_layouts():
    """A transposed matrix, a channels_last conv weight, and a contiguous neighbour."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(4, 3, generator=gen).t(),
            torch.randn(8, 3, 3, 3, generator=gen).to(memory_format=torch.channels_last),
            torch.randn(7, generator=gen)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("placement", [dict(offload="none"), dict(offload="stream", chunk_size=32),
                                       dict(offload="stream", chunk_size=32, device_budget=4 * 3 * 12)],
                         ids=["resident", "streamed", "mixed"])
def test_dense_parameters_of_any_layout_step_as_their_contiguous_copies(backend, placement, dtype):
    """Non-contiguous but dense parameters (torch updates them) step exactly as the same values laid
    out contiguously (elementwise math: bit for bit), with states of the parameter's own strides,
    resident or streamed; gradients may come in another layout."""
    ours = [torch.nn.Parameter(t.to(dtype).clone(memory_format=torch.preserve_format)) for t in _dense_layouts()]
    plain = [torch.nn.Parameter(t.to(dtype).contiguous()) for t in _dense_layouts()]
    opt = fusedoff.AdamW(ours, lr=1e-2, weight_decay=0.1, backend=backend, **placement)
    plain_opt = fusedoff.AdamW(plain, lr=1e-2, weight_decay=0.1, backend=backend, offload="none")
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        for a, b in zip(ours, plain):
            g = torch.randn(a.shape, generator=gen).to(dtype)
            a.grad = g.clone() if step % 2 else torch.empty_like(a).copy_(g)  # its strides, or contiguous
            b.grad = g.clone()
        opt.step()
        plain_opt.step()
    for a, b in zip(ours, plain):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq") + (("master_param",) if dtype == torch.bfloat16 else ()):
            state = opt.state[a][key]
            assert state.shape == a.shape and state.stride() == a.stride()
            assert torch.equal(state, plain_opt.state[b][key])
    assert [t.stride() for t in ours] == [t.stride() for t in _dense_layouts()]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "learning rate"),
        (dict(eps=-1.0), "epsilon"),
        (dict(betas=(1.0, 0.9)), "beta"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(backend="fortran"), "backend"),
        (dict(master_weights="yes"), "master_weights"),
    ],
)
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fusedoff.AdamW(make_model("cpu").parameters(), **kwargs)


def test_rejects_integer_and_complex_params():
    for dtype in (torch.int32, torch.complex64):
        with pytest.raises(ValueError, match="supports float32"):
            fusedoff.AdamW([torch.zeros(3, dtype=dtype)])


def test_scheduler_changes_lr_every_step():
    """An lr halved after every step by StepLR: within the oracle bound of torch.optim.AdamW under
    the same scheduler (parameters and states; measured: at most 51% of the bound)."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)

    def run(model, opt):
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(6):
            train_model(model, opt, 1, batches(model, "cpu", seed=step), loss_in_fp32=True)
            scheduler.step()
        assert opt.param_groups[0]["lr"] == 1e-2 / 64

    fused_model = make_model("cpu")
    fused = fusedoff.AdamW(fused_model.parameters(), **kwargs)
    run(fused_model, fused)
    runs = torch_runs(torch.optim.AdamW, kwargs, run)
    assert_within_oracle_bound(tensors_of(fused_model, fused), runs[torch.float32], runs[torch.float64])


def test_params_without_grad_are_skipped():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = fusedoff.AdamW([a, b], lr=0.1)
    a.grad = torch.ones(4)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(4)) and b not in opt.state
    assert a.detach().lt(1).all()


def train_clipped(model, opt, clip, use_scaler, device) -> list[torch.Tensor]:
    """Six steps, each clipped by clip(model, opt) after the gradients are unscaled; the norms."""
    scaler = torch.amp.GradScaler(device, init_scale=2.0**6) if use_scaler else None
    return train_model(model, opt, 6, batches(model, device, seed=3), scaler=scaler,
                       clip=lambda model, opt: clip(model, opt).detach().cpu())


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "torch")))
@pytest.mark.parametrize("use_scaler", [False, True], ids=["", "grad-scaler"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clip_grad_norm_matches_torch(backend, device, use_scaler, norm_type):
    """opt.clip_grad_norm_ folds the clip factor into the step: the trajectory of clipping the
    gradients with torch.nn.utils.clip_grad_norm_ before torch.optim.AdamW's step, within the
    oracle bound of torch in float64 (norms, parameters and states; measured: at most 58% of the
    bound). tests/test_clipping.py covers steps without clipping between clipped ones."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    norms = {}

    def run(model, opt):
        norms[next(model.parameters()).dtype] = train_clipped(
            model, opt, lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type), use_scaler, "cpu")

    runs = torch_runs(torch.optim.AdamW, kwargs, run)
    model = make_model(device)
    opt = fusedoff.AdamW(model.parameters(), backend=backend, **kwargs)
    got_norms = train_clipped(model, opt, lambda m, o: o.clip_grad_norm_(0.05, norm_type), use_scaler, device)
    got = {**tensors_of(model, opt), "norm": got_norms}
    for dtype in runs:
        runs[dtype]["norm"] = norms[dtype]
    assert_within_oracle_bound(got, runs[torch.float32], runs[torch.float64])
    assert min(n.item() for n in got_norms) > 0.05  # clipping is active on every step


def test_clip_grad_norm_of_bf16_grads_holds_at_most_one_fp32_gradient_copy():
    """The norm of bf16 gradients, accumulated in fp32, is within the oracle bound of torch's norm
    of fp32 copies of them (float64 oracle; measured: torch's own error, 1.4e-4 relative for l2, 0
    for inf), and the host memory it takes stays below an fp32 copy of the largest gradient plus
    half the next. On the CPU torch's norm with dtype=float32 upcasts each tensor it reads, so
    fusedoff reads the gradients one at a time and never holds all of them upcast (measured: a
    peak of 36 MiB, one gradient's fp32 copy, under a bound of 54 MiB; all of them upcast at once
    measured 72). The peak is the process's resident memory (VmHWM, reset before the call). Both
    large copies are above glibc's largest mmap threshold (32 MiB), so each is fresh memory that
    the peak counts: a smaller one could reuse heap pages earlier tests left resident."""
    if not memory.reset_host_peak():
        pytest.skip("this kernel does not let the peak resident memory be reset")
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (9 * 2**20, 9 * 2**20, 1000)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    opt = fusedoff.AdamW(params, lr=1e-2)
    copies = sorted((p.numel() * 4 for p in params), reverse=True)
    for norm_type in (2.0, float("inf")):
        want = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in params]), norm_type)
        # torch's norm of the same gradients upcast to fp32: fp32 sums over 15M elements err ~1e-4.
        base_err = (torch.nn.utils.get_total_norm([p.grad.float() for p in params], norm_type).double() - want).abs()
        opt.clip_grad_norm_(1.0, norm_type)  # once first: allocations made once (thread pools) do not count
        memory.reset_host_peak()
        entry = memory.host_rss_bytes()
        got = opt.clip_grad_norm_(1.0, norm_type)
        peak = memory.host_peak_rss_bytes() - entry
        assert got.dtype == torch.float32
        err = (got.double() - want).abs()
        assert err <= 2 * base_err + torch.finfo(torch.float32).eps * want, f"{err:.3e} vs torch's {base_err:.3e}"
        assert peak < copies[0] + copies[1] // 2, f"{peak / 2**20:.1f} MiB held by a norm of {norm_type}"


def test_one_group_on_two_devices_is_rejected():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match="one device"):
        fusedoff.AdamW(params)


def test_torch_checkpoint_into_bf16_optimizer_creates_master_weights():
    model = make_model("cpu")
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_model(model, ref, 2, batches(model, "cpu"), loss_in_fp32=True)
    model16 = make_model("cpu").to(torch.bfloat16)
    opt = fusedoff.AdamW(model16.parameters(), lr=1e-2, offload="none")
    opt.load_state_dict(ref.state_dict())
    train_model(model16, opt, 1, batches(model16, "cpu"), loss_in_fp32=True)
    for p in model16.parameters():
        assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))


def test_failed_add_param_group_leaves_no_group():
    opt = fusedoff.AdamW(make_model("cpu").parameters())
    with pytest.raises(ValueError, match="supports float32"):
        opt.add_param_group({"params": [torch.zeros(3, dtype=torch.float64)]})
    assert len(opt.param_groups) == 1


def test_triton_on_cpu_parameters_needs_the_interpreter(monkeypatch):
    # Compiled Triton kernels cannot read host memory: refuse before the step count moves.
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = fusedoff.AdamW([p], backend="triton", offload="none")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        opt.step()
    assert opt.state[p] == {}
