"""Overlapping the streamed step with the next forward: ``handle = opt.overlap_with(model)``.

[note: overlap with the next forward] A plain step ends with the main stream waiting for every
streamed chunk, so the next forward starts after the last one. With `overlap_with`, the step ends
without that wait: each chunk's computation records an event, the chunks run in the order the
forward reads their parameters (`model.parameters()`'s order unless given), and a forward
pre-hook on every module that owns parameters of the optimizer makes the main stream wait for
the chunks holding that module's own parameters only (with those of its ``nn.ParameterList`` and
``nn.ParameterDict`` children, which are never called), just before its forward. Nothing waits on
the host. What the main stream could otherwise touch too early is ordered too: the next step and
``zero_grad(set_to_none=False)`` (which zeroes gradients in place) first wait for every chunk, the
gradients and per-step statistics the chunks read are kept alive for them (the allocator does not
hand their memory out again before the chunks ran), ``model.state_dict()`` waits for every chunk
(a checkpoint saved right after a step sees it), and ``opt.state`` waits for the copies back as
always. Results are those of the plain step, bit for bit: the same kernels on the same data.

A parameter the main stream reads outside its own module's forward (used by a parent module
directly, or read by user code between the step and the next forward) is not covered by a hook:
call ``handle.wait()`` before such a read, which makes the main stream wait for the whole step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


# Modules that hold parameters for the module around them and are never called themselves.
_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


class OverlapHandle:
    """The hooks `overlap_with` registered. ``remove()`` takes them away (steps join again);
    ``wait()`` makes the current stream wait for the whole last step."""

    def __init__(self, optimizer, handles: list) -> None:
        self._optimizer = optimizer
        self._handles = handles

    def wait(self) -> None:
        self._optimizer._engine.join()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._optimizer._engine.overlap(None)


def overlap_with(optimizer, model: nn.Module, order: Iterable[torch.Tensor] | None = None) -> OverlapHandle:
    """Registers the forward pre-hooks of [note: overlap with the next forward] on `model`'s
    modules; `order`: the parameters in the order the forward first uses them (default:
    ``model.parameters()``)."""
    if getattr(optimizer, "_overlap_handle", None) is not None and optimizer._overlap_handle._handles:
        raise RuntimeError("this optimizer already overlaps a model's forward: remove() that handle first")
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    order = list(model.parameters() if order is None else order)
    if not any(id(p) in mine for p in order):
        raise ValueError("overlap_with: none of the model's parameters is in this optimizer")
    handles = []
    for module in model.modules():
        if isinstance(module, _CONTAINERS):
            continue  # never called: the module that holds it reads its parameters
        own = [p for p in module.parameters(recurse=False)]
        for child in module.children():
            if isinstance(child, _CONTAINERS):
                own += list(child.parameters())
        own = [p for p in own if id(p) in mine]
        if not own:
            continue

        # Eager under torch.compile: the events it waits on change every step, so a traced copy of
        # this hook would wait on the ones it saw when it was traced.
        @torch.compiler.disable
        def wait(module, args, own=own, key=id(module)) -> None:
            optimizer._engine.wait_for(key, own)

        handles.append(module.register_forward_pre_hook(wait))
    handles.append(model.register_state_dict_pre_hook(lambda *args: optimizer._engine.join()))
    forward_order = {}
    for position, p in enumerate(order):
        forward_order.setdefault(id(p), position)
    optimizer._engine.overlap(forward_order)
    optimizer._overlap_handle = OverlapHandle(optimizer, handles)
    return optimizer._overlap_handle
