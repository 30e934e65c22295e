"""Checkpoints between every topology and precision (issue 31): two CPU processes with the gloo backend.

Sources: an AdamW over bf16 tensors (so master weights exist) in each of the nine forms (state
precision fp32, bf16, 8bit x master precision fp32, split, split8), trained two steps, then saved,
then trained two more (the uninterrupted run). Topologies: one plain process, FSDP2's sharding
(DTensors sharded on their first dimension over two ranks, as fully_shard shards) and ZeRO-1; APIs:
torch.distributed.checkpoint through get_state_dict/set_state_dict, and torch.save of state_dict().

A destination is a fresh optimizer, built in some form, that loads the checkpoint: like lr, the
checkpoint's state_precision and master_precision are restored, so every cell must continue the
saved run. The oracles are the saved optimizer's own fp32_state_dict at the save (what the
destination's fp32_state_dict must hold after loading) and the uninterrupted run (what its
parameters must be two steps later). Bit for bit everywhere, except 8-bit moments of a tensor
whose 8-bit blocks differ between the two topologies (a shard starting inside a block of 256
elements: the block is two parts with their own scales on one side, whole on the other): those are
quantized once more, within the 8-bit bound of each element, and the later steps then differ.

The cells that are refused: a torch.save'd state dict across sharded and plain optimizers (DTensor
states); state dicts that DCP would convert on the way (an optimizer's own state_dict() passed to
dcp.save, read into another precision's: 8-bit codes as numbers, fp32 rounded to bf16), each with
an error that names both forms and the fix; and a DCP checkpoint that does not say how its moments
are stored (refused by DCP as a missing key). Every scenario runs in one spawn of two processes.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist

import fusedoff
from tests.helpers import sharded_on, spawn_ranks, train, train_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

WORLD = 2
# On two ranks: 1024 elements split at 512 (every shard on a block of 256), and 800 split at 400
# (the second shard starts inside block 1, which is two parts when sharded and whole in one process).
SHAPES = [(16, 64), (20, 40)]
ALIGNED, STRADDLING = 0, 1
SAVE_AT, STEPS = 2, 4
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, backend="cpu", offload="stream", chunk_size=256)
STATE_PRECISIONS = ("fp32", "bf16", "8bit")
MASTER_PRECISIONS = ("fp32", "split", "split8")
FORMS = [(s, m) for s in STATE_PRECISIONS for m in MASTER_PRECISIONS]
# Destinations across topologies are built in these forms (every one of the nine on one process).
BUILT_AS = [("fp32", "fp32"), ("8bit", "split8")]
STATES = ("exp_avg", "exp_avg_sq", "master_param")


def initial(t: int) -> torch.Tensor:
    return torch.randn(SHAPES[t], generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)


def gradient(step: int, t: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + t)
    # Magnitudes over 2^10 within a tensor: small elements sit far below their block's scale.
    grad = torch.randn(SHAPES[t], generator=gen) * torch.exp2(torch.randint(-10, 1, SHAPES[t], generator=gen))
    return grad.to(torch.bfloat16)


def params_on(mesh, values=None) -> list[torch.nn.Parameter]:
    values = values if values is not None else [initial(t) for t in range(len(SHAPES))]
    return [torch.nn.Parameter(sharded_on(mesh)(v.clone())) for v in values]


def make_optimizer(params, form: tuple[str, str]):
    return fusedoff.AdamW(params, state_precision=form[0], master_precision=form[1], **HYPER)


def gradients_on(mesh=None):
    """A `set_grads` for `train`: tensor t's gradient(step, t), sharded over `mesh`."""
    shard = sharded_on(mesh)

    def set_grads(params, step: int) -> None:
        for t, p in enumerate(params):
            p.grad = shard(gradient(step, t))
    return set_grads


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def fp32_states(opt, params) -> list[dict]:
    """Each tensor's moments and master weight as fp32 whole tensors (gathered where sharded)."""
    return fp32_states_of(opt, params, STATES)


def fp32_states_of(opt, params, names) -> list[dict]:
    states = opt.fp32_state_dict()["state"]
    return [{name: full(states[t][name]) for name in names} for t in range(len(params))]


