"""opt.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW, state by state.

fusedoff folds the clip factor into the divisor of the next step's kernels instead of rewriting the
gradients, so the trajectory must be torch's: clipping the gradients, then AdamW. The states are
compared as well as the parameters, after every step: AdamW divides m by sqrt(v), so a clip factor
wrong by a constant on every step scales m and sqrt(v) alike and leaves the parameters almost
unchanged, while exp_avg is off by the factor. Clipping is active on some steps only, and some steps
follow a clipped one without a clip_grad_norm_ call: a factor that outlived its step would scale those.

Bound (the style guide's oracle-relative one): against torch.optim.AdamW with torch's clipping in
float64, fusedoff's fp32 error must be at most twice torch's own fp32 error plus one fp32 ulp of
the largest value compared, for the norm, the parameters, exp_avg and exp_avg_sq. Measured, the
largest over steps and tensors, in every placement and both backends: fusedoff's error uses 13-52%
of that bound (exp_avg 1.5e-7 against torch's 7.4e-8 and an ulp of 1.4e-7, l2). A clip factor 10%
too small measured 560-38000 times the bound (exp_avg 3.0e-3 off), one never reset 25000-2100000
times (exp_avg 0.6 off).
"""

from __future__ import annotations

import pytest
import torch

import fusedoff
from tests.helpers import backend_params, make_params, max_abs_error, ulp_atol

SHAPES = ((5, 7), (33,), (), (1,), (100,), (4, 9))
CHUNK = 32
PLACEMENTS = {
    "resident": dict(offload="none"),
    "streamed": dict(offload="stream", chunk_size=CHUNK),
    # AdamW on fp32 parameters keeps two fp32 states (8 bytes per element): the first tensor's fit.
    "mixed": dict(offload="stream", chunk_size=CHUNK, device_budget=8 * 35 + 4),
}
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
MAX_NORM = 1.0
# Per step: the gradients' scale, and the max_norm passed to clip_grad_norm_ (None: not called).
# The gradient norms are ~7 x scale (l2) and ~2.5 x scale (inf): clipping is active where the
# scale is 1 or more and max_norm is MAX_NORM, inactive (factor 1) where max_norm is large or the
# scale small, and steps 1, 3 and 6 follow a clipped step without a call.
SCHEDULE = ((3.0, MAX_NORM), (2.0, None), (0.05, MAX_NORM), (3.0, None), (1.0, MAX_NORM), (4.0, MAX_NORM),
            (2.0, None), (2.0, 1e3))


def gradients(step: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    scale = SCHEDULE[step][0]
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(device, dtype) for s in SHAPES]


def copy64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64, copy=True)  # a copy even of a float64 tensor


def run(make_opt, clip, dtype: torch.dtype, device: str = "cpu"):
    """Steps the schedule; returns per step (norm or None, params, exp_avg, exp_avg_sq) as float64 copies."""
    params = make_params(SHAPES, dtype, device=device, drawn_as=torch.float64)
    opt = make_opt(params)
    trace = []
    for step, (_, max_norm) in enumerate(SCHEDULE):
        for p, g in zip(params, gradients(step, dtype, device)):
            p.grad = g
        norm = clip(opt, params, max_norm) if max_norm is not None else None
        opt.step()
        states = [opt.state[p] for p in params]
        trace.append((None if norm is None else copy64(norm), [copy64(p) for p in params],
                      [copy64(s["exp_avg"]) for s in states], [copy64(s["exp_avg_sq"]) for s in states]))
    return trace


def torch_run(dtype: torch.dtype, norm_type: float):
    return run(lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER),
               lambda opt, ps, max_norm: torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type), dtype)


def errors(got, want) -> dict[str, float]:
    """The largest error of each quantity over all steps and tensors."""
    out = {"norm": 0.0, "param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for (g_norm, *g_tensors), (w_norm, *w_tensors) in zip(got, want, strict=True):
        assert (g_norm is None) == (w_norm is None)
        if g_norm is not None:
            out["norm"] = max(out["norm"], abs(g_norm.item() - w_norm.item()))
        for key, g, w in zip(("param", "exp_avg", "exp_avg_sq"), g_tensors, w_tensors):
            out[key] = max(out[key], max_abs_error(g, w))
    return out


def largest(trace) -> dict[str, list[torch.Tensor]]:
    """Per quantity, every value it took (for the ulp of the largest)."""
    out = {"norm": [n for n, *_ in trace if n is not None]}
    for i, key in enumerate(("param", "exp_avg", "exp_avg_sq"), start=1):
        out[key] = [t for step in trace for t in step[i]]
    return out


@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "torch")))
def test_clipped_steps_match_torch_state_by_state(backend, device, placement, norm_type):
    oracle = torch_run(torch.float64, norm_type)
    base_err = errors(torch_run(torch.float32, norm_type), oracle)
    got = run(lambda ps: fusedoff.AdamW(ps, backend=backend, **PLACEMENTS[placement], **HYPER),
              lambda opt, ps, max_norm: opt.clip_grad_norm_(max_norm, norm_type), torch.float32, device)
    err = errors(got, oracle)
    values = largest(oracle)
    for key, e in err.items():
        bound = 2 * base_err[key] + ulp_atol(torch.float32, values[key])
        assert e <= bound, f"{key}: error {e:.3e} vs torch's {base_err[key]:.3e} (bound {bound:.3e})"
    # The schedule clips where it says: some steps' factors are below 1, the others exactly 1.
    clipped = [n.item() > max_norm for (n, *_), (_, max_norm) in zip(oracle, SCHEDULE) if n is not None]
    assert any(clipped) and not all(clipped)
