"""Pure-PyTorch Adam/AdamW: the ``torch`` backend and the float64 oracle for the other backends.

It mirrors ``csrc/include/fusedoff/adam.h`` line for line. Math runs in float64 when any of the
parameter (or master) and state tensors is float64, otherwise in float32; low-precision tensors are
upcast on the fly and written back with round-to-nearest-even (a parameter with a master weight: the
master's rounding, see fusedoff/kernels/master.py). With ``found_inf`` it computes the
update and keeps the old values where ``found_inf`` is non-zero, so it never synchronises with the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fusedoff.hyperparameters import AdamHyperparameters, ApolloHyperparameters
from fusedoff.kernels import codec
from fusedoff.kernels import master as master_weights


def _math_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    master_params: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    hyper: AdamHyperparameters,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """In-place Adam/AdamW step; ``steps`` hold each tensor's count after this step's increment."""
    for i, param in enumerate(params):
        master = master_params[i] if master_params else None
        weights = master_weights.load(master, param) if master is not None else param
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        math = _math_dtype(weights, exp_avg)
        step = steps[i].to(torch.float64)
        step_size = (hyper.lr / (1 - hyper.beta1**step)).to(math)
        bias_correction2_sqrt = torch.sqrt(1 - hyper.beta2**step).to(math)

        p = weights.to(math)
        g = grads[i].to(math)
        if grad_scale is not None:
            g = g / grad_scale.to(math)
        if hyper.maximize:
            g = -g
        if hyper.weight_decay != 0 and not hyper.decoupled_weight_decay:
            g = g + hyper.weight_decay * p
        if hyper.weight_decay != 0 and hyper.decoupled_weight_decay:
            p = p * (1 - hyper.lr * hyper.weight_decay)
        m = hyper.beta1 * exp_avg.to(math) + (1 - hyper.beta1) * g
        v = hyper.beta2 * exp_avg_sq.to(math) + (1 - hyper.beta2) * g * g
        vhat = v
        if hyper.amsgrad:
            vmax = torch.maximum(max_exp_avg_sqs[i].to(math), v)
            vhat = vmax
        denom = torch.sqrt(vhat) / bias_correction2_sqrt + hyper.eps
        p = p - step_size * (m / denom)

        updates = [(exp_avg, m), (exp_avg_sq, v)]
        updates += master_weights.stored(master, param, p, steps[i]) if master is not None else [(param, p)]
        if hyper.amsgrad:
            updates.append((max_exp_avg_sqs[i], vmax))
        for target, value in updates:
            if found_inf is not None:
                value = torch.where(found_inf.reshape(()).to(torch.bool), target.to(math), value)
            target.copy_(value)


def adam_compressed_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    exp_avg_absmaxs: Sequence[Tensor],
    exp_avg_sq_absmaxs: Sequence[Tensor],
    master_params: Sequence[Tensor],
    steps: Sequence[Tensor],
    offsets: Sequence[int],
    tensor_keys: Sequence[int],
    *,
    hyper: AdamHyperparameters,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Adam/AdamW with compressed moments (see [note: compressed states] in state_codec.h): each
    tensor's states decoded to fp32, `adam_step_` above, then encoded again; bf16 or 8-bit by the
    states' dtype. `offsets` are the ranges' first elements in their tensors, `tensor_keys` the
    random stream's keys (bf16)."""
    for i, param in enumerate(params):
        m_store, v_store = exp_avgs[i], exp_avg_sqs[i]
        blocks8 = m_store.dtype == torch.uint8
        if blocks8:
            m = codec.dequantize(m_store, exp_avg_absmaxs[i], signed=True)
            v = codec.dequantize(v_store, exp_avg_sq_absmaxs[i], signed=False)
        else:
            m, v = m_store.to(torch.float32), v_store.to(torch.float32)
        master = [master_params[i]] if master_params else []
        adam_step_([param], [grads[i]], [m], [v], [], master, [steps[i]], hyper=hyper, grad_scale=grad_scale,
                   found_inf=found_inf)
        if blocks8:
            m_codes, m_absmax = codec.quantize(m, signed=True)
            v_codes, v_absmax = codec.quantize(v, signed=False)
            writes = [(m_store, m_codes), (v_store, v_codes), (exp_avg_absmaxs[i], m_absmax),
                      (exp_avg_sq_absmaxs[i], v_absmax)]
        else:
            index = offsets[i] + torch.arange(m.numel(), dtype=torch.int64, device=m.device)
            bits = codec.rounding_bits(codec.rounding_step_key(tensor_keys[i], steps[i]), index)
            writes = [(m_store, codec.bf16_stochastic(m, bits & 0xFFFF)), (v_store, codec.bf16_stochastic(v, bits >> 16))]
        for target, value in writes:
            if found_inf is not None:
                value = torch.where(found_inf.reshape(()).to(torch.bool), target, value)
            target.copy_(value)


