"""fusedoff under DDP with ZeRO-1 (torch.distributed.optim.ZeroRedundancyOptimizer): two CPU
processes with the gloo backend, against one process.

ZeRO gives each rank whole tensors to update and broadcasts them after the step; the gradients
here are the same on both ranks (what DDP's all-reduce makes them, here without its rounding), so
the run must equal one fusedoff.AdamW over every tensor bit for bit, in every state precision and
placement; and the consolidated state dict must load into a plain fusedoff.AdamW that continues as
the uninterrupted run does.

Every scenario runs in one spawn of two processes.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import fusedoff
from tests.helpers import make_params, spawn_ranks, train

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

WORLD = 2
STEPS = 4
CONSOLIDATE_AT = 2
SHAPES = [(20, 40), (20,), (300,), (3, 40), (7,), (513,)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, backend="cpu")
PLACEMENTS = {
    "none": dict(offload="none"),
    "stream": dict(offload="stream", chunk_size=256),
    "mixed": dict(offload="stream", chunk_size=256, device_budget=3000),
}
CASES = [(precision, placement) for precision in ("fp32", "bf16", "8bit") for placement in PLACEMENTS]


def wide_grads(params, step: int) -> None:
    """Gradients of magnitudes over 2^8 within a tensor, from a generator seeded 100 + step."""
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * torch.exp2(torch.randint(-8, 1, p.shape, generator=gen))


def options(precision: str, placement: str) -> dict:
    return dict(HYPER, state_precision=precision, **PLACEMENTS[placement])


def single_run(precision: str, placement: str, steps: int = STEPS) -> list[torch.Tensor]:
    params = make_params(SHAPES)
    train(params, fusedoff.AdamW(params, **options(precision, placement)), range(steps), wide_grads)
    return [p.detach().clone() for p in params]


# ---- the two processes ----------------------------------------------------------------------------
def _worker(rank: int, port: int, folder: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {}
        for precision, placement in CASES:
            params = make_params(SHAPES)
            opt = ZeroRedundancyOptimizer(params, optimizer_class=fusedoff.AdamW, **options(precision, placement))
            train(params, opt, range(CONSOLIDATE_AT), wide_grads)
            opt.consolidate_state_dict(to=0)
            # (a copy, as torch.save would make: rank 0's own states in it are its live tensors)
            consolidated = copy.deepcopy(opt.state_dict()) if rank == 0 else None
            at_consolidation = [p.detach().clone() for p in params]
            train(params, opt, range(CONSOLIDATE_AT, STEPS), wide_grads)
            results[precision, placement] = {
                "params": [p.detach().clone() for p in params],
                "owned": len(opt.optim.param_groups[0]["params"]),
                "consolidated": consolidated,
                "at consolidation": at_consolidation,
            }
        if rank == 0:
            torch.save(results, os.path.join(folder, "results.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    return spawn_ranks(_worker, WORLD)


@pytest.mark.parametrize("precision,placement", CASES)
def test_zero_redundancy_equals_one_process(runs, precision, placement):
    got = runs[precision, placement]
    assert 0 < got["owned"] < len(SHAPES)  # each rank updates part of the tensors
    for t, (a, b) in enumerate(zip(got["params"], single_run(precision, placement))):
        assert torch.equal(a, b), f"tensor {t} {SHAPES[t]}"


@pytest.mark.parametrize("precision,placement", CASES)
def test_a_consolidated_state_dict_loads_into_a_plain_optimizer(runs, precision, placement):
    got = runs[precision, placement]
    params = [torch.nn.Parameter(p.clone()) for p in got["at consolidation"]]
    opt = fusedoff.AdamW(params, **options(precision, placement))
    opt.load_state_dict(got["consolidated"])
    train(params, opt, range(CONSOLIDATE_AT, STEPS), wide_grads)
    for t, (a, b) in enumerate(zip(params, single_run(precision, placement))):
        assert torch.equal(a.detach(), b), f"tensor {t} {SHAPES[t]}"
