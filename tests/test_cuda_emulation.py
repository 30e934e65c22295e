"""The CUDA kernels run on the host by the CUDA emulation (csrc/emulation, backend 'cuda_emulated').

First the emulator itself, held to CUDA's rules through its self-test kernels
(csrc/emulation/emulator_selftest.cpp) against values worked out here from CUDA's documented
semantics. Then the device kernels: Adam/AdamW and compressed Adam bit for bit against the host
kernels (backend 'cpu'; both are compiled without FMA contraction, so they round alike), Apollo
against the float64 oracle (its device sums run in another order than the host's: see
csrc/cuda/apollo_cuda.cu), across every dtype and mode, every chunk and launch-table boundary (read
from the kernel sources, so the sizes follow the code), views at an offset, and block and thread
schedules drawn from seeds, which must not change a bit.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch

from fusedoff import ops
from fusedoff.testing.emulation import load_emulated_extension
from tests.helpers import SIZES, STORAGE_DTYPES, assert_bitwise_equal, make_adam_problem, run_adam
from tests.test_adam_op import dtype_cases
from tests.test_adam_op import hyper as adam_hyper
from tests.test_apollo import MODE_IDS, MODES, OP_STATES, assert_op_states_within, make_op_problem, op_hyper
from tests.test_compressed_states import HYPER as COMPRESSED_HYPER
from tests.test_compressed_states import compressed_problem, spanning_values
from tests.test_unaligned_views import (DTYPE_PAIRS, OFFSETS, adam_problem, apollo_problem, assert_pads_untouched,
                                        at_offset)
from tests.test_unaligned_views import assert_same_values as assert_same_view_values
from tests.test_unaligned_views import run_adam as run_adam_views
from tests.test_unaligned_views import run_apollo as run_apollo_views

pytestmark = pytest.mark.emulated

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def source(path: str) -> str:
    return (CSRC / path).read_text()


def constant(path: str, pattern: str) -> int:
    return int(re.search(pattern, source(path)).group(1))


# The kernels' geometry, read from their sources: one block of THREADS per chunk of CHUNK elements;
# one launch holds at most a table's capacity of tensors.
CHUNK = constant("cuda/multi_tensor.cuh", r"constexpr int kChunkElements = (\d+);")
THREADS = constant("cuda/multi_tensor.cuh", r"constexpr int kThreads = (\d+);")
ADAM_CAPACITY = constant("cuda/adam_cuda.cu", r"ChunkTable<AdamTensorPtrs, \w+, (\d+)>")
COMPRESSED_CAPACITY = constant("cuda/adam_compressed_cuda.cu", r"ChunkTable<CompressedAdamTensorPtrs, \w+, (\d+)>")
APOLLO_CAPACITY = constant("cuda/apollo_cuda.cu", r"ChunkTable<ApolloTensorPtrs, \w+, (\d+)>")
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def emulator():
    """The emulator's controls and self-test kernels: ops of torch.ops.fusedoff_emulated."""
    load_emulated_extension()
    return torch.ops.fusedoff_emulated


@pytest.fixture(scope="module", autouse=True)
def one_host_thread():
    """The emulator runs on the calling thread; the host kernels and the torch oracles run on one
    thread here too. With OpenMP's threads on a loaded 2-core machine every small op waits for a
    time slice at its barrier: this file took 188 s with two threads and 14 s with one. The kernels'
    bits do not depend on the thread count (their blocks and sums are fixed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def schedule(emulator):
    """Sets the emulator's schedule seed; index order (0) again after the test, whatever happens."""
    yield emulator.set_schedule_seed
    emulator.set_schedule_seed(0)


# ---- the emulator's own rules ----------------------------------------------------------------------------

