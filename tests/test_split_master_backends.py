"""Split master weights ([note: split master weights] in csrc/include/fusedoff/master.h) on every
backend: cpu, torch, triton (the interpreter) and the CUDA kernels (emulated on the host).

For AdamW with fp32, bf16 and 8-bit states and for Apollo with each weight decay type, on bf16
params of odd sizes, over several steps with a grad scale and a skipped (found_inf) step:

- "split" gives the bits of "fp32": params, states, and the master joined back from its low half.
- "split8" is, step by step, the stochastic rounding (``master.round_split8``, the torch mirror of
  master.h) of the fp32-master step from the same state, on each backend: so every backend rounds
  alike and the master stays within 256 units of the fp32 result per step. Where two backends'
  fp32 steps agree bit for bit (the CUDA kernels and the host kernels for Adam), their "split8"
  runs do too.
- A parameter with a master is the master rounded with ties away from zero, fp32 master included.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch

from fusedoff import ops
from fusedoff.kernels import codec, master
from tests.helpers import assert_bitwise_equal

SIZES = (1, 7, 300, 4097)
NUM_STEPS = 3
SKIPPED_STEP = 1  # found_inf is set on this step: nothing may change
GRAD_SCALE = 2.0

BACKENDS = [
    "cpu",
    "torch",
    pytest.param("triton", marks=pytest.mark.triton),
    pytest.param("cuda_emulated", marks=pytest.mark.emulated),
]
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True,
            maximize=False, amsgrad=False)
APOLLO = dict(lr=1e-2, base_lr=1e-2, init_lr=1e-5, warmup=2.0, beta=0.9, eps=1e-4, weight_decay=0.01)
# op name -> (states, Apollo's rebound and weight decay type)
OPS = {
    "adamw": ("fp32", None),
    "adamw-bf16": ("bf16", None),
    "adamw-8bit": ("8bit", None),
    "apollo-L2": (None, ("constant", "L2")),
    "apollo-decoupled": (None, ("belief", "decoupled")),
    "apollo-stable": (None, ("constant", "stable")),
}


@dataclass
class Problem:
    """One op's tensors on bf16 params: a master of some precision and the optimizer states."""

    op: str
    params: list[torch.Tensor]
    masters: list[torch.Tensor]
    states: dict[str, list[torch.Tensor]]
    steps: list[torch.Tensor] = field(default_factory=list)
    offset: int = 0  # every tensor is a view this many elements into its buffer

    def joined_masters(self) -> list[torch.Tensor]:
        return [master.load(m, p) for m, p in zip(self.masters, self.params)]

    def with_precision(self, precision: str) -> "Problem":
        """A copy whose masters are stored in `precision` (exact: the masters are on its grid)."""
        out = copy.deepcopy(self)
        out.masters = [at_offset(master.split(m, precision), self.offset) for m in out.joined_masters()]
        return out

    def at_offset(self, offset: int) -> "Problem":
        """A copy whose tensors (params, masters, states) are views `offset` elements into buffers."""
        out = copy.deepcopy(self)
        out.offset = offset
        out.params, out.masters = ([at_offset(t, offset) for t in ts] for ts in (self.params, self.masters))
        out.states = {name: [at_offset(t, offset) for t in ts] for name, ts in self.states.items()}
        return out


