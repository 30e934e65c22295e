"""A checkpoint saved mid-run and loaded into a fresh optimizer continues exactly as the run that
never stopped: parameters, every state, master weights and step counts, bit for bit.

Resident, streamed and mixed placements run the same kernels on the same values (the offload tests
require streamed == resident to the bit), and loading moves values without arithmetic, so nothing
but equality is right here. A loader that dropped or rounded the fp32 master weights of bf16
parameters would restart them from the bf16 parameters: half a bf16 ulp of difference at once,
which these tests see in the loaded state and in every later step.
"""

from __future__ import annotations

import io

import pytest
import torch

import fusedoff
from tests.helpers import make_params, train

CHUNK = 32  # elements: the larger tensors below span several chunks
# (shape, dtype) per parameter of each group: bf16 parameters (fp32 masters) and fp32 ones in the
# same groups (two buckets per group), a 0-d tensor, one element, sizes that are not multiples of
# the chunk.
GROUPS = (
    [((5, 7), torch.bfloat16), ((33,), torch.float32), ((), torch.bfloat16), ((1,), torch.bfloat16)],
    [((100,), torch.bfloat16), ((4, 9), torch.float32)],
)
# Bytes of state the mixed placement keeps on the device: the first bucket to step (group 0's bf16
# parameters, four fp32 states each with AdamW(amsgrad) or Apollo and masters: 16 bytes per
# element) holds its 35-element tensor resident, the rest stream; test_mixed_placement_is_mixed
# checks that it is.
MIXED_BUDGET = 16 * 35 + 8
PLACEMENTS = {
    "resident": dict(offload="none"),
    "streamed": dict(offload="stream", chunk_size=CHUNK),
    "mixed": dict(offload="stream", chunk_size=CHUNK, device_budget=MIXED_BUDGET),
}
OPTIMIZERS = {
    "AdamW-amsgrad": lambda groups, **kw: fusedoff.AdamW(groups, lr=1e-2, weight_decay=0.1, amsgrad=True, **kw),
    "Apollo": lambda groups, **kw: fusedoff.Apollo(groups, lr=1e-2, warmup=2, rebound="belief",
                                                   weight_decay=0.01, weight_decay_type="stable", **kw),
}


def grouped_params(device: str, seed: int = 0) -> list[list[torch.nn.Parameter]]:
    """The parameters of GROUPS, one list per group."""
    flat = iter(make_params([shape for group in GROUPS for shape, _ in group],
                            [dtype for group in GROUPS for _, dtype in group], seed=seed, device=device))
    return [[next(flat) for _ in group] for group in GROUPS]


def param_groups(params: list[list[torch.nn.Parameter]]) -> list[dict]:
    return [{"params": params[0]}, {"params": params[1], "lr": 3e-3}]


def set_grads(params: list[list[torch.nn.Parameter]], step: int) -> None:
    """Gradients that depend on the parameters (as a loss's would) and on the step."""
    gen = torch.Generator().manual_seed(100 + step)
    for group in params:
        for p in group:
            noise = torch.randn(p.shape, generator=gen).to(p.device)
            p.grad = (torch.sin(p.detach().float() * (step + 1)) * 0.1 + noise * 0.05).to(p.dtype)


def save(params, opt) -> bytes:
    """A checkpoint as a training loop writes one: model and optimizer through torch.save."""
    buffer = io.BytesIO()
    torch.save({"params": [[p.detach() for p in g] for g in params], "optimizer": opt.state_dict()}, buffer)
    return buffer.getvalue()


def load(blob: bytes, make_opt, placement: dict, device: str):
    checkpoint = torch.load(io.BytesIO(blob), weights_only=True)
    params = grouped_params(device, seed=1)  # other values: everything must come from the checkpoint
    with torch.no_grad():
        for group, saved in zip(params, checkpoint["params"]):
            for p, value in zip(group, saved):
                p.copy_(value)
    opt = make_opt(param_groups(params), **placement)
    opt.load_state_dict(checkpoint["optimizer"])
    return params, opt


def all_states(params, opt) -> dict:
    """Every state of every parameter (opt.state, whatever the placement), as host copies."""
    out = {}
    for g, group in enumerate(params):
        for i, p in enumerate(group):
            state = opt.state[p]
            out[g, i] = {k: torch.as_tensor(v).detach().clone() for k, v in state.items()}
    return out


def assert_identical(got_params, got_opt, want_params, want_opt, when: str) -> None:
    for group_got, group_want in zip(got_params, want_params):
        for a, b in zip(group_got, group_want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{when}: a parameter differs"
    got, want = all_states(got_params, got_opt), all_states(want_params, want_opt)
    assert got.keys() == want.keys()
    for key, states in want.items():
        assert set(got[key]) == set(states), f"{when}: parameter {key} has states {set(got[key])}"
        for name, value in states.items():
            other = got[key][name]
            diff = (other.double() - value.double()).abs().max().item() if value.numel() else 0.0
            assert other.dtype == value.dtype and torch.equal(other, value), \
                f"{when}: {name} of parameter {key} differs by up to {diff:.3g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("saved_in,loaded_in", [
    ("resident", "resident"), ("streamed", "streamed"), ("mixed", "mixed"),
    ("streamed", "resident"), ("resident", "mixed"), ("mixed", "streamed"),
])
def test_resumed_run_equals_the_uninterrupted_one(name, saved_in, loaded_in, device):
    make_opt = OPTIMIZERS[name]
    params = grouped_params(device)
    opt = make_opt(param_groups(params), **PLACEMENTS[saved_in])
    train(params, opt, range(4), set_grads)
    blob = save(params, opt)
    train(params, opt, range(4, 8), set_grads)  # the run that never stopped

    resumed_params, resumed = load(blob, make_opt, PLACEMENTS[loaded_in], device)
    # What was saved is what is loaded (masters included), before any step...
    reference_params = grouped_params(device)
    reference = make_opt(param_groups(reference_params), **PLACEMENTS[saved_in])
    train(reference_params, reference, range(4), set_grads)
    assert_identical(resumed_params, resumed, reference_params, reference, "after loading")
    # ... and the resumed run continues as the uninterrupted one.
    train(resumed_params, resumed, range(4, 8), set_grads)
    assert_identical(resumed_params, resumed, params, opt, "after resuming")
    masters = [s for s in all_states(params, opt).values() if "master_param" in s]
    assert len(masters) == 4  # every bf16 parameter has fp32 masters: the comparison covered them


def test_mixed_placement_is_mixed():
    """The mixed placement above keeps some states on the device and streams the others."""
    params = grouped_params("cpu")
    opt = OPTIMIZERS["AdamW-amsgrad"](param_groups(params), **PLACEMENTS["mixed"])
    train(params, opt, range(1), set_grads)
    stats = opt.memory_stats()
    assert stats["resident_bytes"] == 16 * 35  # four fp32 states of the 35-element tensor
    assert stats["streamed_bytes"] > 0