def serialized(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def deserialized(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=False)


def folder_of(folder: str, topology: str, form) -> str:
    return os.path.join(folder, f"{topology}-{form[0]}-{form[1]}")


# ---- sources -----------------------------------------------------------------------------------
def source(form, mesh, path: str, group=None) -> dict:
    """Trains a source to SAVE_AT, saves it through DCP at `path` (and keeps its torch.save form),
    then trains it on to STEPS: the oracles."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    params = params_on(mesh)
    opt = make_optimizer(params, form)
    train(params, opt, range(SAVE_AT), gradients_on(mesh))
    model_sd, optim_sd = get_state_dict(torch.nn.ParameterList(params), opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)
    # (a sharded one is kept as it is, to be loaded in this process: torch.save does not write the
    # DTensors of host-resident states)
    state_dict = opt.state_dict() if mesh is not None else serialized(opt.state_dict())
    out = {"states": fp32_states(opt, params), "at save": [full(p) for p in params], "state_dict": state_dict}
    train(params, opt, range(SAVE_AT, STEPS), gradients_on(mesh))
    out["params"] = [full(p) for p in params]
    return out


def zero_redundancy_source(form) -> dict:
    """ZeRO-1 over the whole tensors on both ranks (same gradients): its consolidated state dict
    at SAVE_AT (rank 0), for torch.save."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = params_on(None)
    opt = ZeroRedundancyOptimizer(params, optimizer_class=fusedoff.AdamW, state_precision=form[0],
                                  master_precision=form[1], **HYPER)
    train(params, opt, range(SAVE_AT), gradients_on())
    opt.consolidate_state_dict(to=0)
    return {"state_dict": serialized(opt.state_dict()) if dist.get_rank() == 0 else None}


# ---- destinations ------------------------------------------------------------------------------
def continued(params, opt, mesh, states: bool = True) -> dict:
    """What a loaded destination holds (groups' forms, fp32 states) and its parameters at STEPS."""
    optim = getattr(opt, "optim", opt)  # ZeRO-1's local optimizer
    out = {"groups": [(g["state_precision"], g["master_precision"]) for g in optim.param_groups]}
    if states:
        out["states"] = fp32_states(opt, params)
    train(params, opt, range(SAVE_AT, STEPS), gradients_on(mesh))
    out["params"] = [full(p) for p in params]
    return out


def load_dcp(path: str, built, mesh, group=None) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    params = params_on(mesh, [initial(t) + 1 for t in range(len(SHAPES))])  # everything from the checkpoint
    module = torch.nn.ParameterList(params)
    opt = make_optimizer(params, built)
    model_sd, optim_sd = get_state_dict(module, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return continued(params, opt, mesh)


def load_saved(blob: bytes | dict, at_save, built, mesh=None) -> dict:
    params = params_on(mesh, at_save)
    opt = make_optimizer(params, built)
    opt.load_state_dict(deserialized(blob) if isinstance(blob, bytes) else blob)
    return continued(params, opt, mesh)


def load_into_zero_redundancy(blob: bytes, at_save, built) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = params_on(None, at_save)
    opt = ZeroRedundancyOptimizer(params, optimizer_class=fusedoff.AdamW, state_precision=built[0],
                                  master_precision=built[1], **HYPER)
    opt.load_state_dict(deserialized(blob))
    return continued(params, opt, None, states=False)  # (each rank holds its own tensors' states)


def attempt(load, *args) -> dict | str:
    """A cell's outcome, or the error that refused it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return load(*args)
    except (Exception, CheckpointException) as error:  # (DCP's is a BaseException naming each rank's errors)
        return f"{type(error).__name__}: {error}"


def converted_by_dcp(folder: str, group) -> dict:
    """State dicts that DCP converts on the way: an optimizer's own state_dict() (not get_state_dict's)
    saved by dcp.save and loaded by dcp.load into another precision's own state_dict() (8-bit codes
    into fp32 moments, fp32 moments into bf16 ones); and 8-bit codes keyed by name without
    saved_state_precision, as get_state_dict wrote them before issue 31, loaded through it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def saved_by(form) -> tuple[list, dict]:
        params = params_on(None)
        opt = make_optimizer(params, form)
        train(params, opt, range(SAVE_AT), gradients_on())
        return [full(p) for p in params], opt.state_dict()

    def raw(form, built) -> dict:
        values, saved = saved_by(form)
        path = os.path.join(folder, f"raw-{form[0]}")
        dcp.save({"optim": saved}, checkpoint_id=path, process_group=group)
        fresh = params_on(None, values)
        dest = make_optimizer(fresh, built)
        train(fresh, dest, range(1), gradients_on())  # (states to load into)
        state = {"optim": dest.state_dict()}
        dcp.load(state, checkpoint_id=path, process_group=group)
        dest.load_state_dict(state["optim"])
        return continued(fresh, dest, None)

    def without_saved_precision() -> dict:
        values, saved = saved_by(("8bit", "fp32"))
        by_name = {"state": {str(pid): s for pid, s in saved["state"].items()},
                   "param_groups": [{**g, "params": [str(pid) for pid in g["params"]]} for g in saved["param_groups"]]}
        for g in by_name["param_groups"]:
            del g["saved_state_precision"]
        path = os.path.join(folder, "without")
        dcp.save({"optim": by_name}, checkpoint_id=path, process_group=group)
        fresh = params_on(None, values)
        module = torch.nn.ParameterList(fresh)
        dest = make_optimizer(fresh, ("fp32", "fp32"))
        state = {"optim": get_optimizer_state_dict(module, dest)}
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_optimizer_state_dict(module, dest, optim_state_dict=state["optim"])
        return continued(fresh, dest, None)

    return {"8bit into fp32": attempt(raw, ("8bit", "fp32"), ("fp32", "fp32")),
            "fp32 into bf16": attempt(raw, ("fp32", "fp32"), ("bf16", "fp32")),
            "without saved_state_precision": attempt(without_saved_precision)}


