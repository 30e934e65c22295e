"""Views at an offset: tensors that start 2, 4 or 8 bytes past a 16-byte boundary (a view into a flat
buffer, an FSDP2 shard) give the same bits as the same values in fresh, aligned tensors.

The CUDA kernels read and write 16 bytes at a time from a tensor's "vector head", the first element at
which all its pointers are 16-byte aligned, and one element at a time before it, after the last whole
vector, and throughout when the pointers' misalignments differ (csrc/cuda/multi_tensor.cuh): every
offset must update every element exactly once, with the same math as the aligned path. The host kernels
have no aligned path (their SIMD loads take any address); they are held to the same bits here.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedoff import ops
from tests.helpers import max_abs_error, relative_l2_error, ulp_atol

CHUNK = 16384  # the CUDA kernels' elements per block (kChunkElements)
SIZES = (5, 13, 2 * CHUNK + 37)  # shorter than a vector head, a few vectors, three blocks with a tail
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_PAIRS = list(itertools.product(DTYPES, DTYPES))  # (param, grad)
ADAM_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True,
                  amsgrad=True, maximize=False)
APOLLO_MODES = [dict(rebound="constant", weight_decay_type="L2"), dict(rebound="belief", weight_decay_type="stable")]
# Element offsets of the views: (params and grads, states). The same offset for all is the case the vector
# head serves (2-byte types 2, 4 or 8 bytes off, fp32 4 or 8); differing offsets stay one element at a time.
OFFSETS = {"aligned": (0, 0), "shared-1": (1, 1), "shared-2": (2, 2), "shared-3": (3, 3), "shared-4": (4, 4),
           "param-1-states-0": (1, 0), "param-0-states-2": (0, 2)}


def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of `t` as a view `offset` elements into a fresh (16-byte aligned) buffer."""
    buffer = torch.full((t.numel() + offset + 8,), float("nan"), dtype=t.dtype, device=t.device)
    view = buffer[offset:offset + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 == (offset * t.element_size()) % 16
    return view


def problem(param_dtype, grad_dtype, states, seed=0):
    """Params (with fp32 masters for low-precision ones), grads, step counts, and the optimizer's
    states: `states` maps each name to (torch.randn or torch.rand, scale)."""
    gen = torch.Generator().manual_seed(seed)
    p32 = [torch.randn(n, generator=gen) for n in SIZES]
    out = {
        "params": [p.to(param_dtype) for p in p32],
        "grads": [(torch.randn(n, generator=gen) * 0.1).to(grad_dtype) for n in SIZES],
    }
    out |= {name: [make(n, generator=gen) * scale for n in SIZES] for name, (make, scale) in states.items()}
    out["master_params"] = [p.clone() for p in p32] if param_dtype != torch.float32 else []
    out["steps"] = [torch.full((), 3.0) for _ in SIZES]
    return out


def adam_problem(param_dtype, grad_dtype, seed=0):
    return problem(param_dtype, grad_dtype, {"exp_avgs": (torch.randn, 1e-2), "exp_avg_sqs": (torch.rand, 1e-3),
                                             "max_exp_avg_sqs": (torch.rand, 1e-3)}, seed)


def placed(problem: dict, device: str, offsets: tuple[int, int]) -> dict:
    """The problem's tensors on `device`, params and grads at the first offset, states at the second."""
    param_offset, state_offset = offsets
    out = {}
    for name, tensors in problem.items():
        offset = 0 if name == "steps" else param_offset if name in ("params", "grads") else state_offset
        out[name] = [at_offset(t.to(device), offset) for t in tensors]
    return out


def run_adam(tensors: dict, backend: str) -> dict:
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params", "steps")
    ops.adam_step_(*(tensors[n] for n in names), backend=backend, **ADAM_HYPER)
    return tensors


def apollo_problem(param_dtype, grad_dtype, seed=0):
    return problem(param_dtype, grad_dtype, {"exp_avg_grads": (torch.randn, 1e-2),
                                             "approx_hessians": (torch.rand, 1e-2), "updates": (torch.randn, 1e-3)}, seed)


def run_apollo(tensors: dict, backend: str, mode: dict) -> dict:
    names = ("params", "grads", "exp_avg_grads", "approx_hessians", "updates", "master_params", "steps")
    ops.apollo_whole_step_(*(tensors[n] for n in names), backend=backend, lr=1e-2, base_lr=1e-2, init_lr=1e-3,
                           warmup=2, beta=0.9, eps=1e-4, weight_decay=1e-2, **mode)
    return tensors


def assert_pads_untouched(tensors: dict) -> None:
    """Nothing written outside a view: the NaN around each one in its buffer is still there."""
    for name, views in tensors.items():
        for i, view in enumerate(views):
            if view._base is None:
                continue
            begin = view.storage_offset()
            pad = torch.cat([view._base[:begin], view._base[begin + view.numel():]])
            assert pad.isnan().all(), f"{name}[{i}]: written outside the view"


def assert_same_values(got: dict, want: dict, what: str) -> None:
    assert_pads_untouched(got)
    for name, tensors in want.items():
        for i, (g, w) in enumerate(zip(got[name], tensors, strict=True)):
            differ = (g.cpu() != w.cpu()) & ~(g.cpu().isnan() & w.cpu().isnan())
            assert not differ.any(), f"{what}: {name}[{i}] ({w.numel()} elements) differs in {int(differ.sum())}"


# ---- the host kernels ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("offsets", list(OFFSETS.values())[1:], ids=list(OFFSETS)[1:])
@pytest.mark.parametrize("param_dtype,grad_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_cpu_adam_views_at_an_offset_equal_aligned(param_dtype, grad_dtype, offsets):
    problem = adam_problem(param_dtype, grad_dtype)
    want = run_adam(placed(problem, "cpu", (0, 0)), "cpu")
    assert_same_values(run_adam(placed(problem, "cpu", offsets), "cpu"), want, f"cpu at offsets {offsets}")


@pytest.mark.parametrize("mode", APOLLO_MODES, ids=lambda m: f"{m['rebound']}-{m['weight_decay_type']}")
@pytest.mark.parametrize("offsets", list(OFFSETS.values())[1:], ids=list(OFFSETS)[1:])
@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float16, torch.float32)], ids=["fp32", "bf16", "fp16-fp32"])
def test_cpu_apollo_views_at_an_offset_equal_aligned(param_dtype, grad_dtype, offsets, mode):
    problem = apollo_problem(param_dtype, grad_dtype)
    want = run_apollo(placed(problem, "cpu", (0, 0)), "cpu", mode)
    assert_same_values(run_apollo(placed(problem, "cpu", offsets), "cpu", mode), want, f"cpu at offsets {offsets}")


