"""The stored forms (fusedoff/formats.py), each against an oracle of its own: the bytes the engine
allocates for it, the pure-PyTorch codec (fusedoff/kernels/codec.py) for 8-bit codes, exact widening
for bf16, the bit layout of an fp32 master for split ones; and each refusal, where it is written."""

from __future__ import annotations

import pytest
import torch

import fusedoff
from fusedoff import formats
from fusedoff.formats import MASTER, Role
from fusedoff.kernels import codec

SIZES = (1, 7, 255, 256, 257, 1000)


def moments(n: int, role: Role, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randn(n, generator=g) * 6)
    return x if role.signed else x.abs()


@pytest.mark.parametrize("precision", tuple(formats.MOMENT_FORMS))
def test_bytes_per_element_are_what_the_engine_stores(precision):
    """Host bytes of a streamed AdamW (fp32 parameters: no master) over elements a multiple of the
    plan's alignment and of the 8-bit block: two moments in the form."""
    n = 4 * codec.QUANT_BLOCK
    param = torch.nn.Parameter(torch.randn(n))
    opt = fusedoff.AdamW([param], offload="stream", state_precision=precision, backend="cpu")
    param.grad = torch.randn(n)
    opt.step()
    stats = opt.memory_stats()
    assert stats["host_bytes"] == 2 * formats.moment_form(precision).bytes_per_element("exp_avg") * n


@pytest.mark.parametrize("precision", tuple(formats.MASTER_FORMS))
def test_master_bytes_per_element_are_what_the_engine_stores(precision):
    n = 4 * codec.QUANT_BLOCK
    param = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
    opt = fusedoff.AdamW([param], offload="stream", master_precision=precision, backend="cpu")
    param.grad = torch.randn(n).to(torch.bfloat16)
    opt.step()
    moments_bytes = 2 * 4 * n
    assert opt.memory_stats()["host_bytes"] - moments_bytes == formats.master_form(precision).bytes_per_element() * n


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("role", (Role.SIGNED_MOMENT, Role.SECOND_MOMENT), ids=("signed", "second"))
def test_8bit_codes_are_the_pytorch_codecs_and_decode_to_its_values(n, role):
    form, param = formats.EIGHT_BIT, torch.zeros(n)
    x = moments(n, role, seed=n)
    stored = form.from_fp32(x, "m", role, param)
    codes, absmax = codec.quantize(x, signed=role.signed)
    assert set(stored) == set(form.keys("m")) == {"m", "m_absmax"}
    assert torch.equal(stored["m"], codes) and torch.equal(stored["m_absmax"], absmax)
    assert form.holds(stored, "m") and formats.stored_form(stored, "m", role) is form
    decoded = form.to_fp32(stored, "m", role, param)
    assert torch.equal(decoded.view(torch.int32), codec.dequantize(codes, absmax, signed=role.signed).view(torch.int32))


def test_bf16_moments_widen_exactly_and_load_rounded_to_nearest():
    x = moments(1000, Role.SIGNED_MOMENT)
    param = torch.zeros(1000)
    stored = formats.BF16.from_fp32(x, "m", Role.SIGNED_MOMENT, param)
    assert torch.equal(stored["m"], x.to(torch.bfloat16))
    widened = formats.BF16.to_fp32(stored, "m", Role.SIGNED_MOMENT, param)
    assert torch.equal(widened, stored["m"].double().float())  # exact: every bf16 value is an fp32 value


@pytest.mark.parametrize("precision", ("split", "split8"))
def test_a_split_master_is_the_low_bits_beside_its_parameter(precision):
    g = torch.Generator().manual_seed(1)
    master = torch.randn(4096, generator=g)
    param = fusedoff.kernels.master.param_of_master(master, torch.bfloat16)
    form = formats.master_form(precision)
    stored = form.from_fp32(master, MASTER, Role.MASTER_WEIGHT, param)
    (key,) = form.keys(MASTER)
    bits = master.view(torch.int32).to(torch.int64)
    if precision == "split":  # the low 16 bits, exactly: the join gives the master back bit for bit
        assert torch.equal(stored[key].to(torch.int64) & 0xFFFF, bits & 0xFFFF)
        joined = form.to_fp32(stored, MASTER, Role.MASTER_WEIGHT, param)
        assert torch.equal(joined.view(torch.int32), master.view(torch.int32))
    else:  # 8 bits: within the documented bound, 2^-15 of the master
        joined = form.to_fp32(stored, MASTER, Role.MASTER_WEIGHT, param)
        ulp = torch.finfo(torch.bfloat16).eps * master.abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert ((joined - master).abs() <= ulp / 256).all()
    assert form.bytes_per_element() == {"split": 2, "split8": 1}[precision]


