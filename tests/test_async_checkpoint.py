"""torch.distributed.checkpoint.async_save of streamed states while training goes on, on the
simulated device (fusedoff/testing/simulator.py: the step's copies back to host memory land late,
when the host waits for them).

A streamed state in the optimizer's state dict is a view of host memory that the step's last
copies back still write after ``step()`` returns. ``state_dict()`` waits for them (``opt.state``
does, see fusedoff/optim/state.py), and async_save copies the state dict before it returns
(its default staging) or before ``staging_completion`` (asynchronous staging, which the caller
waits for before the next step, as for any optimizer whose states a step updates in place). The
checkpoint must hold the values at the save, bit for bit: a state dict read before the copies
landed would mix two steps' chunks, and the next steps, run while the upload goes on, must not
reach it. The oracle is the same training on the synchronous host loopback, read at the save.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fusedoff
from fusedoff.offload import runtimes
from fusedoff.testing.simulator import SimulatedRuntime
from tests.helpers import make_params, train

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

SHAPES = [(33, 5), (7,), (300,), (16,)]  # tensors spanning chunks and sharing them
SAVE_AT = 3
PRECISIONS = ("fp32", "bf16", "8bit")


def make(precision: str):
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, lr=1e-2, weight_decay=0.1, offload="stream", chunk_size=32, backend="cpu",
                         state_precision=precision)
    return params, opt


def optim_state_dict(params, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(torch.nn.ParameterList(params), opt)


def late_copies(sims) -> int:
    """Copies the simulated device has queued or not yet landed."""
    return sum(len(t.landings) + sum("copy" in op.what for op in t.queue) for sim in sims for t in sim.timelines)


def seed_with_late_copies(precision: str) -> int:
    """A simulator seed whose interleaving leaves copies back in flight when the save begins (the
    case a state dict read without waiting would get wrong)."""
    for seed in range(100):
        sims = []
        with runtimes.simulate(lambda device: sims.append(SimulatedRuntime(device, seed=seed)) or sims[-1]):
            params, opt = make(precision)
            train(params, opt, range(SAVE_AT))
            if late_copies(sims):
                return seed
    raise AssertionError("no interleaving leaves copies in flight after a step")


def saved_while_training(precision: str, staging: str, folder: str, seed: int) -> None:
    """Trains on the simulated device to SAVE_AT, async-saves, and trains two more steps while the
    checkpoint is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    sims = []

    def factory(device):
        sims.append(SimulatedRuntime(device, seed=seed))
        return sims[-1]

    with runtimes.simulate(factory):
        params, opt = make(precision)
        train(params, opt, range(SAVE_AT))
        assert late_copies(sims)  # copies back in flight: the state dict must wait for them
        state = {"optim": optim_state_dict(params, opt)}
        if staging == "asynchronous":
            stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                  use_async_staging=True, use_non_blocking_copy=False))
            response = dcp.async_save(state, checkpoint_id=folder, async_stager=stager)
            response.staging_completion.result()  # before the next step updates the states in place
            upload = response.upload_completion
        else:
            upload = dcp.async_save(state, checkpoint_id=folder)
        train(params, opt, range(SAVE_AT, SAVE_AT + 2))  # training goes on while the upload runs
        upload.result()
        if staging == "asynchronous":
            stager.close()
    assert sims and all(sim.ops_run > 0 for sim in sims)


def _asynchronous_staging() -> bool:
    """Whether this torch's DCP stages asynchronously on request (StagingOptions.use_async_staging)."""
    try:
        from torch.distributed.checkpoint.staging import StagingOptions
    except ImportError:
        return False
    return "use_async_staging" in getattr(StagingOptions, "__dataclass_fields__", {})


# (DCP warns that it saves and loads in a single process without a process group: as meant)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("staging", ["default", "asynchronous"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_async_save_while_training_writes_the_values_at_the_save(tmp_path, precision, staging):
    import torch.distributed.checkpoint as dcp

    if staging == "asynchronous" and not _asynchronous_staging():
        pytest.skip("this torch's torch.distributed.checkpoint has no asynchronous staging (StagingOptions)")

    saved_while_training(precision, staging, str(tmp_path), seed_with_late_copies(precision))
    params, opt = make(precision)  # the oracle: the host loopback, read at the save
    train(params, opt, range(SAVE_AT))
    want = optim_state_dict(params, opt)["state"]
    fresh_params, fresh = make(precision)
    train(fresh_params, fresh, range(SAVE_AT + 1, SAVE_AT + 3))  # states of other values, to be overwritten
    loaded = {"optim": optim_state_dict(fresh_params, fresh)}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    got = loaded["optim"]["state"]
    assert got.keys() == want.keys()
    for name, states in want.items():
        for key, value in states.items():
            assert torch.equal(got[name][key], value), f"{key} of {name}"