# ---- Apollo ---------------------------------------------------------------------------------
# Mirrors csrc/include/fusedoff/apollo.h: the same phases, so it can stand in for any backend (and
# be split into ranges like them). Stats are float64 tensors of 5: sum d^4, sum y*d, sum B*d^2,
# max |y| and sum D.
APOLLO_SIGMA = 0.01


def _apollo_step_scalars(step: Tensor, h: ApolloHyperparameters):
    t = step.to(torch.float64)
    k = t - 1
    curr_lr = torch.where(k < h.warmup, (h.base_lr - h.init_lr) * k / max(h.warmup, 1e-300) + h.init_lr,
                          torch.full_like(t, h.lr))
    alpha = (1 - h.beta) / (1 - h.beta**t)
    return alpha, curr_lr


def apollo_step_(
    params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, stats, total_numels, *,
    phase: str, hyper: ApolloHyperparameters, grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
) -> None:
    """One phase of an Apollo step (see apollo.h), in float64 when the states are, else fp32."""
    if phase not in ("reduce", "full", "moments", "finish"):
        raise ValueError(f"phase must be 'reduce', 'full', 'moments' or 'finish', got {phase!r}")
    decay = "none" if hyper.weight_decay == 0 else hyper.weight_decay_type
    belief = hyper.rebound == "belief"
    for i, param in enumerate(params):
        master = master_params[i] if master_params else None
        weights = master_weights.load(master, param) if master is not None else param
        m_state, b_state, d_state, st = exp_avg_grads[i], approx_hessians[i], updates[i], stats[i]
        math = _math_dtype(weights, m_state)
        alpha64, curr_lr64 = _apollo_step_scalars(steps[i], hyper)
        alpha, curr_lr = alpha64.to(math), curr_lr64.to(math)
        p = weights.to(math)
        m, b, d = m_state.to(math), b_state.to(math), d_state.to(math)

        def gradient():
            g = grads[i].to(math)
            if grad_scale is not None:
                g = g / grad_scale.to(math)
            if decay == "L2":
                g = g + hyper.weight_decay * p
            return g

        if phase == "reduce":
            y = gradient() - m
            d2 = d * d
            partial = torch.stack([
                (d2 * d2).sum(dtype=torch.float64), (y * d).sum(dtype=torch.float64),
                (b * d2).sum(dtype=torch.float64),
                y.abs().max().to(torch.float64) if y.numel() else torch.zeros((), dtype=torch.float64,
                                                                              device=y.device),
            ])
            reduced = torch.cat([st[:3] + partial[:3], torch.maximum(st[3:4], partial[3:4])])
            if found_inf is not None:
                reduced = torch.where(found_inf.reshape(()).to(torch.bool), st[:4], reduced)
            st[:4].copy_(reduced)
            continue

        e = hyper.eps if belief else hyper.eps / APOLLO_SIGMA
        den64 = st[0].sqrt().sqrt() + e
        delta = ((-alpha64 * st[1] - st[2]) / (den64 * den64)).to(math)
        den = den64.to(math)
        floor = st[3].to(math) if belief else torch.tensor(APOLLO_SIGMA, dtype=math, device=p.device)
        shift = (hyper.eps / alpha64).to(math) if belief else torch.zeros((), dtype=math, device=p.device)
        writes = []
        if phase in ("full", "moments"):
            y = gradient() - m
            m = m + alpha * y
            dh = d / den
            b = b + delta * (dh * dh)
            writes += [(m_state, m), (b_state, b)]
        rebounded = torch.maximum(b.abs(), floor) + shift
        if phase == "moments":
            writes.append((st, torch.cat([st[:4], st[4:] + rebounded.sum(dtype=torch.float64)])))
        else:
            u = m / rebounded
            if decay == "decoupled":
                u = u + hyper.weight_decay * p
            elif decay == "stable":
                u = u + (hyper.weight_decay / (st[4] / total_numels[i])).to(math) * p
            p = p - curr_lr * u
            writes += [(d_state, u)]
            writes += master_weights.stored(master, param, p, steps[i]) if master is not None else [(param, p)]
        for target, value in writes:
            if found_inf is not None:
                value = torch.where(found_inf.reshape(()).to(torch.bool), target.to(value.dtype), value)
            target.copy_(value)