def expected_indices() -> list[int]:
    """indices: grid (3, 2, 1) of blocks (4, 2, 8). Numbered as CUDA numbers them (x fastest),
    thread t of block b is thread b * 64 + t of the grid: it writes that index and b."""
    blocks, threads = 3 * 2 * 1, 4 * 2 * 8
    return [v for i in range(blocks * threads) for v in (i, i // threads)]


def shuffle(values: list, kind: str, operand: int, width: int = 32) -> list:
    """CUDA's __shfl_*_sync over one warp, all lanes in the mask: each lane gets its source lane's
    value, or its own where the source lies outside its width segment."""
    out = []
    for lane in range(32):
        segment = lane - lane % width
        source = {"idx": segment + operand % width, "xor": lane ^ operand, "down": lane + operand,
                  "up": lane - operand}[kind]
        out.append(values[source] if segment <= source < segment + width else values[lane])
    return out


def expected_shuffles() -> list[int]:
    lanes = list(range(32))
    butterfly = lanes
    for m in (16, 8, 4, 2, 1):
        butterfly = [a + b for a, b in zip(butterfly, shuffle(butterfly, "xor", m))]
    tree = [float(lane) for lane in lanes]
    for d in (16, 8, 4, 2, 1):
        tree = [a + b for a, b in zip(tree, shuffle(tree, "down", d))]
    up = shuffle([float(lane) for lane in lanes], "up", 1)
    seven = shuffle([10 * lane for lane in lanes], "idx", 7)
    warp = [v for lane in lanes for v in (butterfly[lane], int(tree[lane]), int(up[lane]), seven[lane])]
    return warp * 2  # 64 threads: two warps, lanes numbered from 0 in each


@pytest.mark.parametrize("name,expected", [("indices", expected_indices), ("shuffles", expected_shuffles)])
@pytest.mark.parametrize("seed", (0, *SEEDS))
def test_selftest_kernels_compute_what_a_gpu_would(emulator, schedule, name, expected, seed):
    """Under every thread order: the barrier orders thread 0's write to shared memory before the
    other threads read it, and a shuffle exchanges the values all lanes hold at it."""
    schedule(seed)
    before = emulator.launches()
    outputs, error = emulator.selftest(name)
    assert error == ""
    assert emulator.launches() - before == 1
    assert outputs == expected()


OVERSIZED_BYTES = constant("emulation/emulator_selftest.cpp", r"char bytes\[(\d+)\];")
PARAM_BYTES = (OVERSIZED_BYTES + 7) // 8 * 8 + 8  # the struct, then an int* at its 8-byte alignment

# Each error's message starts with the CUDA runtime's text for its error code.
ERRORS = {
    "early_return": ["unspecified launch failure", "thread 5 returned while 31 threads wait at __syncthreads"],
    "divergent_shuffle": ["unspecified launch failure", "can never go on",
                          "names thread 16, which waits at __syncthreads"],
    "shuffle_outside_mask": ["unspecified launch failure",
                             "lane 15 reads lane 16, which the shuffle's mask does not name"],
    "misaligned_vector": ["misaligned address", "not 16-byte aligned"],
    "oversized_parameter": ["invalid argument", f"kernel parameters of {PARAM_BYTES} bytes, past the 4096-byte limit"],
    "block_too_large": ["invalid configuration argument", "block (2048,1,1)", "past the device's limit"],
    "block_too_many_threads": ["invalid configuration argument", "a block of 2048 threads (at most 1024)"],
    "empty_grid": ["invalid configuration argument", "grid (0,1,1)", "a dimension is 0"],
}


def test_every_selftest_is_checked(emulator):
    assert sorted(emulator.selftest_names()) == sorted(["indices", "shuffles", *ERRORS])


@pytest.mark.parametrize("name", list(ERRORS))
def test_selftest_kernels_that_break_a_rule_fail_their_launch(emulator, name):
    """Each is reported with what happened, the grid stops before any thread writes its output, and
    the error does not outlive the launch (the next one succeeds)."""
    before = emulator.launches()
    outputs, error = emulator.selftest(name)
    assert emulator.launches() - before == 1  # failed launches are counted too
    assert error.startswith(f"fusedoff CUDA emulation: {ERRORS[name][0]}: "), error
    for part in ERRORS[name]:
        assert part in error, error
    assert set(outputs) == {-1}
    assert emulator.selftest("indices") == (expected_indices(), "")


# ---- Adam/AdamW: bit for bit the host kernels --------------------------------------------------------------

ADAM_SIZES = SIZES + ((CHUNK + 37,),)  # 0-d, 1, 7, 4097 and two chunks with a tail


def adam_on_both(problem, h, **kwargs):
    """(emulated, host) runs of every step of `problem`, each on its own copy."""
    return (run_adam(problem.to(), "cuda_emulated", h, **kwargs), run_adam(problem.to(), "cpu", h, **kwargs))


@pytest.mark.parametrize("param_dtype,grad_dtype,master", list(dtype_cases()))
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_dtypes_equal_the_host_kernel(param_dtype, grad_dtype, master, decoupled):
    h = adam_hyper(amsgrad=True, decoupled=decoupled)
    problem = make_adam_problem(param_dtype=param_dtype, grad_dtype=grad_dtype, master=master, amsgrad=True,
                                num_steps=3, sizes=ADAM_SIZES)
    got, want = adam_on_both(problem, h)
    assert_bitwise_equal(got.states(), want.states())


@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["", "maximize"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("param_dtype,master", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16-master"])
def test_adam_modes_equal_the_host_kernel(amsgrad, maximize, decoupled, param_dtype, master):
    h = adam_hyper(amsgrad=amsgrad, maximize=maximize, decoupled=decoupled)
    problem = make_adam_problem(param_dtype=param_dtype, grad_dtype=param_dtype, master=master, amsgrad=amsgrad,
                                num_steps=3, sizes=ADAM_SIZES)
    got, want = adam_on_both(problem, h)
    assert_bitwise_equal(got.states(), want.states())


@pytest.mark.parametrize("grad_dtype", STORAGE_DTYPES, ids=str)
def test_adam_grad_scale_equals_the_host_kernel(grad_dtype):
    """1000 is not a power of two: a kernel that multiplied by a rounded 1/1000 would differ."""
    problem = make_adam_problem(grad_dtype=grad_dtype, amsgrad=True, num_steps=3, sizes=ADAM_SIZES, grad_scale=1000.0)
    got, want = adam_on_both(problem, adam_hyper(amsgrad=True), grad_scale=torch.tensor(1000.0))
    assert_bitwise_equal(got.states(), want.states())


@pytest.mark.parametrize("found_inf", [0.0, 1.0, 2.0, float("nan")], ids=["0", "1", "2", "nan"])
@pytest.mark.parametrize("param_dtype,master", [(torch.float32, False), (torch.float16, True)],
                         ids=["fp32", "fp16-master"])
def test_adam_found_inf(found_inf, param_dtype, master):
    """A step with found_inf != 0 (GradScaler sums the flags of several devices: 2; NaN skips too)
    changes nothing, bit for bit; with 0 it is the step without found_inf."""
    h = adam_hyper(amsgrad=True)
    problem = make_adam_problem(param_dtype=param_dtype, grad_dtype=param_dtype, master=master, amsgrad=True,
                                num_steps=2, sizes=ADAM_SIZES)

    def flagged_step(backend, flag):
        """Two steps, then one with the flag: the states before and after it."""
        run = run_adam(problem.to(), backend, h)
        before = copy.deepcopy(run.states())
        ops.adam_step_(run.params, run.grads_per_step[0], run.exp_avgs, run.exp_avg_sqs, run.max_exp_avg_sqs,
                       run.master_params, run.steps, grad_scale=torch.tensor(2.0), found_inf=flag, backend=backend,
                       **h)
        return before, run.states()

    before, got = flagged_step("cuda_emulated", torch.tensor(found_inf))
    assert_bitwise_equal(got, flagged_step("cpu", torch.tensor(found_inf))[1])
    if found_inf == 0:
        assert_bitwise_equal(got, flagged_step("cuda_emulated", None)[1])
        assert not torch.equal(got["exp_avg"][-1], before["exp_avg"][-1])
    else:
        assert_bitwise_equal(got, before)


# ---- compressed states: bit for bit the host kernels --------------------------------------------------------

COMPRESSED_SIZES = (1, 7, 255, 256, 257, 1000, CHUNK + 300)  # partial, whole and several 8-bit blocks, two chunks
COMPRESSED_DTYPES = {"fp32": (torch.float32, torch.float32), "bf16-master": (torch.bfloat16, torch.bfloat16),
                     "fp16-master-fp32-grads": (torch.float16, torch.float32)}
COMPRESSED_MODES = {"adamw": {}, "adam-maximize": dict(decoupled_weight_decay=False, maximize=True)}


def compressed_offsets(precision: str, sizes) -> list[int]:
    """Ranges across element 2^32 (the random stream takes the high half of the index into its bits);
    8-bit ranges start on a block."""
    if precision == "bf16":
        return [2**32 - n // 2 - 3 for n in sizes]
    return [2**32 - 256 * -(-n // 512) for n in sizes]


def run_compressed(tensors, precision, backend, num_steps, h, grad_dtype, **kwargs):
    """num_steps steps of the compressed op on `tensors` (in place), fresh gradients each step."""
    sizes = [p.numel() for p in tensors[0]]
    for step in range(num_steps):
        tensors[1] = [spanning_values(n, 100 * step + i, low=-6, high=1).to(grad_dtype) for i, n in enumerate(sizes)]
        ops.increment_steps_(tensors[7], kwargs.get("found_inf"))
        ops.adam_compressed_step_(*tensors, compressed_offsets(precision, sizes),
                                  [0x9E3779B9 + i for i in range(len(sizes))], backend=backend, **h, **kwargs)
    return tensors


def compressed_dict(tensors) -> dict:
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "exp_avg_absmaxs", "exp_avg_sq_absmaxs", "master_params",
             "steps")
    return dict(zip(names, tensors))


@pytest.mark.parametrize("mode", list(COMPRESSED_MODES))
@pytest.mark.parametrize("dtypes", list(COMPRESSED_DTYPES))
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_compressed_equals_the_host_kernel(precision, dtypes, mode):
    """Codes, scales, params and masters, over three steps."""
    param_dtype, grad_dtype = COMPRESSED_DTYPES[dtypes]
    h = dict(COMPRESSED_HYPER, **COMPRESSED_MODES[mode])
    problem = compressed_problem(precision, COMPRESSED_SIZES, seed=3, param_dtype=param_dtype)
    got, want = (compressed_dict(run_compressed(copy.deepcopy(problem), precision, backend, 3, h, grad_dtype))
                 for backend in ("cuda_emulated", "cpu"))
    assert_bitwise_equal(got, want)


def test_compressed_blocks_with_non_finite_values_and_zero_scales_equal_the_host_kernel():
    """The host kernel's AVX-512 8-bit blocks (csrc/cpu/adam_compressed_cpu.cpp) take other paths where
    a moment is inf or NaN (the scales' second look and the full encode) or a block's scale is 0 with
    codes that are not 0 (a state written from outside: the scalar code), which the finite problems
    above never reach; the emulated device kernel runs the scalar codec (state_codec.h) throughout."""
    sizes = (1000, CHUNK + 300)
    problem = compressed_problem("8bit", sizes, seed=5)
    problem[4][0][1] = 0.0  # block 1's first moments and block 2's second ones: scale 0, codes as they are
    problem[5][0][2] = 0.0

    def run(backend):
        tensors = copy.deepcopy(problem)
        for step in range(3):
            tensors[1] = [spanning_values(n, 100 * step + i, low=-6, high=1) for i, n in enumerate(sizes)]
            if step == 0:  # NaN, inf and -inf moments from here on, in three blocks
                tensors[1][0][[3, 260, 700]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
            ops.increment_steps_(tensors[7], None)
            ops.adam_compressed_step_(*tensors, compressed_offsets("8bit", sizes), [7, 8], backend=backend,
                                      **COMPRESSED_HYPER)
        return compressed_dict(tensors)

    got, want = run("cuda_emulated"), run("cpu")
    assert set(want["exp_avg_sqs"][0][[3, 260, 700]].tolist()) <= {0xFE, 0xFF}  # inf or NaN codes
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("found_inf", [1.0, 2.0])
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_compressed_found_inf_changes_nothing(precision, found_inf):
    problem = compressed_problem(precision, COMPRESSED_SIZES, seed=4, param_dtype=torch.bfloat16)
    got = run_compressed(copy.deepcopy(problem), precision, "cuda_emulated", 1, COMPRESSED_HYPER, torch.bfloat16,
                         found_inf=torch.tensor(found_inf), grad_scale=torch.tensor(4.0))
    del got[1], problem[1]  # the gradients
    assert_bitwise_equal(dict(enumerate(got)), dict(enumerate(problem)))


# ---- Apollo: against the float64 oracle, reproducible --------------------------------------------------------

APOLLO_SIZES = ((), (7,), (4097,), (2 * CHUNK + 3,))  # 0-d, odd, and three chunks (three block partials)


def apollo_op_problem(sizes, param_dtype=torch.float32, grad_dtype=torch.float32, master=False, seed=0):
    """tests.test_apollo's op problem, with one step count per tensor (1 to 9: warmup active and over)."""
    problem = make_op_problem(sizes, param_dtype, grad_dtype, master, seed=seed)
    problem["steps"] = [torch.full((), float(1 + 4 * i % 9)) for i in range(len(sizes))]
    return problem


def apollo_phases(problem, backend, hyper, dtype=None):
    """Every phase of a whole step, one call each, on copies of `problem` (cast to `dtype` if given):
    a snapshot (tensors, stats) after each phase, keyed by the phase."""
    p = {k: [t.to(dtype=(dtype if k != "steps" else None) or t.dtype, copy=True) for t in v]
         for k, v in problem.items()}
    stats = torch.zeros(len(p["params"]), ops.APOLLO_NUM_STATS, dtype=torch.float64)
    numels = [t.numel() for t in p["params"]]
    out = {}
    for phase in ops.apollo_phases(hyper["weight_decay"], hyper["weight_decay_type"]):
        ops.apollo_step_(p["params"], p["grads"], p["exp_avg_grads"], p["approx_hessians"], p["updates"],
                         p["master_params"], p["steps"], stats.unbind(0), numels, phase=phase, backend=backend, **hyper)
        out[phase] = (copy.deepcopy(p), stats.clone())
    return out


def run_apollo(problem, backend, hyper, dtype=None):
    """A whole step: the tensors after it, with the stats as 'stats'."""
    tensors, stats = list(apollo_phases(problem, backend, hyper, dtype).values())[-1]
    return dict(tensors, stats=[stats])


# fp32 roundings of a block's partial sum: the per-thread double sum rounded to fp32, a shuffle tree
# over 32 lanes, then thread 0 over the warps in order (apollo_cuda.cu); each rounds by at most
# 2^-24 of the magnitudes it adds.
BLOCK_SUM_ROUNDINGS = 1 + int(math.log2(32)) + (THREADS // 32 - 1)


def stat_magnitudes(problem, hyper) -> torch.Tensor:
    """Per tensor, what the rounding of each pass-1 sum is relative to: the sums of |d^4|, |y d| and
    |B d^2| (apollo.h's terms, in float64 from the inputs)."""
    l2 = hyper["weight_decay"] if hyper["weight_decay_type"] == "L2" else 0.0
    rows = []
    for i, grad in enumerate(problem["grads"]):
        p = (problem["master_params"] or problem["params"])[i].double()
        g, m, b, d = (t.double() for t in (grad, problem["exp_avg_grads"][i], problem["approx_hessians"][i],
                                           problem["updates"][i]))
        y = g + l2 * p - m
        rows.append([(d**4).sum().item(), (y * d).abs().sum().item(), (b * d * d).abs().sum().item()])
    return torch.tensor(rows, dtype=torch.float64)


def assert_stats_within(got, baseline, oracle, magnitude, fields, what):
    """err <= 2 * err(fp32 reference) + the block sums' roundings (the reference sums its fp32 terms
    in float64; the device kernel adds fp32 block partials)."""
    err, base = (got - oracle).abs(), (baseline - oracle).abs()
    bound = 2 * base + BLOCK_SUM_ROUNDINGS * 2.0**-24 * magnitude
    for f in fields:
        assert torch.all(err[:, f] <= bound[:, f]), (
            f"{what}: stat {f}: error {err[:, f].tolist()} vs bound {bound[:, f].tolist()}")


@pytest.mark.parametrize("rebound,decay_type", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("param_dtype,grad_dtype,master", [(torch.float32, torch.float32, False),
                                                           (torch.bfloat16, torch.float16, True)],
                         ids=["fp32", "bf16-master-fp16-grads"])
def test_apollo_every_phase_against_float64(rebound, decay_type, param_dtype, grad_dtype, master):
    """After each phase: the stats it adds to (sum d^4, sum y d, sum B d^2, max |y| after 'reduce';
    sum D after 'moments') and the tensors (what a phase does not write stays bit for bit)."""
    problem = apollo_op_problem(APOLLO_SIZES, param_dtype, grad_dtype, master)
    hyper = op_hyper(rebound, decay_type)
    got, baseline, oracle = (apollo_phases(problem, backend, hyper, dtype)
                             for backend, dtype in (("cuda_emulated", None), ("torch", None), ("torch", torch.float64)))
    magnitude = stat_magnitudes(problem, hyper)
    written = {"reduce": (), "moments": ("exp_avg_grads", "approx_hessians"), "full": OP_STATES, "finish": OP_STATES}
    previous = (problem, torch.zeros(len(APOLLO_SIZES), ops.APOLLO_NUM_STATS, dtype=torch.float64))
    for phase, (tensors, stats) in got.items():
        if phase == "reduce":
            base, want = baseline[phase][1], oracle[phase][1]
            assert_stats_within(stats[:, :3], base[:, :3], want[:, :3], magnitude, range(3), phase)
            # max |y| of the fp32 values the reference computes alike: no rounding of its own
            assert torch.equal(stats[:, 3], base[:, 3]), (stats[:, 3], base[:, 3])
        elif phase == "moments":
            sum_d = oracle[phase][1][:, 4:]
            assert_stats_within(stats[:, 4:], baseline[phase][1][:, 4:], sum_d, sum_d, [0], phase)
        else:
            assert torch.equal(stats, previous[1]), f"{phase} wrote the stats"
        untouched = [k for k in OP_STATES if k not in written[phase]]
        assert_bitwise_equal({k: tensors[k] for k in untouched}, {k: previous[0][k] for k in untouched}, f"{phase}: ")
        if written[phase]:
            assert_op_states_within(tensors, baseline[phase][0], oracle[phase][0], param_dtype)
        previous = (tensors, stats)


@pytest.mark.parametrize("rebound,decay_type", MODES, ids=MODE_IDS)
def test_apollo_is_reproducible_under_every_schedule(schedule, rebound, decay_type):
    """The same bits run after run, and whichever order the blocks and threads run in: the sums'
    order depends only on the split into chunks."""
    problem = apollo_op_problem(APOLLO_SIZES, torch.bfloat16, torch.bfloat16, True)
    hyper = op_hyper(rebound, decay_type)
    first = run_apollo(problem, "cuda_emulated", hyper)
    assert_bitwise_equal(run_apollo(problem, "cuda_emulated", hyper), first, "run 2: ")
    for seed in SEEDS:
        schedule(seed)
        assert_bitwise_equal(run_apollo(problem, "cuda_emulated", hyper), first, f"seed {seed}: ")


@pytest.mark.parametrize("found_inf", [1.0, 2.0])
@pytest.mark.parametrize("rebound,decay_type", [("constant", "L2"), ("belief", "stable")])
def test_apollo_found_inf_changes_nothing(rebound, decay_type, found_inf):
    problem = apollo_op_problem(APOLLO_SIZES, torch.bfloat16, torch.bfloat16, True)
    hyper = op_hyper(rebound, decay_type, warmup=5.0)
    got = run_apollo(problem, "cuda_emulated", dict(hyper, found_inf=torch.tensor(found_inf),
                                                    grad_scale=torch.tensor(4.0)))
    assert_bitwise_equal(got, dict(problem, stats=[torch.zeros(len(APOLLO_SIZES), ops.APOLLO_NUM_STATS,
                                                           dtype=torch.float64)]))


def test_adam_and_compressed_bits_do_not_depend_on_the_schedule(schedule):
    adam = make_adam_problem(param_dtype=torch.bfloat16, grad_dtype=torch.float16, master=True, amsgrad=True,
                             num_steps=2, sizes=ADAM_SIZES)
    compressed = compressed_problem("8bit", COMPRESSED_SIZES, seed=5)
    h = adam_hyper(amsgrad=True)

    def both():
        return (run_adam(adam.to(), "cuda_emulated", h).states(),
                compressed_dict(run_compressed(copy.deepcopy(compressed), "8bit", "cuda_emulated", 2,
                                               COMPRESSED_HYPER, torch.float32)))

    first = both()
    for seed in SEEDS:
        schedule(seed)
        for got, want in zip(both(), first):
            assert_bitwise_equal(got, want, f"seed {seed}: ")


# ---- every chunk and launch-table boundary --------------------------------------------------------------------

AROUND_A_CHUNK = {"one-short": ((CHUNK - 1,),), "one-chunk": ((CHUNK,),), "one-past": ((CHUNK + 1,),),
                  "with-empty-between": ((0,), (CHUNK - 1,), (0,), (3, 0), (CHUNK + 1,), (0,), (CHUNK,),
                                         (2 * CHUNK + 9,), (0,))}


def many_tensors(count: int, capacity: int) -> tuple[tuple[int, ...], ...]:
    """`count` non-empty tensors of odd sizes, two chunks where a table starts or ends, and an empty
    tensor after every fifth (empty tensors take no slot of a table)."""
    sizes = []
    for i in range(count):
        big = i % capacity in (0, capacity - 1)
        sizes.append((CHUNK + 5,) if big else (1 + 13 * i % 40,))
        if i % 5 == 4:
            sizes.append((0,))
    return tuple(sizes)


def table_counts(capacity: int) -> list[int]:
    return [capacity - 1, capacity, capacity + 1, 2 * capacity + 1]


@pytest.mark.parametrize("param_dtype,master", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16-master"])
@pytest.mark.parametrize("sizes", list(AROUND_A_CHUNK.values()), ids=list(AROUND_A_CHUNK))
def test_adam_sizes_around_a_chunk(emulator, sizes, param_dtype, master):
    problem = make_adam_problem(param_dtype=param_dtype, grad_dtype=param_dtype, master=master, amsgrad=True,
                                num_steps=2, sizes=sizes)
    before = emulator.launches()
    got = run_adam(problem.to(), "cuda_emulated", adam_hyper(amsgrad=True))
    assert emulator.launches() - before == 2  # one per step
    assert_bitwise_equal(got.states(), run_adam(problem.to(), "cpu", adam_hyper(amsgrad=True)).states())


@pytest.mark.parametrize("count", table_counts(ADAM_CAPACITY))
def test_adam_tensors_past_a_launch_table(emulator, count):
    problem = make_adam_problem(param_dtype=torch.bfloat16, grad_dtype=torch.float32, master=True, amsgrad=True,
                                num_steps=2, sizes=many_tensors(count, ADAM_CAPACITY))
    h = adam_hyper(amsgrad=True)
    before = emulator.launches()
    got = run_adam(problem.to(), "cuda_emulated", h)
    assert emulator.launches() - before == 2 * math.ceil(count / ADAM_CAPACITY)
    assert_bitwise_equal(got.states(), run_adam(problem.to(), "cpu", h).states())


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("sizes", [tuple(math.prod(s) for s in AROUND_A_CHUNK["with-empty-between"])]
                         + [tuple(math.prod(s) for s in many_tensors(c, COMPRESSED_CAPACITY)) for c in
                            table_counts(COMPRESSED_CAPACITY)],
                         ids=["with-empty-between"] + [f"{c}-tensors" for c in table_counts(COMPRESSED_CAPACITY)])
def test_compressed_sizes_and_launch_tables(emulator, precision, sizes):
    problem = compressed_problem(precision, sizes, seed=6, param_dtype=torch.bfloat16)
    non_empty = sum(1 for n in sizes if n)
    before = emulator.launches()
    got = run_compressed(copy.deepcopy(problem), precision, "cuda_emulated", 2, COMPRESSED_HYPER, torch.bfloat16)
    assert emulator.launches() - before == 2 * math.ceil(non_empty / COMPRESSED_CAPACITY)
    want = run_compressed(copy.deepcopy(problem), precision, "cpu", 2, COMPRESSED_HYPER, torch.bfloat16)
    assert_bitwise_equal(compressed_dict(got), compressed_dict(want))


def apollo_launches(count: int, hyper) -> int:
    """Per table of tensors, one launch per phase, and one more (the combine kernel) after 'reduce'
    and 'moments'."""
    per_table = sum(2 if phase in ("reduce", "moments") else 1
                    for phase in ops.apollo_phases(hyper["weight_decay"], hyper["weight_decay_type"]))
    return per_table * math.ceil(count / APOLLO_CAPACITY)


def check_apollo_against_float64(problem, hyper, param_dtype, got=None):
    got = got or run_apollo(problem, "cuda_emulated", hyper)
    baseline, oracle = run_apollo(problem, "torch", hyper), run_apollo(problem, "torch", hyper, torch.float64)
    assert_op_states_within(got, baseline, oracle, param_dtype)


@pytest.mark.parametrize("rebound,decay_type", [("constant", "L2"), ("belief", "stable")])
@pytest.mark.parametrize("sizes", list(AROUND_A_CHUNK.values())
                         + [many_tensors(c, APOLLO_CAPACITY) for c in table_counts(APOLLO_CAPACITY)],
                         ids=list(AROUND_A_CHUNK) + [f"{c}-tensors" for c in table_counts(APOLLO_CAPACITY)])
def test_apollo_sizes_and_launch_tables_against_float64(emulator, sizes, rebound, decay_type):
    problem = apollo_op_problem(sizes)
    hyper = op_hyper(rebound, decay_type)
    before = emulator.launches()
    got = run_apollo(problem, "cuda_emulated", hyper)
    assert emulator.launches() - before == apollo_launches(sum(1 for s in sizes if math.prod(s)), hyper)
    check_apollo_against_float64(problem, hyper, torch.float32, got)


@pytest.mark.parametrize("rebound,decay_type", [("constant", "L2"), ("belief", "stable")])
def test_apollo_ranges_sharing_stats_across_launch_tables(emulator, rebound, decay_type):
    """One tensor in more ranges than a table holds, all in one call, sharing its stats: each launch's
    combine folds every range of it once, and the launches add up to the whole tensor's sums."""
    ranges, cut = APOLLO_CAPACITY + 2, 701  # odd, so the ranges start at every misalignment
    problem = apollo_op_problem(((ranges * cut,), (CHUNK + 3,)))
    hyper = op_hyper(rebound, decay_type)
    split = copy.deepcopy(problem)
    stats = torch.zeros(2, ops.APOLLO_NUM_STATS, dtype=torch.float64)
    names = ("params", "grads", "exp_avg_grads", "approx_hessians", "updates")
    pieces = {n: [split[n][0][cut * r: cut * (r + 1)] for r in range(ranges)] + [split[n][1]] for n in names}
    owner = [0] * ranges + [1]
    before = emulator.launches()
    for phase in ops.apollo_phases(hyper["weight_decay"], hyper["weight_decay_type"]):
        ops.apollo_step_(*(pieces[n] for n in names), [], [split["steps"][i] for i in owner],
                         [stats[i] for i in owner], [problem["params"][i].numel() for i in owner], phase=phase,
                         backend="cuda_emulated", **hyper)
    assert emulator.launches() - before == apollo_launches(ranges + 1, hyper)
    check_apollo_against_float64(problem, hyper, torch.float32, got=split)


# ---- views at an offset -----------------------------------------------------------------------------------

# Element offsets of (params, grads, states): tests.test_unaligned_views' cases, where params and
# grads share one; a parameter one element and its gradient two elements in, and a gradient alone
# one element in (their misalignments differ: one element at a time throughout, which a head
# computed without the gradient's pointer would miss).
VIEW_OFFSETS = {name: (a, a, b) for name, (a, b) in list(OFFSETS.items())[1:]} | {"param-1-grad-2": (1, 2, 0),
                                                                                 "grad-1": (0, 1, 0)}


def placed(problem: dict, offsets: tuple[int, int, int]) -> dict:
    param, grad, state = offsets
    where = {"params": param, "grads": grad, "steps": 0}
    return {name: [at_offset(t, where.get(name, state)) for t in tensors] for name, tensors in problem.items()}


@pytest.mark.parametrize("offsets", list(VIEW_OFFSETS.values()), ids=list(VIEW_OFFSETS))
@pytest.mark.parametrize("param_dtype,grad_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_adam_views_at_an_offset_equal_the_aligned_host_step(param_dtype, grad_dtype, offsets):
    """No misaligned 16-byte access (the emulator faults on one), nothing written outside a view, and
    the bits of the host kernel on aligned tensors."""
    problem = adam_problem(param_dtype, grad_dtype)
    want = run_adam_views(placed(problem, (0, 0, 0)), "cpu")
    assert_same_view_values(run_adam_views(placed(problem, offsets), "cuda_emulated"), want, f"offsets {offsets}")


@pytest.mark.parametrize("mode", [dict(rebound=r, weight_decay_type=d) for r, d in MODES[:1] + MODES[-1:]],
                         ids=lambda m: f"{m['rebound']}-{m['weight_decay_type']}")
@pytest.mark.parametrize("offsets", list(VIEW_OFFSETS.values()), ids=list(VIEW_OFFSETS))
@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["fp32", "bf16", "fp16-fp32", "fp32-bf16"])
def test_apollo_views_at_an_offset_against_float64(param_dtype, grad_dtype, offsets, mode):
    """Which thread sums which element depends on the vector head, so against the float64 oracle
    (tests.test_apollo's tolerance), not bit for bit."""
    problem = apollo_problem(param_dtype, grad_dtype)
    got = run_apollo_views(placed(problem, offsets), "cuda_emulated", mode)
    assert_pads_untouched(got)
    f64 = {k: [t if k == "steps" else t.double() for t in v] for k, v in problem.items()}
    baseline, oracle = (run_apollo_views(placed(p, (0, 0, 0)), "torch", mode) for p in (problem, f64))
    assert_op_states_within(got, baseline, oracle, param_dtype)