def fully_shard_model(mesh=None) -> torch.nn.Module:
    """A small model, sharded by fully_shard over `mesh` (None: plain): shards of 512 and 256 elements."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(16, 32, bias=False))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def whole_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A `batch` for train_model, whole on every rank: FSDP averages identical gradients exactly."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 64, generator=gen), torch.randn(8, 32, generator=gen)


def fully_shard_into_plain(folder: str, mesh, group) -> dict:
    """Issue 31's case: an 8-bit optimizer of a fully_shard model on two ranks saved through DCP,
    loaded into an 8-bit optimizer of a plain model in one process (rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(folder, "fully_shard")
    model = fully_shard_model(mesh)
    opt = fusedoff.AdamW(model.parameters(), state_precision="8bit", **HYPER)
    train_model(model, opt, range(SAVE_AT), whole_batch)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = [{name: full(s[name]) for name in ("exp_avg", "exp_avg_sq")}
             for s in opt.fp32_state_dict()["state"].values()]
    train_model(model, opt, range(SAVE_AT, STEPS), whole_batch)
    want = [full(p) for p in model.parameters()]
    if dist.get_rank() != 0:
        return {}

    def load() -> dict:
        plain = fully_shard_model()
        dest = fusedoff.AdamW(plain.parameters(), state_precision="8bit", **HYPER)
        model_sd, optim_sd = get_state_dict(plain, dest)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_state_dict(plain, dest, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = [{name: s[name].clone() for name in ("exp_avg", "exp_avg_sq")}
                  for s in dest.fp32_state_dict()["state"].values()]
        precision = {g["state_precision"] for g in dest.param_groups}
        train_model(plain, dest, range(SAVE_AT, STEPS), whole_batch)
        return {"states": loaded, "precision": precision, "params": [p.detach().clone() for p in plain.parameters()]}

    return {"saved": saved, "want": want, "got": attempt(load)}


# ---- the two processes ---------------------------------------------------------------------------
def _worker(rank: int, port: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        alone = dist.new_group([0])  # the plain process: rank 0 on its own
        results: dict = {}
        for form in FORMS:
            results["fsdp", form] = source(form, mesh, folder_of(folder, "fsdp", form))
            if rank == 0:
                results["plain", form] = source(form, None, folder_of(folder, "plain", form), alone)
                torch.save(results["plain", form], folder_of(folder, "plain", form) + ".pt")
        dist.barrier()
        plain_sources = {form: torch.load(folder_of(folder, "plain", form) + ".pt", weights_only=False)
                         for form in FORMS}
        cells: dict = {}
        for src in ("fsdp", "plain"):
            for form in FORMS:
                for built in BUILT_AS:
                    cells["dcp", src, "fsdp", form, built] = attempt(
                        load_dcp, folder_of(folder, src, form), built, mesh)
        for form in FORMS:
            blob = plain_sources[form]["state_dict"]
            cells["torch.save", "plain", "fsdp", form, BUILT_AS[0]] = attempt(
                load_saved, blob, plain_sources[form]["at save"], BUILT_AS[0], mesh)
        if rank == 0:
            for src in ("fsdp", "plain"):
                for form in FORMS:
                    for built in FORMS if src == "plain" else BUILT_AS:
                        cells["dcp", src, "plain", form, built] = attempt(
                            load_dcp, folder_of(folder, src, form), built, None, alone)
            for form in FORMS:
                for built in FORMS:
                    cells["torch.save", "plain", "plain", form, built] = attempt(
                        load_saved, plain_sources[form]["state_dict"], plain_sources[form]["at save"], built)
                fsdp_blob = results["fsdp", form]["state_dict"]  # (rank 0's shards)
                cells["torch.save", "fsdp", "plain", form, BUILT_AS[0]] = attempt(
                    load_saved, fsdp_blob, results["fsdp", form]["at save"], BUILT_AS[0])
            results["converted by dcp"] = converted_by_dcp(folder, alone)
        results["fully_shard into plain"] = fully_shard_into_plain(folder, mesh, alone)
        dist.barrier()
        for form in FORMS:
            zero = zero_redundancy_source(form)
            if rank == 0:
                cells["torch.save", "zero", "plain", form, BUILT_AS[0]] = attempt(
                    load_saved, zero["state_dict"], plain_sources[form]["at save"], BUILT_AS[0])
            for built in BUILT_AS:
                cells["torch.save", "plain", "zero", form, built] = attempt(
                    load_into_zero_redundancy, plain_sources[form]["state_dict"], plain_sources[form]["at save"], built)
        if rank == 0:
            results["cells"] = cells
            for form in FORMS:  # (the sources' state dicts were for the cells)
                del results["fsdp", form]["state_dict"], results["plain", form]["state_dict"]
            torch.save(results, os.path.join(folder, "results.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    return spawn_ranks(_worker, WORLD)


# ---- the tests ---------------------------------------------------------------------------------
CONTINUING = [("dcp", src, dst) for src in ("plain", "fsdp") for dst in ("plain", "fsdp")] + [
    ("torch.save", "plain", "plain"), ("torch.save", "zero", "plain"), ("torch.save", "plain", "zero")]


def _source_of(src: str) -> str:
    return "plain" if src == "zero" else src  # ZeRO-1 steps as one process does, bit for bit


def _exact(form, src: str, dst: str, t: int) -> bool:
    """Whether tensor t continues bit for bit: not 8-bit, or its 8-bit blocks the same on both sides."""
    same_blocks = _source_of(src) == _source_of(dst) or t == ALIGNED
    return form[0] != "8bit" or same_blocks


def _cells(runs, api, src, dst):
    return {key[3:]: value for key, value in runs["cells"].items() if key[:3] == (api, src, dst)}


@pytest.mark.parametrize("api,src,dst", CONTINUING, ids=["-".join(c) for c in CONTINUING])
def test_every_form_continues_across_topologies(runs, api, src, dst):
    from test_distributed_compressed import _straddling_block_bound

    cells = _cells(runs, api, src, dst)
    assert {form for form, _ in cells} == set(FORMS)
    for (form, built), got in cells.items():
        cell = f"{form} saved, loaded into {built}"
        assert isinstance(got, dict), f"{cell}: refused: {got}"
        want = runs[_source_of(src), form]
        assert set(got["groups"]) == {form}, f"{cell}: the checkpoint's precisions are restored"
        for t in range(len(SHAPES)):
            for name in STATES if "states" in got else ():
                a, b = got["states"][t][name], want["states"][t][name]
                if _exact(form, src, dst, t) or name == "master_param":
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{cell}: {name} of tensor {t}"
                else:  # quantized once more in other blocks: within each element's 8-bit bound
                    bound = _straddling_block_bound(b, signed=name == "exp_avg")
                    assert ((a - b).abs().reshape(-1) <= bound).all(), f"{cell}: {name} of tensor {t}"
            if _exact(form, src, dst, t):
                assert torch.equal(got["params"][t], want["params"][t]), f"{cell}: tensor {t} after resuming"


def test_the_straddling_8bit_cells_do_convert(runs):
    """(So that the bound above is tested: some 8-bit moments do change between topologies.)"""
    got = runs["cells"]["dcp", "fsdp", "plain", ("8bit", "fp32"), BUILT_AS[0]]
    want = runs["fsdp", ("8bit", "fp32")]
    assert not torch.equal(got["states"][STRADDLING]["exp_avg"], want["states"][STRADDLING]["exp_avg"])


def test_torch_save_of_sharded_states_into_a_plain_optimizer_is_refused(runs):
    for form in FORMS:
        got = runs["cells"]["torch.save", "fsdp", "plain", form, BUILT_AS[0]]
        assert isinstance(got, str) and "sharded" in got and "full_state_dict=True" in got, got


def test_torch_save_of_plain_states_into_sharded_ones_is_refused(runs):
    for form in FORMS:
        got = runs["cells"]["torch.save", "plain", "fsdp", form, BUILT_AS[0]]
        assert isinstance(got, str) and "DTensor" in got and "set_optimizer_state_dict" in got, got


def test_8bit_codes_read_by_dcp_into_fp32_moments_are_refused(runs):
    """An 8-bit optimizer's own state_dict() saved by dcp.save holds codes and scales; dcp.load reads
    the codes into an fp32 optimizer's moments as numbers. Refused at load, naming both forms and the fix."""
    got = runs["converted by dcp"]["8bit into fp32"]
    assert isinstance(got, str), f"loaded: {got['groups']}"
    assert "saved as 8-bit codes" in got and "the form of state_precision='fp32'" in got, got
    assert "get_state_dict and set_state_dict" in got and "an optimizer with state_precision='8bit'" in got, got


def test_fp32_moments_rounded_by_dcp_into_bf16_ones_are_refused(runs):
    got = runs["converted by dcp"]["fp32 into bf16"]
    assert isinstance(got, str), f"loaded: {got['groups']}"
    assert "saved as fp32 moments" in got and "the form of state_precision='bf16'" in got, got
    assert "get_state_dict and set_state_dict" in got and "an optimizer with state_precision='fp32'" in got, got


def test_a_dcp_checkpoint_that_does_not_say_its_form_is_refused(runs):
    """Codes keyed by name as get_state_dict wrote them before issue 31 (no saved_state_precision):
    DCP refuses it as a missing key instead of reading the codes as numbers."""
    got = runs["converted by dcp"]["without saved_state_precision"]
    assert isinstance(got, str) and "Missing key" in got and "saved_state_precision" in got, got


def test_a_fully_shard_8bit_checkpoint_loads_into_a_plain_model(runs):
    """Issue 31: two ranks' 8-bit states of a fully_shard model, loaded through DCP into an 8-bit
    optimizer of the plain model in one process, as torch's AdamW loads its own (DCP stopped at the
    missing exp_avg_absmax before). Its shards start on blocks, so the loaded 8-bit moments are the
    saved ones and the run continues bit for bit."""
    case = runs["fully_shard into plain"]
    got = case["got"]
    assert isinstance(got, dict), got
    assert got["precision"] == {"8bit"}
    for t, (a, b) in enumerate(zip(got["states"], case["saved"])):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[name], b[name]), f"{name} of parameter {t}"
    for t, (a, b) in enumerate(zip(got["params"], case["want"])):
        assert torch.equal(a, b), f"parameter {t}"


@pytest.mark.parametrize("saved", MASTER_PRECISIONS)
def test_apollo_continues_across_master_precisions(tmp_path, saved):
    """Apollo keeps fp32 states and masters in any master precision: its DCP state dict holds the
    whole master too, and every destination continues bit for bit (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def apollo(params, master):
        return fusedoff.Apollo(params, lr=1e-2, warmup=1, rebound="belief", master_precision=master,
                               **{k: HYPER[k] for k in ("backend", "offload", "chunk_size")})

    params = params_on(None)
    opt = apollo(params, saved)
    train(params, opt, range(SAVE_AT), gradients_on())
    model_sd, optim_sd = get_state_dict(torch.nn.ParameterList(params), opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    want_states = fp32_states_of(opt, params, ("exp_avg_grad", "approx_hessian", "update", "master_param"))
    train(params, opt, range(SAVE_AT, STEPS), gradients_on())
    for built in MASTER_PRECISIONS:
        fresh = params_on(None, [initial(t) + 1 for t in range(len(SHAPES))])
        module = torch.nn.ParameterList(fresh)
        dest = apollo(fresh, built)
        model_sd, optim_sd = get_state_dict(module, dest)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(tmp_path))
        set_state_dict(module, dest, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert {g["master_precision"] for g in dest.param_groups} == {saved}
        got = fp32_states_of(dest, fresh, ("exp_avg_grad", "approx_hessian", "update", "master_param"))
        for t, (a, b) in enumerate(zip(got, want_states)):
            for name in a:
                assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), f"{built}: {name} of {t}"
        train(fresh, dest, range(SAVE_AT, STEPS), gradients_on())
        for t, (a, b) in enumerate(zip(fresh, params)):
            assert torch.equal(a.detach(), b.detach()), f"{built}: tensor {t} after resuming"
