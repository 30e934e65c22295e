"""The engine keeps up with what a user changes between steps, in every placement.

Param groups whose tensors change (a tensor removed, replaced or added), options changed before a
group's first step, a refused step or budget that must leave everything as it was, buffer sets
replaced by larger ones, and copies of an Apollo optimizer. The oracle is torch.optim.AdamW doing
the same thing (it keys its state by parameter, whatever the groups hold), or the state as it was.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import fusedoff
from tests.helpers import make_params, seeded_grads

PLACEMENTS = {"resident": dict(offload="none"), "streamed": dict(offload="stream", chunk_size=32),
              "mixed": dict(offload="stream", chunk_size=32, device_budget=4 * 2 * 40)}


def make(n=4, seed=0):
    """`n` parameters of 40 elements."""
    return make_params([(40,)] * n, seed=seed)


GRADS = seeded_grads()  # a step's gradients: GRADS(params, step)


def assert_same_as_torch(ours, theirs, opt, ref):
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        if q in ref.state:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(opt.state[p][name], ref.state[q][name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("change", ["remove", "replace", "append", "delete group"])
def test_a_group_whose_tensors_change_steps_the_tensors_it_holds(placement, change):
    ours, theirs = make(), make()
    opt = fusedoff.AdamW([{"params": ours[:3]}, {"params": ours[3:], "lr": 3e-3}], lr=1e-2, **PLACEMENTS[placement])
    ref = torch.optim.AdamW([{"params": theirs[:3]}, {"params": theirs[3:], "lr": 3e-3}], lr=1e-2)
    extra, extra_ref = make(1, seed=9)[0], make(1, seed=9)[0]
    for step in range(4):
        if step == 2:
            for o, group in ((opt, [ours, extra]), (ref, [theirs, extra_ref])):
                params, new = group
                if change == "remove":
                    o.param_groups[0]["params"] = [params[0], params[2]]
                elif change == "replace":
                    o.param_groups[0]["params"] = [params[0], new, params[2]]
                elif change == "append":
                    o.param_groups[0]["params"] = [*params[:3], new]
                else:
                    del o.param_groups[0]
        live = [p for g in opt.param_groups for p in g["params"]]
        live_ref = [p for g in ref.param_groups for p in g["params"]]
        GRADS(live, step)
        GRADS(live_ref, step)
        opt.step()
        ref.step()
        assert_same_as_torch(live, live_ref, opt, ref)
    assert_same_as_torch(ours, theirs, opt, ref)  # those no longer in a group: as they were left


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("option", [dict(amsgrad=True), dict(state_precision="bf16"), dict(master_weights=False)])
def test_options_changed_before_a_groups_first_step_take_effect(placement, option):
    params = [torch.nn.Parameter(torch.randn(40).to(torch.bfloat16)) for _ in range(3)]
    opt = fusedoff.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, **PLACEMENTS[placement])
    params[0].grad = torch.randn(40).to(torch.bfloat16)
    opt.step()  # the second group has no gradient yet
    opt.param_groups[1].update(option)
    for p in params:
        p.grad = torch.randn(40).to(torch.bfloat16)
    opt.step()
    state = opt.state[params[1]]
    assert float(state["step"]) == 1.0
    if "amsgrad" in option:
        assert "max_exp_avg_sq" in state
    elif "state_precision" in option:
        assert state["exp_avg"].dtype == torch.bfloat16
    else:
        assert "master_param" not in state


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_step_refused_for_a_bad_option_changes_nothing(placement):
    params = make()
    opt = fusedoff.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, **PLACEMENTS[placement])
    GRADS(params, 0)
    opt.step()
    before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    opt.param_groups[1]["lr"] = None
    GRADS(params, 1)
    with pytest.raises(TypeError):
        opt.step()
    after = opt.state_dict()
    for p, was in zip(params, before[1]):
        assert torch.equal(p, was)
    for pid, state in before[0]["state"].items():
        for name, value in state.items():
            assert torch.equal(after["state"][pid][name], value), (pid, name)


def test_a_refused_budget_leaves_the_optimizer_as_it_was():
    params = make()
    opt = fusedoff.AdamW(params, lr=1e-2, offload="none")
    with pytest.raises(ValueError, match="device_budget applies"):
        opt.set_device_budget(1000)
    copy.deepcopy(opt)  # its configuration is still the one it had
    assert opt.memory_stats()["device_budget"] is None


def test_replaced_buffer_sets_are_let_go():
    """Two buckets whose buffer sets differ in size: when the second grows the shared sets, no view
    of the first's keeps the old ones alive."""
    fp32 = make(2)
    bf16 = [torch.nn.Parameter(torch.randn(40).to(torch.bfloat16)) for _ in range(2)]
    opt = fusedoff.AdamW([{"params": fp32}, {"params": bf16}], lr=1e-2, offload="stream", chunk_size=32)
    for step in range(3):
        GRADS(fp32, step)
        for p in bf16:
            p.grad = torch.randn(40).to(torch.bfloat16)
        opt.step()
    opt.state_dict()  # waits for the host: retired sets may go
    gc.collect()
    pipeline = next(iter(opt._engine.pipelines.values()))
    live = {b.untyped_storage().data_ptr() for b in pipeline.buffers}
    for bucket in opt._engine.buckets.values():
        for entries in bucket._piece_views.values():
            for _, _, views in entries:
                for view in views.values():
                    assert view.untyped_storage().data_ptr() in live


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_copy_of_apollo_keeps_the_references_int_steps(placement):
    params = make(2)
    opt = fusedoff.Apollo(params, lr=1e-2, **PLACEMENTS[placement])
    GRADS(params, 0)
    opt.step()
    for other in (copy.deepcopy(opt),):
        assert all(isinstance(s["step"], int) for s in other.state_dict()["state"].values())
