"""Shared test helpers: devices, Adam problem setup, oracle error checks, parameter factories, training
loops and bit-equality assertions."""

from __future__ import annotations

import contextlib
import copy
import re
import socket
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from fusedoff import ops

LOW_PRECISION = (torch.float16, torch.bfloat16)
STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Sizes from the issue: a 0-d tensor, 1, 7 (odd, shorter than any vector), 4097 (vector width + 1).
SIZES = ((), (1,), (7,), (4097,))


# Python source for a subprocess that runs another torch (its own venv): three AdamW steps of fusedoff's
# cpu backend on 4097 elements against torch.optim.AdamW there (needs `torch` and `fusedoff` imported).
ADAMW_STEPS_AGAINST_TORCH = textwrap.dedent(
    """
    torch.manual_seed(0)
    theirs = torch.nn.Parameter(torch.randn(4097))
    ours = torch.nn.Parameter(theirs.detach().clone())
    reference = torch.optim.AdamW([theirs], lr=1e-2)
    opt = fusedoff.AdamW([ours], lr=1e-2, backend="cpu")
    for _ in range(3):
        grad = torch.randn(4097)
        theirs.grad, ours.grad = grad, grad.clone()
        reference.step()
        opt.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    """
)


def cpu_block_elements() -> int:
    """``kBlockElements`` of csrc/cpu/blocks.h: the host kernels cut every tensor into blocks of this
    many elements (read from the header so that sizes built on it keep crossing its boundaries)."""
    header = (Path(__file__).resolve().parents[1] / "csrc" / "cpu" / "blocks.h").read_text()
    return int(re.search(r"kBlockElements = (\d+);", header).group(1))


def sizes_across_cpu_blocks() -> tuple[tuple[int], ...]:
    """One short of a host block, exactly one, one over, and several blocks plus a tail: a kernel
    whose blocks stop short or overlap leaves an element on a boundary wrong in one of them. (They
    also cross the CUDA kernels' 16384-element blocks.)"""
    block = cpu_block_elements()
    return ((block - 1,), (block,), (block + 1,), (3 * block + 5,))


def native_selftests():
    """The host kernels' self-tests (csrc/cpu/selftests.h): ops of torch.ops.fusedoff_testing, which
    the native extension registers beside torch.ops.fusedoff (loading it first)."""
    from fusedoff import _ext

    _ext.load_extension()
    return torch.ops.fusedoff_testing


def backend_params(backends=("cpu", "cuda", "torch")):
    """pytest params for (backend, device): cuda ones carry the `cuda` marker (skipped without a GPU).
    Wherever the CUDA kernels run, their host emulation runs too (`cuda_emulated` on CPU tensors,
    marked `emulated`), so every check of them runs in CI."""
    out = []
    for backend in backends:
        if backend == "cpu":
            out.append(pytest.param("cpu", "cpu", id="cpu"))
        elif backend == "cuda":
            out.append(pytest.param("cuda", "cuda", id="cuda", marks=pytest.mark.cuda))
            out.append(pytest.param("cuda_emulated", "cpu", id="cuda_emulated", marks=pytest.mark.emulated))
        elif backend == "torch":
            out.append(pytest.param("torch", "cpu", id="torch-cpu"))
            out.append(pytest.param("torch", "cuda", id="torch-cuda", marks=pytest.mark.cuda))
        elif backend == "triton":
            out.append(pytest.param("triton", "cpu", id="triton-cpu", marks=pytest.mark.triton))
            out.append(
                pytest.param("triton", "cuda", id="triton-cuda", marks=[pytest.mark.triton, pytest.mark.cuda])
            )
    return out


