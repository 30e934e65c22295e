"""A step is all or nothing under faults (see [note: the step as a transaction] in
fusedoff/offload/transaction.py).

A fault is injected through the runtime seam (tests/faults.py) at every operation index of a step,
both kinds (the error the real runtime raises there, and a SIGINT), at the first step (placement,
pinning, buffers) and at a later one, for AdamW in every state and master precision and for Apollo,
resident, streamed, mixed, on the simulated device, with the step overlapping the next forward and
with a host share (host-computed tensors beside streamed ones, simulated).

The oracle is the same run without a fault: after an error the optimizer and the parameters equal
their state before the step bit for bit and the retried step equals the unfaulted step bit for bit;
after a SIGINT the step is either not begun (as after an error) or whole (equal to the unfaulted
step), and KeyboardInterrupt is raised either way. An error among the step's changes cannot be
undone: it must raise StepIncompleteError, every later step too, until a checkpoint is loaded, from
which the run continues as the unfaulted one.
"""

from __future__ import annotations

import copy
import os
import signal
from collections import Counter

import pytest
import torch

import fusedoff
from fusedoff.offload import runtimes
from fusedoff.offload.runtime import HostRuntime
from fusedoff.testing.simulator import SimulatedRuntime
from tests.faults import Faults, FaultyRuntime, InjectedError, InjectedOutOfMemory
from tests.helpers import ParameterListModel, bits

# 300 elements cross an 8-bit block (256); a 0-d tensor; sizes that are no multiple of a chunk.
SHAPES = ((20, 15), (33,), (5, 33), ())
STEPS = 3
PLACEMENTS = ("resident", "streamed", "mixed", "simulated", "overlap", "simulated-host-share")

OPTIMIZERS = [pytest.param("AdamW", torch.float32, precision, "fp32", id=f"AdamW-fp32-{precision}")
              for precision in ("fp32", "bf16", "8bit")]
OPTIMIZERS += [pytest.param("AdamW", torch.bfloat16, precision, master, id=f"AdamW-bf16-{precision}-{master}")
               for precision in ("fp32", "bf16", "8bit") for master in ("fp32", "split", "split8")]
OPTIMIZERS += [pytest.param("Apollo", dtype, "fp32", "fp32", id=f"Apollo-{str(dtype)[6:]}")
               for dtype in (torch.float32, torch.bfloat16)]


class Run:
    """One model and optimizer, with the fault runtime (`faults`) on every device they use."""

    def __init__(self, optimizer, dtype, state_precision, master_precision, placement):
        self.config = (optimizer, dtype, state_precision, master_precision, placement)
        self.faults = Faults()
        self.runtimes = []
        self.placement = placement
        self.model = ParameterListModel(SHAPES, dtype)
        params = list(self.model.parameters())
        if placement == "resident":
            where = dict(offload="none")
        elif placement == "mixed":  # greedily in order: (33,) and () resident, the others streamed
            where = dict(offload="stream", chunk_size=256, device_budget=600)
        elif placement == "simulated-host-share":  # (20, 15) and (33,) host-computed, the others streamed (simulated)
            where = dict(offload="stream", chunk_size=256, host_share=0.7)
        else:
            where = dict(offload="stream", chunk_size=256)
        if optimizer == "Apollo":
            self.opt = fusedoff.Apollo(params, lr=1e-2, warmup=2, backend="cpu", **where)
        else:
            extra = dict(master_precision=master_precision) if dtype == torch.bfloat16 else {}
            self.opt = fusedoff.AdamW(params, lr=1e-2, weight_decay=0.1, backend="cpu",
                                      state_precision=state_precision, **extra, **where)
        self.handle = None
        if placement == "overlap":
            with self._runtime():
                self.handle = self.opt.overlap_with(self.model)
        self.steps = 0

    def _runtime(self):
        simulated = self.placement in ("simulated", "overlap", "simulated-host-share")

        def factory(device):
            inner = SimulatedRuntime(device, seed=11) if simulated else HostRuntime(device)
            self.runtimes.append(FaultyRuntime(inner, self.faults))
            return self.runtimes[-1]

        return runtimes.simulate(factory)

    def step(self, fault_at: int | None = None, kind: str = "error", *, clip: float | None = None,
             retry: bool = False) -> None:
        """One step with this step's gradients (`retry`: the ones in place, as a retried ``step()``
        finds them), clipped to `clip` first, `fault_at` (None: no fault) armed during the step."""
        if retry:
            self.steps -= 1
        else:
            generator = torch.Generator().manual_seed(100 + self.steps)
            for p in self.model.parameters():
                p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        if clip is not None:
            self.opt.clip_grad_norm_(clip)
        self.faults.arm(fault_at, kind)
        try:
            with self._runtime():
                self.opt.step()
        finally:
            self.faults.disarm()
            self.steps += 1

    def settle(self) -> None:
        """Every queued chunk done (the overlapped step's and the simulator's side streams)."""
        if self.handle is not None:
            self.handle.wait()
        for rt in self.runtimes:
            rt.drain()

    def snapshot(self) -> tuple[list[torch.Tensor], dict]:
        self.settle()
        params = [p.detach().clone() for p in self.model.parameters()]
        state = {pid: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for pid, s in self.opt.state_dict()["state"].items()}
        return params, state


