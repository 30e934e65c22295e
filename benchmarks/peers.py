"""The peers fusedoff is timed against, each written the way its users run it, each optional.

A builder takes the benchmark's parameters (on their device, their gradients attached by the caller
before every step) and returns a ``Built``: the step to time and how to time it. A peer whose package
is missing, or that cannot run on the device, raises ``PeerUnavailable`` saying why, and the benchmark
prints that instead of a figure. traffic.peer_traffic counts each peer's bytes.

  torch_fused    torch.optim.AdamW(fused=True), states resident: the speed ceiling with no memory saving.
  naive_offload  the offload users write by hand (NaiveOffloadAdamW).
  zero_offload   DeepSpeed ZeRO-Offload's data path around DeepSpeedCPUAdam (ZeroOffloadAdamW).
  torchao        torchao.optim.CPUOffloadOptimizer (fused CPU AdamW on host copies of the params).
  bnb_paged      bitsandbytes.optim.PagedAdamW, 32-bit states in CUDA managed memory.
  apollo_eager   fusedoff.kernels.reference.ApolloReference, the eager Apollo the tests use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
ADAM_HYPER = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
APOLLO_HYPER = dict(lr=1e-2, beta=0.9, eps=1e-4, warmup=0, weight_decay=1e-2, rebound="constant",
                    weight_decay_type="L2")


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (package missing, or not on this device); the message says why."""


@dataclass
class Built:
    step: Callable[[], object]
    # True: all of the step's device work is on the current CUDA stream, so CUDA events time it; False: it
    # uses other streams or the host, so it is timed with synchronised clocks.
    events: bool
    memory_stats: Callable[[], dict] | None = None
    close: Callable[[], None] | None = None


def _fp32_masters(params: list[Tensor], device: torch.device | str) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().to(device=device, dtype=torch.float32, copy=True)) for p in params]


# ---- torch --------------------------------------------------------------------------------------------


def torch_fused(params: list[Tensor], master: bool, device: torch.device) -> Built:
    """torch.optim.AdamW(fused=True) with its states next to the params. With bf16 params, it steps fp32
    master weights whose grads are the bf16 grads upcast as users write it (``g.float()``)."""
    if not master:
        opt = torch.optim.AdamW(params, fused=True, **ADAM_HYPER)
        return Built(opt.step, events=True)
    masters = _fp32_masters(params, device)
    opt = torch.optim.AdamW(masters, fused=True, **ADAM_HYPER)

    def step() -> None:
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        opt.step()

    return Built(step, events=True)


class NaiveOffloadAdamW:
    """The offload users write by hand: one torch.optim.AdamW(fused=True) per parameter, whose states (and
    fp32 master weights, for bf16 params) live on the CPU between steps. Each step, per parameter: move them
    to the GPU, step, write the bf16 param, move them back. Plain `.to()`: pageable memory, each copy
    waited for."""

    def __init__(self, params: list[Tensor], master: bool, device: torch.device) -> None:
        self.params, self.master, self.device = params, master, device
        # fp32 weights to step: the param itself (fp32), or an fp32 master kept on the CPU
        self.weights = _fp32_masters(params, "cpu") if master else params
        self.opts = [torch.optim.AdamW([w], fused=True, **ADAM_HYPER) for w in self.weights]

    @torch.no_grad()
    def step(self) -> None:
        for p, w, opt in zip(self.params, self.weights, self.opts):
            state = opt.state[w]
            for key, value in state.items():
                state[key] = value.to(self.device)
            if self.master:
                w.data = w.data.to(self.device)
                w.grad = p.grad.float()
            else:
                w.grad = p.grad
            opt.step()  # the first step creates the states, on the device
            if self.master:
                p.copy_(w)
                w.data = w.data.to("cpu")
            w.grad = None
            for key, value in state.items():
                state[key] = value.to("cpu")


def naive_offload(params: list[Tensor], master: bool, device: torch.device) -> Built:
    return Built(NaiveOffloadAdamW(params, master, device).step, events=False)


# ---- DeepSpeed ----------------------------------------------------------------------------------------


def load_deepspeed_cpu_adam() -> tuple[type | None, str, str]:
    """(DeepSpeedCPUAdam, version, how its op was built), or (None, why not, "").

    The cpu_adam op is JIT-built into torch's extension cache on first use (minutes; pass
    --no-deepspeed in a smoke test on a fresh machine) and loaded from there afterwards.
    """
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builder = CPUAdamBuilder()
        module = builder.load()
        built = (f"accelerator {get_accelerator()._name}, cpu_adam op {getattr(module, '__file__', '?')} built with "
                 f"{' '.join(builder.cxx_args())}")
    except Exception as exc:  # ImportError, or the op's JIT build failing
        return None, f"{type(exc).__name__}: {exc}", ""
    return DeepSpeedCPUAdam, deepspeed.__version__, built