@dataclass
class AdamProblem:
    """The tensors of one fused Adam call: lists in the op's argument order."""

    params: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]
    master_params: list[torch.Tensor]
    steps: list[torch.Tensor]
    grads_per_step: list[list[torch.Tensor]] = field(default_factory=list)

    def states(self) -> dict[str, list[torch.Tensor]]:
        return {
            "param": self.params,
            "exp_avg": self.exp_avgs,
            "exp_avg_sq": self.exp_avg_sqs,
            "max_exp_avg_sq": self.max_exp_avg_sqs,
            "master_param": self.master_params,
            "step": self.steps,
        }

    def to(self, dtype: torch.dtype | None = None, device: str | None = None) -> "AdamProblem":
        """A copy; with `dtype` every tensor (grads too) becomes that dtype (the float64 oracle)."""

        def conv(t):
            return t.to(dtype=dtype or t.dtype, device=device or t.device, copy=True)

        out = copy.copy(self)
        for name in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params"):
            setattr(out, name, [conv(t) for t in getattr(self, name)])
        out.steps = [t.to(device=device or t.device, copy=True) for t in self.steps]
        out.grads_per_step = [[conv(g) for g in gs] for gs in self.grads_per_step]
        return out


def make_adam_problem(
    *,
    param_dtype=torch.float32,
    grad_dtype=torch.float32,
    master=False,
    amsgrad=False,
    num_steps=20,
    sizes=SIZES,
    device="cpu",
    grad_scale=1.0,
    seed=0,
) -> AdamProblem:
    gen = torch.Generator().manual_seed(seed)
    params32 = [torch.randn(s, generator=gen) for s in sizes]
    params = [p.to(param_dtype).to(device) for p in params32]

    def zeros():
        return [torch.zeros(s, device=device) for s in sizes]

    grads = [
        [(torch.randn(s, generator=gen) * 0.1 * grad_scale).to(grad_dtype).to(device) for s in sizes]
        for _ in range(num_steps)
    ]
    return AdamProblem(
        params=params,
        exp_avgs=zeros(),
        exp_avg_sqs=zeros(),
        max_exp_avg_sqs=zeros() if amsgrad else [],
        # Master weights start from the exact fp32 values the low-precision params were rounded from.
        master_params=[p.to(device) for p in params32] if master else [],
        steps=[torch.zeros((), device=device) for _ in sizes],
        grads_per_step=grads,
    )


def run_adam(problem: AdamProblem, backend: str, hyper: dict, grad_scale=None, found_inf=None) -> AdamProblem:
    """Runs every step of `problem` in place through fusedoff.ops (increment, then the fused step)."""
    for grads in problem.grads_per_step:
        ops.increment_steps_(problem.steps, found_inf)
        ops.adam_step_(
            problem.params,
            grads,
            problem.exp_avgs,
            problem.exp_avg_sqs,
            problem.max_exp_avg_sqs,
            problem.master_params,
            problem.steps,
            grad_scale=grad_scale,
            found_inf=found_inf,
            backend=backend,
            **hyper,
        )
    return problem


def max_abs_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g.double() - w.double().to(g.device)).abs().max().item() if g.numel() else 0.0)
               for g, w in zip(got, want, strict=True))


def ulp_atol(dtype: torch.dtype, tensors: list[torch.Tensor]) -> float:
    """One unit in the last place of `dtype` at the largest magnitude in `tensors`: what a single
    round-to-nearest-even decision of a stored value may flip between two correct kernels."""
    scale = max((t.double().abs().max().item() for t in tensors if t.numel()), default=0.0)
    return torch.finfo(dtype).eps * scale


def assert_matches_oracle(got: AdamProblem, baseline: AdamProblem, oracle: AdamProblem, param_dtype) -> None:
    """err(got vs float64 oracle) <= 2 * err(baseline vs oracle) + atol, per state.

    `baseline` is the same op in the same precision by an independent implementation (torch.optim
    or the pure-PyTorch reference run in fp32). atol is one ulp of the stored dtype: one rounding
    decision of a stored value may legitimately differ between two correct kernels.
    """
    for name, got_tensors in got.states().items():
        if not got_tensors:
            continue
        want = oracle.states()[name]
        base_err = max_abs_error(baseline.states()[name], want)
        err = max_abs_error(got_tensors, want)
        dtype = param_dtype if name == "param" else torch.float32
        atol = ulp_atol(dtype, want)
        assert err <= 2 * base_err + atol, f"{name}: error {err:.3e} vs baseline {base_err:.3e} (atol {atol:.1e})"