def same(a, b) -> bool:
    (params_a, state_a), (params_b, state_b) = a, b
    if len(params_a) != len(params_b) or not all(torch.equal(bits(x), bits(y)) for x, y in zip(params_a, params_b)):
        return False
    if state_a.keys() != state_b.keys():
        return False
    for pid in state_a:
        if state_a[pid].keys() != state_b[pid].keys():
            return False
        for key, value in state_a[pid].items():
            other = state_b[pid][key]
            if isinstance(value, torch.Tensor):
                if value.dtype != other.dtype or not torch.equal(bits(value), bits(other)):
                    return False
            elif value != other:
                return False
    return True


@pytest.mark.exhaustive
@pytest.mark.skipif(os.name != "posix", reason="SIGINT is raised with signal.raise_signal on POSIX")
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("optimizer,dtype,state_precision,master_precision", OPTIMIZERS)
def test_a_fault_at_every_operation_of_a_step_leaves_it_undone_or_whole(optimizer, dtype, state_precision,
                                                                        master_precision, placement):
    config = (optimizer, dtype, state_precision, master_precision, placement)
    clean = Run(*config)
    want, operations = [clean.snapshot()], []
    for _ in range(STEPS):
        clean.step(fault_at=None)
        operations.append(clean.faults.count)
        want.append(clean.snapshot())
    assert all(operations), f"steps with no runtime operation to fail: {operations}"

    outcomes = Counter()
    for fault_step in (0, 1):  # the first step (placement, pinning, buffers), and a later one
        for kind in ("error", "interrupt"):
            for fault_at in range(operations[fault_step]):
                run = Run(*config)
                for _ in range(fault_step):
                    run.step()
                where = f"{kind} at operation {fault_at} of step {fault_step + 1}"
                try:
                    run.step(fault_at, kind)
                except fusedoff.StepIncompleteError as error:
                    assert kind == "error" and isinstance(error.__cause__, InjectedError), where
                    assert run.faults.operations[fault_at] != "empty", f"{where}: an allocation among the changes"
                    outcomes["incomplete"] += 1
                    check_incomplete_then_reload(run, want, fault_step, where)
                    continue
                except KeyboardInterrupt:
                    assert kind == "interrupt", where
                    now = run.snapshot()
                    if same(now, want[fault_step + 1]):
                        outcomes["interrupt after a whole step"] += 1
                        continue
                    assert same(now, want[fault_step]), f"{where}: neither undone nor whole"
                    outcomes["interrupt before any change"] += 1
                except (InjectedError, InjectedOutOfMemory) as error:
                    assert kind == "error" and error is run.faults.injected, where
                    assert same(run.snapshot(), want[fault_step]), f"{where}: the failed step changed something"
                    outcomes[f"{type(error).__name__} before any change"] += 1
                else:
                    pytest.fail(f"{where}: the step neither failed nor was interrupted")
                run.steps -= 1  # the retry, with the same gradients
                run.step()
                assert same(run.snapshot(), want[fault_step + 1]), f"{where}: the retried step differs"
                run.step()
                assert same(run.snapshot(), want[fault_step + 2]), f"{where}: the step after the retry differs"
    print(f"\n{config}: operations per step {operations}; outcomes {dict(outcomes)}")
    assert sum(outcomes.values()) == 2 * (operations[0] + operations[1])


def check_incomplete_then_reload(run: Run, want: list, fault_step: int, where: str) -> None:
    """After StepIncompleteError: every step raises it, and so do state_dict() and a copy (they would
    hold half a step), until the model and the optimizer are loaded from the checkpoint before the
    failed step, whence the run equals the unfaulted one."""
    run.steps -= 1
    with pytest.raises(fusedoff.StepIncompleteError):
        run.step()
    run.steps -= 1
    run.settle()
    for save in (run.opt.state_dict, lambda: copy.deepcopy(run.opt)):  # half a step is never saved or copied
        with pytest.raises(fusedoff.StepIncompleteError):
            save()
    params, state = want[fault_step]
    with torch.no_grad():
        for p, value in zip(run.model.parameters(), params):
            p.copy_(value)
    saved = Run(*run.config).opt.state_dict()  # (the groups)
    saved["state"] = {pid: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for pid, s in state.items()}
    run.opt.load_state_dict(saved)
    run.step()
    assert same(run.snapshot(), want[fault_step + 1]), f"{where}: the run reloaded after the failure differs"