class ApolloReference(torch.optim.Optimizer):
    """Apollo written the eager way, one whole tensor at a time, as the reference implementation
    (XuezheMax/apollo, optim/apollo.py, sigma = 0.01) does: the oracle (run it in float64) and the
    eager baseline of the benchmarks. It shares no code with the fused backends.
    """

    def __init__(self, params, lr, beta=0.9, eps=1e-4, rebound="constant", warmup=500, init_lr=None,
                 weight_decay=0, weight_decay_type=None):
        if init_lr is None:
            init_lr = lr / 1000
        if weight_decay_type is None:
            weight_decay_type = "L2" if rebound == "constant" else "decoupled"
        defaults = dict(lr=lr, beta=beta, eps=eps, rebound=rebound, warmup=warmup, init_lr=init_lr, base_lr=lr,
                        weight_decay=weight_decay, weight_decay_type=weight_decay_type)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg_grad"] = torch.zeros_like(p)
                    state["approx_hessian"] = torch.zeros_like(p)
                    state["update"] = torch.zeros_like(p)
                if state["step"] < group["warmup"]:
                    curr_lr = (group["base_lr"] - group["init_lr"]) * state["step"] / group["warmup"] + group["init_lr"]
                else:
                    curr_lr = group["lr"]
                grad = p.grad
                wd, wd_type = group["weight_decay"], group["weight_decay_type"]
                if wd != 0 and wd_type == "L2":
                    grad = grad.add(p, alpha=wd)
                beta, eps = group["beta"], group["eps"]
                m, hessian, d = state["exp_avg_grad"], state["approx_hessian"], state["update"]
                state["step"] += 1
                alpha = (1 - beta) / (1 - beta ** state["step"])
                delta_grad = grad - m
                if group["rebound"] == "belief":
                    rebound = delta_grad.norm(p=float("inf"))
                else:
                    rebound, eps = APOLLO_SIGMA, eps / APOLLO_SIGMA
                m.add_(delta_grad, alpha=alpha)
                denom = d.norm(p=4).add(eps)
                d.div_(denom)
                v_sq = d.mul(d)
                delta = delta_grad.div_(denom).mul_(d).sum().mul(-alpha) - hessian.mul(v_sq).sum()
                hessian.addcmul_(v_sq, delta)
                if group["rebound"] == "belief":
                    # out of place: DTensor (FSDP2) cannot add in place to the Partial(max) result
                    denom = torch.max(hessian.abs(), rebound).add(group["eps"] / alpha)
                else:
                    denom = hessian.abs().clamp_(min=rebound)
                d.copy_(m.div(denom))
                if wd != 0 and wd_type != "L2":
                    d.add_(p, alpha=wd / denom.mean().item() if wd_type == "stable" else wd)
                p.add_(d, alpha=-curr_lr)
        return loss