def relative_l2_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all tensors together (float64)."""
    num = sum(((g.double() - w.double().to(g.device)) ** 2).sum().item() for g, w in zip(got, want, strict=True))
    den = sum((w.double() ** 2).sum().item() for w in want)
    return (num / max(den, 1e-300)) ** 0.5


# ---- bad-argument cases: mutations of a call described as a dict of its arguments ----------------

def swap_arg(name, index, make):
    """Replaces element `index` of list argument `name` with make(element)."""
    def mutate(call):
        call[name] = list(call[name])
        call[name][index] = make(call[name][index])
    return mutate


def set_arg(name, value):
    """Sets argument `name` to `value` (or value(call) when callable)."""
    def mutate(call):
        call[name] = value(call) if callable(value) else value
    return mutate


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A strided (every other element) tensor with `t`'s shape, dtype and device."""
    return torch.empty(t.numel() * 2, dtype=t.dtype, device=t.device)[::2].view(t.shape)



@contextlib.contextmanager
def device_of(placement: str):
    """The parameters' device of a placement named in the tests: "simulated" is the CPU seen as a
    device through the stream simulator (fusedoff/testing/simulator.py, seed 5); any other, as it is."""
    from fusedoff.offload import runtimes
    from fusedoff.testing.simulator import SimulatedRuntime

    if placement != "simulated":
        yield
        return
    with runtimes.simulate(lambda device: SimulatedRuntime(device, seed=5)):
        yield


# ---- parameters, training loops, bit for bit ------------------------------------------------------------

def make_params(shapes, dtype=torch.float32, *, seed: int = 0, device="cpu", drawn_as: torch.dtype = torch.float32,
                grads: bool = False) -> list[torch.nn.Parameter]:
    """Parameters of `shapes`: normal values drawn in `drawn_as` from one generator seeded `seed`, in order,
    then made `dtype` (one for all, or a list with one per shape) on `device`. `grads`: each also gets a
    normal gradient in its dtype, drawn from the same generator after all the values."""
    generator = torch.Generator().manual_seed(seed)
    dtypes = dtype if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=drawn_as).to(device, dt))
              for shape, dt in zip(shapes, dtypes, strict=True)]
    if grads:
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device, p.dtype)
    return params


def seeded_grads(scale: float | None = None, seed: int = 100):
    """A `set_grads` for `train`: at step s, normal values from a generator seeded `seed` + s, drawn for
    the parameters in order, times `scale`, in each parameter's dtype and on its device."""
    def set_grads(params, step: int) -> None:
        generator = torch.Generator().manual_seed(seed + step)
        for p in params:
            grad = torch.randn(p.shape, generator=generator)
            p.grad = (grad if scale is None else grad * scale).to(p.device, p.dtype)
    return set_grads


def drawn_grads(seed: int = 1, scale: float = 0.1, skip=None):
    """A `set_grads` for `train` drawing every step's gradients from one generator seeded `seed` (a run's
    gradients, not a step's): normal values times `scale`, in each parameter's dtype and on its device;
    none for tensor i at a step where `skip(step, i)`."""
    generator = torch.Generator().manual_seed(seed)

    def set_grads(params, step: int) -> None:
        for i, p in enumerate(params):
            grad = (torch.randn(p.shape, generator=generator) * scale).to(p.device, p.dtype)
            p.grad = None if skip and skip(step, i) else grad
    return set_grads


def train(params, opt, steps, set_grads=None, between=None) -> None:
    """Steps `opt` at each step of `steps` (a range of step numbers, or a count from 0), each after
    `set_grads(params, step)` (default: seeded_grads()); `between(opt, params, step)` runs after each."""
    set_grads = set_grads or seeded_grads()
    for step in range(steps) if isinstance(steps, int) else steps:
        set_grads(params, step)
        opt.step()
        if between is not None:
            between(opt, params, step)