class ZeroOffloadAdamW:
    """DeepSpeed ZeRO-Offload's data path around DeepSpeedCPUAdam, for one GPU: fp32 master weights and
    states in host memory. Each step: the grads go to pinned host memory (for bf16, a pinned bf16 buffer
    upcast into the master's fp32 grad, as ZeRO fills its fp32 grad partition), DeepSpeedCPUAdam steps
    on the CPU, and the weights go back to the GPU (for bf16, rounded into a pinned bf16 buffer first).

    DeepSpeedCPUAdam 0.19.8 has no fused copy to low-precision params, so the rounding is a torch copy.
    """

    def __init__(self, cls: type, params: list[Tensor], master: bool, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.params, self.master, self.device = params, master, device
        self.weights = _fp32_masters(params, "cpu")
        if pin and not master:  # fp32: grads land in, and params leave from, the master's own buffers
            self.weights = [torch.nn.Parameter(w.detach().pin_memory()) for w in self.weights]
        for w in self.weights:
            w.grad = torch.empty_like(w, pin_memory=pin and not master)
        if master:
            self.grad_stage = [torch.empty(p.shape, dtype=p.grad.dtype, pin_memory=pin) for p in params]
            self.param_stage = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in params]
        self.opt = cls(self.weights, adamw_mode=True, **ADAM_HYPER)

    @torch.no_grad()
    def step(self) -> None:
        grads_host = self.grad_stage if self.master else [w.grad for w in self.weights]
        for p, g in zip(self.params, grads_host):
            g.copy_(p.grad, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        if self.master:
            for w, g in zip(self.weights, self.grad_stage):
                w.grad.copy_(g)
        self.opt.step()
        sources = self.weights
        if self.master:
            for s, w in zip(self.param_stage, self.weights):
                s.copy_(w)
            sources = self.param_stage
        for p, s in zip(self.params, sources):
            p.copy_(s, non_blocking=True)


def zero_offload(params: list[Tensor], master: bool, device: torch.device) -> Built:
    cls, why, _ = load_deepspeed_cpu_adam()
    if cls is None:
        raise PeerUnavailable(f"DeepSpeedCPUAdam unavailable ({why})")
    return Built(ZeroOffloadAdamW(cls, params, master, device).step, events=False)


# ---- torchao, bitsandbytes ----------------------------------------------------------------------------


def torchao_offload(params: list[Tensor], master: bool, device: torch.device) -> Built:
    """torchao's CPUOffloadOptimizer with its default, torch's fused CPU AdamW, on host copies of the params
    in their own dtype (so bf16 params get bf16 states and no master weights).

    It copies each grad to the host in a post-accumulate-grad hook, that is during backward; without a
    backward pass here, the step runs those hooks as autograd would, then steps: the timed step includes
    the grad copies, which in training overlap the backward pass.
    """
    if device.type != "cuda":
        raise PeerUnavailable("needs CUDA (torchao's CPUOffloadOptimizer supports CUDA and XPU only)")
    try:
        import torchao
        from torchao.optim import CPUOffloadOptimizer
    except Exception as exc:
        raise PeerUnavailable(f"torchao not importable ({type(exc).__name__}: {exc})") from exc
    before = [set(p._post_accumulate_grad_hooks or {}) for p in params]
    opt = CPUOffloadOptimizer(params, torch.optim.AdamW, **ADAM_HYPER)
    hooks = [{k: h for k, h in (p._post_accumulate_grad_hooks or {}).items() if k not in old}
             for p, old in zip(params, before)]

    def step() -> None:
        for p, hs in zip(params, hooks):
            for hook in hs.values():
                hook(p)
        opt.step()

    def close() -> None:  # the params outlive this optimizer: take its hooks off them
        for p, hs in zip(params, hooks):
            for k in hs:
                p._post_accumulate_grad_hooks.pop(k, None)

    return Built(step, events=False, close=close, memory_stats=lambda: {"version": torchao.__version__})


def bnb_paged(params: list[Tensor], master: bool, device: torch.device) -> Built:
    """bitsandbytes' PagedAdamW with 32-bit states, updating the params directly (no master weights).

    Its states are CUDA managed memory, resident on the GPU while they fit (here they do: they page out only
    when the GPU is oversubscribed). NOTE: managed memory beyond the free device memory can hang a GPU, so
    this peer runs only while twice its states fit in the free memory.
    """
    if device.type != "cuda":
        raise PeerUnavailable("needs CUDA (paged states are CUDA managed memory)")
    try:
        import bitsandbytes as bnb
    except Exception as exc:
        raise PeerUnavailable(f"bitsandbytes not importable ({type(exc).__name__}: {exc})") from exc
    states = 8 * sum(p.numel() for p in params)
    free = torch.cuda.mem_get_info()[0]
    if 2 * states > free:
        raise PeerUnavailable(f"skipped: {states / 2**30:.1f} GiB of managed states vs {free / 2**30:.1f} GiB free")
    opt = bnb.optim.PagedAdamW(params, optim_bits=32, **ADAM_HYPER)
    return Built(opt.step, events=False, memory_stats=lambda: {"version": bnb.__version__})


def apollo_eager(params: list[Tensor], master: bool, device: torch.device) -> Built:
    """The eager Apollo reference the tests use (fp32: it computes in the params' dtype)."""
    if master:
        raise PeerUnavailable("fp32 only (the eager reference computes in the params' dtype, with no master weights)")
    from fusedoff.kernels.reference import ApolloReference

    opt = ApolloReference(params, **APOLLO_HYPER)
    return Built(opt.step, events=False)  # its 'stable' mode reads a mean on the host; time it all


BUILDERS: dict[str, Callable[[list[Tensor], bool, torch.device], Built]] = {
    "torch_fused": torch_fused,
    "naive_offload": naive_offload,
    "zero_offload": zero_offload,
    "torchao": torchao_offload,
    "bnb_paged": bnb_paged,
    "apollo_eager": apollo_eager,
}


def versions() -> dict[str, str]:
    """The peers' package versions, or why they are missing (without building anything)."""
    out = {}
    for name, module in (("deepspeed", "deepspeed"), ("torchao", "torchao"), ("bitsandbytes", "bitsandbytes")):
        try:
            out[name] = __import__(module).__version__
        except Exception as exc:
            out[name] = f"not installed ({type(exc).__name__})" if isinstance(exc, ImportError) else \
                f"not importable ({type(exc).__name__}: {exc})"
    return out
