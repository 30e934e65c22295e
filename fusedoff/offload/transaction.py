"""A step is a transaction: everything that can fail comes before the first change, and the changes
are queued with interrupts held.

[note: the step as a transaction]
A step first does everything that can fail on the host without changing a value: checks, placement
(stores, pinning), adoption of ``opt.state``, the streaming buffers, the statistics and the step
counts' increments (every allocation). A failure there (most often ``torch.OutOfMemoryError`` at a
first streamed step) leaves the optimizer and the parameters as they were before the step, and the
same ``step()`` can be retried: the states a failed step had given to new tensors are taken back.
Then come the changes: the step counts, the kernels, the copies back. They are queued with SIGINT
held (`interrupts_held`): a Ctrl-C that arrives meanwhile is raised right after the step, which is
then whole, so a checkpoint saved by the interrupt handler (as Lightning and the Hugging Face
Trainer save one) never holds half a step. A failure among the changes themselves (a device error,
which a real device leaves sticky anyway) cannot be undone: it raises `StepIncompleteError`, and so
does every later step, until a checkpoint is loaded into the optimizer (``load_state_dict``).
"""

from __future__ import annotations

import contextlib
import signal
import threading


class StepIncompleteError(RuntimeError):
    """A step failed after it had started changing parameters and states: the optimizer and its
    parameters are no longer consistent (see [note: the step as a transaction])."""


def incomplete_message(error: BaseException) -> str:
    return (f"fusedoff: the optimizer step failed after it had started changing parameters and states "
            f"({type(error).__name__}: {error}); the optimizer and its parameters are no longer consistent. "
            "Load a checkpoint (the model's and the optimizer's load_state_dict) before stepping again")


@contextlib.contextmanager
def interrupts_held():
    """Within the block, a SIGINT is held back and delivered right after it, to whatever handler
    was in force (Python's KeyboardInterrupt by default). Only the main thread of the main
    interpreter receives signals in Python: elsewhere the block holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        # (None: a handler not installed from Python, which cannot be put back; the default's is the nearest)
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        if received:
            signal.raise_signal(signal.SIGINT)  # handled by `previous`, as if it had just arrived