def drawn_batches(x_shape, y_shape, *, seed: int = 1, device=None, dtype=None):
    """A `batch` for `train_model`: each step's (x, y) normal values drawn in turn from one generator
    seeded `seed` (a run's batches, not a step's), made `dtype` on `device` when given."""
    generator = torch.Generator().manual_seed(seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(x_shape, generator=generator).to(device=device, dtype=dtype)
        y = torch.randn(y_shape, generator=generator).to(device=device, dtype=dtype)
        return x, y
    return batch


def train_model(model, opt, steps, batch, *, loss_in_fp32: bool = False, scaler=None, after_backward=None,
                clip=None) -> list:
    """Steps `opt` at each step of `steps` (a range of step numbers, or a count from 0) on the MSE loss of
    model(x) against y, (x, y) = batch(step) (the loss in fp32 with `loss_in_fp32`): the gradients set to
    None, the backward (of the loss scaled by `scaler` when given, which then steps), `after_backward(step)`,
    `clip(model, opt)` (after the scaler's unscale_), the step; the gradients None again after it.
    Returns what `clip` returned, a value per step."""
    clipped = []
    for step in range(steps) if isinstance(steps, int) else steps:
        x, y = batch(step)
        out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y.float()) if loss_in_fp32 else \
            torch.nn.functional.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if after_backward is not None:
            after_backward(step)
        if clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)
            clipped.append(clip(model, opt))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
    return clipped


def sharded_on(mesh):
    """A function sharding a whole tensor over `mesh` along its first dimension (mesh None: the tensor)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def shard(full: torch.Tensor) -> torch.Tensor:
        return full if mesh is None else distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    return shard


_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The elements of `t` as integers of their width, flat: equal where the bits are (-0.0 is not 0.0,
    a NaN equals itself)."""
    return t.detach().contiguous().reshape(-1).view(_INTEGER_OF_WIDTH[t.element_size()])


def assert_bitwise_equal(got, want, what: str = "", *, names=None, canonical=bits) -> None:
    """`got` equal to `want` bit for bit, dtype and shape included, through any nesting of lists, tuples and
    dicts (the same keys; with `names`, the entries `names` of the outer dict only) down to tensors (other
    values: equal). `canonical(t)` gives the integers compared (default the bits; e.g. every NaN made one)."""
    if isinstance(want, dict):
        if names is None:
            assert got.keys() == want.keys(), f"{what}: keys {sorted(got)} vs {sorted(want)}"
        for name in want if names is None else names:
            assert_bitwise_equal(got[name], want[name], f"{what}[{name!r}]", canonical=canonical)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{what}: {len(got)} items, not {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bitwise_equal(g, w, f"{what}[{i}]", canonical=canonical)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
        differ = (canonical(got).reshape(-1) != canonical(want).to(got.device).reshape(-1)).nonzero().flatten()
        first = differ[0].item() if differ.numel() else None
        assert first is None, (f"{what}: {differ.numel()} of {want.numel()} elements differ, first at {first}: "
                               f"{got.detach().reshape(-1)[first].item()!r} vs "
                               f"{want.detach().reshape(-1)[first].item()!r}")
    else:
        assert got == want, f"{what}: {got!r} vs {want!r}"


def free_port() -> int:
    """A TCP port free on this machine now, for a spawned gloo process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ParameterListModel(torch.nn.Module):
    """A module holding parameters of `shapes` (normal values from `seed`, in `dtype`): an optimizer's
    tensors with a module around them, for what needs one (overlap_with, load_state_dict)."""

    def __init__(self, shapes, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes)


def spawn_ranks(worker, world: int, *args, saved: str = "results.pt"):
    """Runs ``worker(rank, port, folder, *args)`` on `world` processes (a gloo group's rendezvous on
    a free port, `folder` a temporary one) and returns what they saved there as `saved` (rank 0's
    file; with "{rank}" in the name, every rank's, in rank order)."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(free_port(), folder, *args), nprocs=world, join=True)
        if "{rank}" in saved:
            return [torch.load(os.path.join(folder, saved.format(rank=r)), weights_only=False) for r in range(world)]
        return torch.load(os.path.join(folder, saved), weights_only=False)