def test_a_sigint_during_the_changes_is_raised_after_the_step_to_the_handler_in_force():
    """The handler the user installed receives the held SIGINT once, after the step is whole."""
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        faulted, clean = Run("AdamW", torch.float32, "fp32", "fp32", "streamed"), \
            Run("AdamW", torch.float32, "fp32", "fp32", "streamed")
        clean.step()
        faulted.step()
        clean.step()
        operations = clean.faults.count
        faulted.step(fault_at=operations - 1, kind="interrupt")  # the last operation: among the changes
        assert received == [signal.SIGINT]
        assert same(faulted.snapshot(), clean.snapshot())
    finally:
        signal.signal(signal.SIGINT, previous)


def first_operation(run: Run, what: str, step: int = 0) -> int:
    """The index of the first operation `what` in step `step` of an unfaulted run like `run`."""
    clean = Run(*run.config)
    for _ in range(step + 1):
        clean.step()
    return clean.faults.operations.index(what)


@pytest.mark.parametrize("placement", ("streamed", "simulated"))
def test_an_out_of_memory_at_the_first_streamed_step_changes_nothing_and_its_retry_is_a_first_step(placement):
    """The issue's finding 1: the buffers' allocation fails at the first step; no step count may
    read 1, and the retry (the user's, or a tool's on OOM) equals a clean first step."""
    config = ("AdamW", torch.float32, "fp32", "fp32", placement)
    clean, run = Run(*config), Run(*config)
    clean.step()
    with pytest.raises(torch.OutOfMemoryError):
        run.step(fault_at=first_operation(run, "empty"))
    assert len(run.opt.state) == 0
    run.steps -= 1
    run.step()
    assert same(run.snapshot(), clean.snapshot())


@pytest.mark.parametrize("placement", ("streamed", "simulated", "overlap"))
def test_an_interrupt_between_chunks_is_raised_after_the_whole_step(placement):
    """The issue's finding 2: a Ctrl-C while the chunks are queued never leaves half a step (a
    checkpoint saved by the interrupt handler would hold it)."""
    config = ("AdamW", torch.float32, "fp32", "fp32", placement)
    clean, run = Run(*config), Run(*config)
    for r in (clean, run):
        r.step()
    clean.step()
    copies = [k for k, what in enumerate(clean.faults.operations) if what == "copy"]
    with pytest.raises(KeyboardInterrupt):
        run.step(fault_at=copies[len(copies) // 2], kind="interrupt")
    assert same(run.snapshot(), clean.snapshot())


def test_a_step_in_another_thread_holds_no_signal_and_equals_the_main_threads():
    """Python delivers signals to the main thread only: a step in another thread (a data-loading
    or trainer thread) installs no handler, which would raise there, and steps as in the main one."""
    import threading

    config = ("AdamW", torch.float32, "fp32", "fp32", "streamed")
    main, other = Run(*config), Run(*config)
    main.step()
    errors = []
    thread = threading.Thread(target=_record, args=(errors, other.step))
    thread.start()
    thread.join()
    assert errors == [] and same(other.snapshot(), main.snapshot())


def _record(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as error:  # (reported by the test in the main thread)
        errors.append(error)


@pytest.mark.parametrize("placement", ("streamed", "simulated"))
def test_a_clip_factor_outlives_a_step_that_failed_before_any_change_and_is_spent_by_a_whole_one(placement):
    """clip_grad_norm_ folds its factor into the next step: a retried ``step()`` after a failure that
    changed nothing still applies it, and a step made whole before a held interrupt has spent it."""
    config = ("AdamW", torch.float32, "fp32", "fp32", placement)
    clean, run = Run(*config), Run(*config)
    clean.step(clip=0.1)
    with pytest.raises(torch.OutOfMemoryError):
        run.step(fault_at=first_operation(run, "empty"), clip=0.1)
    run.step(retry=True)
    assert same(run.snapshot(), clean.snapshot())
    clean.step(clip=0.1)
    with pytest.raises(KeyboardInterrupt):  # the last operation: among the changes
        run.step(fault_at=first_operation_count(run) - 1, kind="interrupt", clip=0.1)
    assert same(run.snapshot(), clean.snapshot())
    clean.step()
    run.step()
    assert same(run.snapshot(), clean.snapshot())


def first_operation_count(run: Run) -> int:
    """The operations of a later step of an unfaulted run like `run`."""
    clean = Run(*run.config)
    clean.step()
    clean.step()
    return clean.faults.count