def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of `t`, as a view `offset` elements into a fresh buffer (filled with ones)."""
    buffer = torch.ones(t.numel() + offset + 8, dtype=t.dtype)
    view = buffer[offset:offset + t.numel()]
    view.copy_(t)
    return view


def make_problem(op: str, seed: int = 0) -> Problem:
    """fp32 masters on the "split8" grid (so that every precision stores them exactly) and the bf16
    params that are their rounding; states that an earlier step could have left."""
    states_kind, _ = OPS[op]
    gen = torch.Generator().manual_seed(seed)
    masters, params = [], []
    for n in SIZES:
        value = torch.randn(n, generator=gen)
        param = master.param_of_master(value, torch.bfloat16)
        masters.append(master.join(param, master.split(value, "split8")))
        params.append(param)
    states: dict[str, list[torch.Tensor]] = {}
    if op.startswith("apollo"):
        states = {name: [torch.zeros(n) for n in SIZES] for name in ("exp_avg_grads", "approx_hessians", "updates")}
    else:
        m = [torch.randn(n, generator=gen) * 1e-2 for n in SIZES]
        v = [x * x * (1 + torch.rand(x.shape, generator=gen)) for x in m]
        if states_kind == "fp32":
            states = {"exp_avgs": m, "exp_avg_sqs": v}
        elif states_kind == "bf16":
            states = {"exp_avgs": [x.to(torch.bfloat16) for x in m], "exp_avg_sqs": [x.to(torch.bfloat16) for x in v]}
        else:
            mq = [codec.quantize(x, signed=True) for x in m]
            vq = [codec.quantize(x, signed=False) for x in v]
            states = {"exp_avgs": [c for c, _ in mq], "exp_avg_sqs": [c for c, _ in vq],
                      "exp_avg_absmaxs": [s for _, s in mq], "exp_avg_sq_absmaxs": [s for _, s in vq]}
    steps = [torch.tensor(float(4 + i)) for i in range(len(SIZES))]
    return Problem(op, params, masters, states, steps)


def make_grads(seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [[(torch.randn(n, generator=gen) * 0.1 * GRAD_SCALE).to(torch.bfloat16) for n in SIZES]
            for _ in range(NUM_STEPS)]


def step_(problem: Problem, backend: str, grads: list[torch.Tensor], found_inf: torch.Tensor, **hyper) -> None:
    """One optimizer step of `problem` in place: the step counts, then the op."""
    ops.increment_steps_(problem.steps, found_inf)
    s = problem.states
    amp = dict(grad_scale=torch.tensor(GRAD_SCALE), found_inf=found_inf, backend=backend)
    states_kind, apollo_modes = OPS[problem.op]
    if states_kind == "fp32":
        ops.adam_step_(problem.params, grads, s["exp_avgs"], s["exp_avg_sqs"], [], problem.masters, problem.steps,
                       **amp, **dict(ADAM, **hyper))
    elif states_kind is not None:
        ops.adam_compressed_step_(problem.params, grads, s["exp_avgs"], s["exp_avg_sqs"], s.get("exp_avg_absmaxs", []),
                                  s.get("exp_avg_sq_absmaxs", []), problem.masters, problem.steps, [0] * len(SIZES),
                                  [codec.tensor_key(7, i) for i in range(len(SIZES))], **amp, **dict(ADAM, **hyper))
    else:
        rebound, decay_type = apollo_modes
        ops.apollo_whole_step_(problem.params, grads, s["exp_avg_grads"], s["approx_hessians"], s["updates"],
                               problem.masters, problem.steps, rebound=rebound, weight_decay_type=decay_type, **amp,
                               **dict(APOLLO, **hyper))


def found_inf_at(step: int) -> torch.Tensor:
    return torch.tensor(1.0 if step == SKIPPED_STEP else 0.0)


def run(problem: Problem, backend: str, grads_per_step) -> Problem:
    for k, grads in enumerate(grads_per_step):
        step_(problem, backend, grads, found_inf_at(k))
    return problem


def assert_same_problem(got: Problem, want: Problem, what: str) -> None:
    """Params, states, step counts and the (joined) master weights equal bit for bit."""
    assert_bitwise_equal(got.params, want.params, f"{what}params")
    for name, tensors in want.states.items():
        assert_bitwise_equal(got.states[name], tensors, f"{what}{name}")
    assert_bitwise_equal(got.steps, want.steps, f"{what}steps")
    assert_bitwise_equal(got.joined_masters(), want.joined_masters(), f"{what}masters")


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_split_gives_the_bits_of_fp32(backend, op):
    check_split_gives_the_bits_of_fp32(make_problem(op), backend)


def check_split_gives_the_bits_of_fp32(problem: Problem, backend: str) -> None:
    grads = make_grads(0)
    want = run(problem.with_precision("fp32"), backend, grads)
    got = run(problem.with_precision("split"), backend, grads)
    assert all(m.dtype == torch.int16 for m in got.masters)
    assert_same_problem(got, want, f"{backend} split vs fp32: ")
    assert not torch.equal(got.params[-1], problem.params[-1])  # the steps did change the params


def split8_step_against_fp32(problem: Problem, backend: str, grads, found_inf) -> tuple[Problem, Problem]:
    """One step of a "split8" problem, and of an fp32-master copy of it."""
    fp32 = problem.with_precision("fp32")
    step_(problem, backend, grads, found_inf)
    step_(fp32, backend, grads, found_inf)
    return problem, fp32


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_split8_is_the_stochastic_rounding_of_the_fp32_step(backend, op):
    """Each step stores round_split8 (master.h's round_master_split8, mirrored in torch) of the fp32
    step from the same state: within 256 units of it, the same rounding on every backend."""
    check_split8_rounds_the_fp32_step(make_problem(op), backend)


def check_split8_rounds_the_fp32_step(problem: Problem, backend: str) -> None:
    problem = problem.with_precision("split8")
    rounded_up = rounded_down = 0
    for k, grads in enumerate(make_grads(0)):
        before = copy.deepcopy(problem)
        problem, fp32 = split8_step_against_fp32(problem, backend, grads, found_inf_at(k))
        assert all(m.dtype == torch.uint8 for m in problem.masters)
        if k == SKIPPED_STEP:
            assert_same_problem(problem, before, f"{backend} step {k} (skipped): ")
            continue
        for name, tensors in fp32.states.items():  # the update reads the same master: same states
            assert_bitwise_equal(problem.states[name], tensors, f"{backend} step {k}: {name}")
        got = problem.joined_masters()
        for i, (g, exact, step) in enumerate(zip(got, fp32.masters, problem.steps)):
            want = master.round_split8(exact, master.split8_salt(step))
            assert_bitwise_equal([g], [want], f"{backend} step {k}: master {i}")
            assert_bitwise_equal([problem.params[i]], [master.param_of_master(g, torch.bfloat16)],
                             f"{backend} step {k}: param {i}")
            units = (g.view(torch.int32).long() - exact.view(torch.int32).long()).abs()
            assert units.max().item() < 256, f"{backend} step {k}: master {i} is {units.max().item()} units off"
            rounded_up += (units > 0).logical_and(g.abs() > exact.abs()).sum().item()
            rounded_down += (units > 0).logical_and(g.abs() < exact.abs()).sum().item()
    assert rounded_up > 100 and rounded_down > 100  # stochastic: both ways


@pytest.mark.emulated
@pytest.mark.parametrize("offset", [1, 3, 5, 12])
@pytest.mark.parametrize("op", ["adamw", "apollo-L2", "apollo-stable"])
def test_views_at_an_offset_on_the_cuda_kernels(op, offset):
    """Every array a view at an element offset: the CUDA kernels take their scalar path up to the
    vector head (for a "split8" master, whose vector accesses are 8-byte words, the head of the bf16
    params), then load and store the params and low bits as words; "split" still gives the bits of
    "fp32" and "split8" rounds the fp32 step, and no access is misaligned (the emulator faults on one)."""
    problem = make_problem(op).at_offset(offset)
    assert problem.params[0].data_ptr() % 16 == 2 * offset % 16
    check_split_gives_the_bits_of_fp32(problem, "cuda_emulated")
    check_split8_rounds_the_fp32_step(problem, "cuda_emulated")


def _backend_names():
    return [b if isinstance(b, str) else b.values[0] for b in BACKENDS]


@pytest.mark.triton
@pytest.mark.emulated
@pytest.mark.parametrize("op", list(OPS))
def test_split8_runs_agree_where_the_fp32_steps_agree(op):
    """Backends whose fp32-master steps agree bit for bit give the same "split8" bits too. For Adam
    the CUDA kernels, the host kernels and the interpreted Triton kernels agree (the same math,
    unfused; torch's CPU sqrt is not correctly rounded), for Apollo the host kernels and torch (the
    device kernels sum in another order)."""
    problem = make_problem(op, seed=3)
    grads = make_grads(3)
    fp32 = {b: run(problem.with_precision("fp32"), b, grads) for b in _backend_names()}
    split8 = {b: run(problem.with_precision("split8"), b, grads) for b in _backend_names()}
    agreeing = []
    for b in _backend_names():
        try:
            assert_same_problem(fp32[b], fp32["cpu"], "")
        except AssertionError:
            continue
        agreeing.append(b)
        assert_same_problem(split8[b], split8["cpu"], f"{b} vs cpu, split8: ")
    from fusedoff.kernels import triton_common

    expected = {"cuda_emulated", *(["triton"] if triton_common.INTERPRETED else [])} if op.startswith("adamw") \
        else {"torch"}
    assert expected <= set(agreeing), agreeing


# ---- ties round away from zero --------------------------------------------------------------------


def tie_masters(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 masters that are ties of bf16 (low half 0x8000) with an even upper half, of both signs,
    and the upper halves (int64): round to nearest even gives the upper half, ties away from zero
    the next bf16 value in magnitude."""
    gen = torch.Generator().manual_seed(seed)
    upper = (torch.randn(n, generator=gen).view(torch.int32).long() >> 16) & 0xFFFE
    joined = (upper << 16) | 0x8000
    return codec.bits_float(joined), upper


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("precision", ["fp32", "split"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tie_rounds_away_from_zero(backend, precision, op):
    """A step that changes no weight (lr = 0, no weight decay) writes each param as its master
    rounded: ties go away from zero (nearest even would keep the even upper half)."""
    problem = make_problem(op, seed=5)
    ties = [tie_masters(n, seed=i) for i, n in enumerate(SIZES)]
    problem.masters = [m for m, _ in ties]
    even = [(u & 0xFFFF).to(torch.int32) for _, u in ties]
    problem.params = [m.to(torch.bfloat16) for m in problem.masters]  # nearest even: what must change
    assert all(torch.equal(p.view(torch.int16).long() & 0xFFFF, u) for p, (_, u) in zip(problem.params, ties))
    if precision == "split":  # the stored form beside the param that is its rounding
        problem.params = [master.param_of_master(m, torch.bfloat16) for m in problem.masters]
        problem.masters = [master.split(m, "split") for m in problem.masters]
    no_op = dict(lr=0.0, weight_decay=0.0) if op.startswith("adamw") else dict(lr=0.0, base_lr=0.0, init_lr=0.0,
                                                                              weight_decay=0.0)
    step_(problem, backend, make_grads(5)[0], torch.tensor(0.0), **no_op)
    for i, (p, (m, _)) in enumerate(zip(problem.params, ties)):
        assert_bitwise_equal([problem.joined_masters()[i]], [m], f"{backend}: master {i}")
        got = (p.view(torch.int16).to(torch.int32) & 0xFFFF)
        assert torch.equal(got, even[i] + 1), f"{backend}: param {i} is not its tie rounded away from zero"


# ---- a written parameter is taken, element by element ---------------------------------------------


def written_problems(op: str, dtype: torch.dtype) -> tuple[Problem, Problem]:
    """Two problems with fp32 masters and `dtype` params that every backend must step alike:

    - "written": every fifth element (from the second) of each param written since the masters'
      last step (the masters stale, about 3 away); every fifth (from the first) a master at an exact
      tie whose param is the nearest rounding that fusedoff does not write (torch's cast for bf16,
      ties away from zero for fp16); the others the masters' rounding;
    - "clean": the masters those params say (the written values, the tie masters) and their rounding.
    """
    clean = make_problem(op, seed=9).with_precision("fp32")
    written = copy.deepcopy(clean)
    for i, (m, n) in enumerate(zip(clean.masters, SIZES)):
        m.copy_(master.param_of_master(m, dtype).float())  # on the param's grid: the ties below are exact
        gen = torch.Generator().manual_seed(50 + i)
        if dtype == torch.bfloat16:
            upper = (m.view(torch.int32)[0::5] & ~0x1FFFF)  # an even upper half
            m[0::5] = (upper | 0x8000).view(torch.float32)
            other = m.to(torch.bfloat16)  # nearest even: the upper half, fusedoff rounds away from zero
        else:
            below = m.to(torch.float16)
            up = (below.view(torch.int16) + 1).view(torch.float16)  # the next fp16 value in magnitude
            m[0::5] = ((m + up.float()) / 2)[0::5]  # exact ties between the two
            other = torch.where(m.to(torch.float16) == up, below, up)  # at a tie: the one not nearest even
        clean.params[i] = master.param_of_master(m, dtype)
        param = clean.params[i].clone()
        param[0::5] = other[0::5]
        param[1::5] = (m[1::5] + 3.0 + torch.rand(m[1::5].shape, generator=gen)).to(dtype)
        written.params[i], written.masters[i] = param, m.clone()
        clean.masters[i] = torch.where(torch.arange(n) % 5 == 1, param.float(), m)
        clean.params[i] = master.param_of_master(clean.masters[i], dtype)
        assert (written.params[i] != clean.params[i]).sum() > (n > 10)  # the ties the run must not take for writes
    return written, clean


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_written_parameter_is_taken_element_by_element(backend, op, dtype):
    """An fp32 master is read with its param ([note: every write is seen] in master.h): the step
    from the written params gives, bit for bit, the step from masters that hold the written values
    (and the tie masters, kept); three steps, one of them skipped."""
    written, clean = written_problems(op, dtype)
    grads = [[g.to(dtype) for g in step] for step in make_grads(9)]
    assert_same_problem(run(written, backend, grads), run(clean, backend, grads), f"{backend}: ")


def masters_and_candidates(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite fp32 masters (normal, subnormal in `dtype`, signed zeros, exact ties of `dtype` and
    values near its largest) each beside 3 params: torch's cast and the next `dtype` value either
    side of it in bit pattern (a tie's other nearest rounding is one of them)."""
    gen = torch.Generator().manual_seed(11)
    tiny = torch.finfo(dtype).tiny
    parts = [torch.randn(3000, generator=gen), torch.randn(1000, generator=gen) * tiny,
             torch.randn(500, generator=gen) * torch.finfo(dtype).max / 4, torch.tensor([0.0, -0.0])]
    grid = torch.cat(parts).to(dtype)
    above = (grid.view(torch.int16) + 1).view(dtype)  # the next value in magnitude
    ties = (grid.double() + above.double()) / 2  # exact in fp32 for bf16 and fp16 neighbours
    finite = above.isfinite() & ties.isfinite()
    masters = torch.cat([torch.cat(parts), ties[finite].float()])
    masters = masters[masters.abs() < torch.finfo(dtype).max]
    cast = masters.to(dtype).view(torch.int16)
    candidates = torch.stack([cast - 1, cast, cast + 1]).view(dtype)
    # (no NaN param, one below a zero: arithmetic on a NaN need not keep its bits on every backend)
    return masters, torch.where(candidates.isnan(), masters.to(dtype), candidates)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_only_a_nearest_rounding_keeps_the_master(backend, dtype):
    """A step that changes no weight (lr 0, no decay, zero gradients) stores the value it started
    from: the master where the param is one of its nearest roundings (either at a tie, float64
    distances), else the param. Every backend, the host kernels' 16-lane form included."""
    masters, candidates = masters_and_candidates(dtype)
    kept_at_ties = taken = 0
    for param in candidates:
        master_param = masters.clone()
        distance = (masters.double() - param.double()).abs()
        cast = masters.to(dtype)
        nearest = (distance == (masters.double() - cast.double()).abs()) & param.isfinite() & cast.isfinite() & (
            param.view(torch.int16).lt(0) == cast.view(torch.int16).lt(0))
        want = torch.where(nearest, masters, param.float())
        n = masters.numel()
        ops.adam_step_([param.clone()], [torch.zeros(n, dtype=dtype)], [torch.zeros(n)], [torch.zeros(n)], [],
                       [master_param], [torch.tensor(1.0)], backend=backend, **dict(ADAM, lr=0.0, weight_decay=0.0))
        assert_bitwise_equal([master_param], [want], f"{backend}: masters")
        kept_at_ties += (nearest & (param.view(torch.int16) != cast.view(torch.int16))).sum().item()
        taken += (~nearest).sum().item()
    assert kept_at_ties > 1000 and taken > 10000


# ---- the Triton kernels compiled (no GPU needed) --------------------------------------------------

_COMPILE_FOR_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fusedoff.kernels import triton_adam, triton_adam_compressed, triton_apollo

def compile_(kernel, pointers, **constexprs):
    signature = {}
    for p in kernel.params:
        if p.is_constexpr or p.name in constexprs:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = pointers.get(p.name, "*fp32")
        else:
            signature[p.name] = p.annotation or "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

amp = dict(HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, INDEX_64=False, BLOCK_SIZE=1024)
adam = dict(amp, DECOUPLED_WEIGHT_DECAY=True, MAXIMIZE=False, ROUND_BF16_IN_SOFTWARE=False)
for mode, master_ptr in ((0, "*fp32"), (1, "*fp32"), (2, "*i16"), (3, "*u8")):
    pointers = {"param_ptr": "*bf16", "grad_ptr": "*bf16", "master_ptr": master_ptr, "stats_ptr": "*fp64"}
    ptx = compile_(triton_adam._adam_kernel, pointers, max_exp_avg_sq_ptr=None, AMSGRAD=False, MASTER=mode, **adam)
    print(mode, "adam", ptx.count("cvt.rn.bf16.f32"))
    if mode < 2:
        continue
    codes = dict(pointers, exp_avg_ptr="*u8", exp_avg_sq_ptr="*u8")
    ptx = compile_(triton_adam_compressed._adam_compressed_kernel, codes, BLOCK8=True, MASTER=mode, QUANT_BLOCK=256,
                   **adam)
    print(mode, "adam_compressed", ptx.count("cvt.rn.bf16.f32"))
    ptx = compile_(triton_apollo._apollo_apply_kernel, pointers, partials_ptr=None, PHASE=triton_apollo.PHASE_FULL,
                   BELIEF=True, DECAY=triton_apollo.DECAY_L2, ROUND_BF16_IN_SOFTWARE=False, MASTER=mode, **amp)
    print(mode, "apollo", ptx.count("cvt.rn.bf16.f32"))
"""


def test_triton_kernels_compile_for_sm90_with_every_master_precision():
    """Without a GPU the interpreter never compiles the kernels: this does (for sm_90), with fp32,
    "split" and "split8" masters beside bf16 params, and checks in the PTX that a param with a master
    is not rounded by the hardware's round-to-nearest-even conversion (the one without a master is)."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert result.returncode == 0, result.stderr[-3000:]
    conversions = {tuple(line.split()[:2]): int(line.split()[2]) for line in result.stdout.splitlines()}
    assert conversions[("0", "adam")] > 0
    assert all(count == 0 for (mode, _), count in conversions.items() if mode != "0")
    assert len(conversions) == 1 + 1 + 2 * 3