# ---- the device kernels (GPU suite) -------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("offsets", list(OFFSETS.values())[1:], ids=list(OFFSETS)[1:])
@pytest.mark.parametrize("param_dtype,grad_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_cuda_adam_views_at_an_offset(param_dtype, grad_dtype, offsets):
    """Bit for bit the aligned CUDA step (the same math, every element once) and, to one ulp of the
    stored dtype, the host kernel (the two compilers may contract a*b + c*d into different FMAs)."""
    problem = adam_problem(param_dtype, grad_dtype)
    aligned = run_adam(placed(problem, "cuda", (0, 0)), "cuda")
    got = run_adam(placed(problem, "cuda", offsets), "cuda")
    assert_same_values(got, aligned, f"cuda at offsets {offsets} vs aligned")
    host = run_adam(placed(problem, "cpu", (0, 0)), "cpu")
    for name, tensors in host.items():
        if tensors and name != "grads":
            dtype = param_dtype if name == "params" else torch.float32
            assert max_abs_error(got[name], tensors) <= ulp_atol(dtype, tensors), name


@pytest.mark.cuda
@pytest.mark.parametrize("mode", APOLLO_MODES, ids=lambda m: f"{m['rebound']}-{m['weight_decay_type']}")
@pytest.mark.parametrize("offsets", list(OFFSETS.values())[1:], ids=list(OFFSETS)[1:])
@pytest.mark.parametrize("param_dtype,grad_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_cuda_apollo_views_at_an_offset(param_dtype, grad_dtype, offsets, mode):
    """Apollo's sums run in an order that depends on which elements each thread takes, so a view at an
    offset agrees with the aligned step and the host kernel to rounding (as streamed and resident runs
    do in test_offload.py)."""
    problem = apollo_problem(param_dtype, grad_dtype)
    aligned = run_apollo(placed(problem, "cuda", (0, 0)), "cuda", mode)
    got = run_apollo(placed(problem, "cuda", offsets), "cuda", mode)
    host = run_apollo(placed(problem, "cpu", (0, 0)), "cpu", mode)
    assert_pads_untouched(got)
    for name in ("params", "exp_avg_grads", "approx_hessians", "updates", "master_params"):
        bound = max(1e-5, torch.finfo(param_dtype).eps) if name == "params" else 1e-5
        for i, (g, a, h) in enumerate(zip(got[name], aligned[name], host[name], strict=True)):
            g, a = g.cpu().float(), a.cpu().float()
            assert relative_l2_error([g], [a]) <= bound, f"{name}[{i}] vs aligned"
            assert relative_l2_error([g], [h.float()]) <= bound, f"{name}[{i}] vs the host kernel"