def test_each_refusal_is_the_forms():
    with pytest.raises(ValueError, match="amsgrad keeps fp32 states only"):
        formats.BF16.refuse(Role.RUNNING_MAX, "state_precision")
    with pytest.raises(ValueError, match="amsgrad keeps fp32 states only"):
        formats.EIGHT_BIT.refuse(Role.RUNNING_MAX, "state_precision")
    formats.FP32.refuse(Role.RUNNING_MAX, "state_precision")
    with pytest.raises(ValueError, match="cannot be split exactly"):
        formats.check_master_param("split8", torch.float16)
    formats.check_master_param("fp32", torch.float16)
    with pytest.raises(ValueError, match="state_precision must be one of"):
        formats.moment_form("int4")
    with pytest.raises(ValueError, match="master_precision must be one of"):
        formats.master_form("bf16")


@pytest.mark.parametrize("precision", tuple(formats.MOMENT_FORMS))
def test_moments_of_another_float_dtype_load_as_their_fp32_values(precision):
    """torch.optim.AdamW on fp16 parameters keeps fp16 moments: loading its checkpoint equals loading
    the same moments widened to fp32 first (exact), in every state precision."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300).to(torch.float16))]
    reference = torch.optim.AdamW(params, lr=1e-2)
    params[0].grad = torch.randn(300).to(torch.float16)
    reference.step()
    saved = reference.state_dict()
    assert saved["state"][0]["exp_avg"].dtype == torch.float16
    widened = {**saved, "state": {0: {k: v.float() if k.startswith("exp_avg") else v
                                      for k, v in saved["state"][0].items()}}}
    loaded = []
    for state_dict in (saved, widened):
        opt = fusedoff.AdamW(params, state_precision=precision, backend="torch")
        opt.load_state_dict(state_dict)
        loaded.append(opt.state_dict()["state"][0])
    assert loaded[0].keys() == loaded[1].keys()
    for key in loaded[0]:
        assert torch.equal(loaded[0][key], loaded[1][key]), key


def test_a_running_maximum_is_refused_compressed_before_anything_changes():
    param = torch.nn.Parameter(torch.randn(64))
    opt = fusedoff.Adam([param], amsgrad=True, backend="torch")
    param.grad = torch.randn(64)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[param].items()}
    opt.param_groups[0]["state_precision"] = "bf16"
    with pytest.raises(ValueError, match="amsgrad keeps fp32 states only"):
        opt.step()
    assert {k: (v.dtype, v.clone()) for k, v in opt.state[param].items()}.keys() == before.keys()
    for key, value in before.items():
        assert opt.state[param][key].dtype == value.dtype and torch.equal(opt.state[param][key], value), key


@pytest.mark.parametrize("optimizer,options", [("apollo", {"rebound": "bogus"}), ("apollo", {"weight_decay": -1}),
                                               ("adamw", {"eps": -1.0}), ("adamw", {"nonsense": 1})])
def test_the_memory_report_refuses_what_the_optimizer_refuses(optimizer, options):
    from fusedoff import memory

    params = [torch.nn.Parameter(torch.zeros(8))]
    cls = {"adamw": fusedoff.AdamW, "apollo": fusedoff.Apollo}[optimizer]
    with pytest.raises((ValueError, TypeError)) as refused:
        cls(params, **{"lr": 1e-3, **options})
    with pytest.raises(type(refused.value)):
        memory.predict(params, optimizer=optimizer, options=options)
