"""The step's cost model (fusedoff/costs.py), its calibration (fusedoff/calibrate.py) and the planner
(`python -m fusedoff.plan`): bytes against hand counts from the stored forms' definitions, seconds
against hand computations, the best host share against a brute-force search, the command's table
and its errors."""

from __future__ import annotations

import json

import pytest
import torch

import fusedoff
from fusedoff import calibrate, costs
from fusedoff import plan as planner

BF16 = torch.bfloat16

# Per element of bf16 parameters and gradients, written by hand from the forms' definitions (fp32
# moments 4 bytes each, bf16 2, 8-bit 1 code + one fp32 scale per 256 elements; an fp32 master 4,
# split 2 low bytes, split8 1): (states, master, streamed each way, kernel read + written). The
# kernel reads the gradient (2), the states and the master, and the parameter where no whole fp32
# master stands for it; it writes the states, the master and the parameter (2).
SCALES = 2 * 4 / 256  # two 8-bit moments' fp32 scales per element
ADAMW_BYTES = {
    ("fp32", "fp32"): (8, 4, 12, 2 + 12 + 12 + 2),
    ("fp32", "split"): (8, 2, 10, 2 + 2 + 10 + 10 + 2),
    ("fp32", "split8"): (8, 1, 9, 2 + 2 + 9 + 9 + 2),
    ("fp32", "none"): (8, 0, 8, 2 + 2 + 8 + 8 + 2),
    ("bf16", "fp32"): (4, 4, 8, 2 + 8 + 8 + 2),
    ("bf16", "split"): (4, 2, 6, 2 + 2 + 6 + 6 + 2),
    ("bf16", "none"): (4, 0, 4, 2 + 2 + 4 + 4 + 2),
    ("8bit", "fp32"): (2 + SCALES, 4, 6 + SCALES, 2 + 2 * (6 + SCALES) + 2),
    ("8bit", "split8"): (2 + SCALES, 1, 3 + SCALES, 2 + 2 + 2 * (3 + SCALES) + 2),
}


@pytest.mark.parametrize("state,master", list(ADAMW_BYTES), ids=[f"{s}-{m}" for s, m in ADAMW_BYTES])
@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_bytes_per_element_are_the_forms_sizes(optimizer, state, master):
    states, master_bytes, streamed, kernel = ADAMW_BYTES[state, master]
    b = costs.element_bytes(costs.Setup(optimizer, BF16, None, state, master))
    assert (b.states, b.master, b.stream_h2d, b.stream_d2h, b.kernel) == pytest.approx(
        (states, master_bytes, streamed, streamed, kernel), abs=1e-12)
    # host-computed: the parameter up; the gradient and the parameter down; both staged in host memory
    assert (b.param, b.grad, b.host_h2d, b.host_d2h, b.host_staging) == (2, 2, 2, 2 + 2, 2 + 2)


@pytest.mark.parametrize("param,grad,up,down", [
    (BF16, torch.float32, 2, 4 + 2),  # fp32 gradients of bf16 parameters: the gradient's own dtype goes down
    (torch.float32, None, 4, 4 + 4),
    (torch.float16, torch.float32, 2, 4 + 2),
])
def test_a_host_computed_element_moves_its_gradient_and_parameter_down_and_its_parameter_up(param, grad, up, down):
    master = "fp32" if param != torch.float32 else "none"
    b = costs.element_bytes(costs.Setup("adamw", param, grad, "fp32", master))
    assert (b.host_h2d, b.host_d2h, b.host_staging) == (up, down, down)


@pytest.mark.parametrize("grad_dtype", [BF16, torch.float32])
def test_the_host_computed_bytes_are_the_engines(grad_dtype):
    """The engine's host share (fusedoff/offload/host_share.py), every tensor host-computed: the
    link bytes its copies counted in one step, and its page-locked buffers, per element, are the
    model's. Per bucket besides: the step counts (fp32, one per tensor) go down too, and the
    buffers hold them with the scale and found_inf, 16-element aligned."""
    numels = (256, 512, 1024)  # multiples of the alignment: no padding
    params = [torch.nn.Parameter(torch.randn(n, dtype=BF16)) for n in numels]
    opt = fusedoff.AdamW(params, lr=1e-3, offload="stream", chunk_size=256, backend="cpu", host_share=1.0)
    for p in params:
        p.grad_dtype = grad_dtype
        p.grad = torch.randn(p.shape, dtype=grad_dtype)
    opt.step()
    stats, n = opt.memory_stats(), sum(numels)
    b = costs.element_bytes(costs.Setup("adamw", BF16, grad_dtype, "fp32", "fp32"))
    grad = grad_dtype.itemsize
    assert stats["host_computed_params"] == n
    assert stats["link_bytes_last_step"] == {"to_device": 2 * n, "to_host": (grad + 2) * n + 4 * len(numels)}
    assert (b.host_h2d * n, b.host_d2h * n) == (2 * n, (grad + 2) * n)
    assert stats["host_share_buffer_bytes"] == (grad + 2) * n + 4 * 16 == b.host_staging * n + 4 * 16


def test_apollo_bytes_count_each_phase():
    """Apollo's defaults (constant rebound, no weight decay): a reduction over the three fp32 moments,
    then the update of the moments and the master. A streamed tensor spanning chunks copies in what
    each phase reads (12, then 16) and out what it writes (16)."""
    b = costs.element_bytes(costs.Setup("apollo", BF16, None, "fp32", "fp32"))
    assert (b.states, b.master, b.stream_h2d, b.stream_d2h) == (12, 4, 12 + 16, 16)
    assert b.kernel == (2 + 12) + (2 + 16 + 16) + 2


def test_fp32_parameters_keep_no_master_and_read_and_write_themselves():
    b = costs.element_bytes(costs.Setup("adamw", torch.float32, None, "fp32", "none"))
    assert (b.states, b.master, b.kernel) == (8, 0, 4 + 8 + 4 + 8 + 4)
    with pytest.raises(ValueError, match="keep no master"):
        costs.Setup("adamw", torch.float32, None, "fp32", "fp32")
    with pytest.raises(ValueError, match="bfloat16"):
        costs.Setup("adamw", torch.float16, None, "fp32", "split")
    with pytest.raises(ValueError, match="fp32 states only"):
        costs.element_bytes(costs.Setup("apollo", BF16, None, "bf16", "fp32"))


def test_seven_billion_parameters_move_and_hold_the_published_bytes():
    """The issue's case: fp32 states and masters, bf16 parameters and gradients, 7e9 elements."""
    setup = costs.Setup()
    rates = costs.preset("h100-pcie5")
    n = 7 * 10**9
    streamed = costs.predict_step(setup, rates, n)
    assert (streamed.h2d_bytes, streamed.d2h_bytes, streamed.host_bytes) == (12 * n, 12 * n, 12 * n)
    buffers = 2 * 3 * 4 * 2**22  # two buffer sets of three fp32 states (m, v, master) of a 4M-element chunk
    assert streamed.device_bytes == 4 * n + buffers
    resident = costs.predict_step(setup, rates, n, resident=n)
    assert (resident.h2d_bytes, resident.host_bytes, resident.device_bytes) == (0, 0, 16 * n)
    # Every element host-computed: the parameter up (2), the gradient and parameter down (2 + 2); in
    # host memory the states and masters (12) and the staged parameter and gradient (2 + 2).
    hosted = costs.predict_step(setup, rates, n, host_share=1.0)
    assert (hosted.h2d_bytes, hosted.d2h_bytes, hosted.host_bytes) == (2 * n, 4 * n, 16 * n)
    assert hosted.device_bytes == 4 * n  # no streaming buffers


def test_step_time_against_a_hand_computation():
    rates = costs.Rates("hand", h2d=10.0, d2h=20.0, both=25.0, device_memory=100.0, host_memory=50.0)
    p = costs.predict_step(costs.Setup(), rates, 100, resident=20, host_share=0.25)
    assert (p.resident, p.streamed, p.host) == (20, 60, 20)
    # h2d: 60 streamed x 12 + 20 parameters x 2; d2h: 60 x 12 + 20 x (2 gradient + 2 parameter)
    assert (p.h2d_bytes, p.d2h_bytes) == (760, 800)
    # Host memory: the host kernel's 28 bytes over its 20 elements, and every byte the link moves.
    assert p.terms == pytest.approx({"h2d": 76.0, "d2h": 40.0, "both": 62.4, "device": 80 * 28 / 100,
                                     "host memory": (20 * 28 + 760 + 800) / 50, "host kernel": 0.0})
    assert (p.step_s, p.bound) == (pytest.approx(76.0), "link")
    assert p.host_bytes == 80 * 12 + 20 * (2 + 2)
    # Nothing stepped on the host: the streamed copies alone cross host memory (80 x 24 bytes).
    streamed = costs.predict_step(costs.Setup(), rates, 100, resident=20)
    assert streamed.terms["host memory"] == pytest.approx(80 * 24 / 50) and streamed.terms["host kernel"] == 0
    # A measured host kernel rate adds the kernel's own term (20 elements at 0.25 per second).
    measured = costs.Rates("hand", 10.0, 20.0, 25.0, 100.0, 50.0, host_kernel={("adamw", "fp32", "fp32"): 0.25})
    p = costs.predict_step(costs.Setup(), measured, 100, resident=20, host_share=0.25)
    assert (p.terms["host kernel"], p.step_s, p.bound) == (pytest.approx(80.0), pytest.approx(80.0), "host kernel")
    assert p.terms["host memory"] == pytest.approx((20 * 28 + 1560) / 50)


@pytest.mark.parametrize("rates", ["h100-pcie5", "workstation-pcie4", "fast host memory", "slow host kernel"])
@pytest.mark.parametrize("state,master", [("fp32", "fp32"), ("bf16", "split"), ("8bit", "none")])
@pytest.mark.parametrize("resident_share", [0.0, 0.3])
def test_best_host_share_is_the_brute_force_minimum(rates, state, master, resident_share):
    if rates == "fast host memory":
        rates = costs.Rates("fast", 25e9, 25e9, 45e9, 1e12, 120e9)
    elif rates == "slow host kernel":
        rates = costs.Rates("slow", 55e9, 55e9, 100e9, 3e12, 200e9, host_kernel={("adamw", state, master): 2e9})
    else:
        rates = costs.preset(rates)
    setup = costs.Setup("adamw", BF16, None, state, master)
    n = 10**9
    resident = int(resident_share * n)
    best = costs.best_host_share(setup, rates, n, resident=resident)
    brute = min(costs.predict_step(setup, rates, n, resident=resident, host_share=k / 2000).step_s for k in range(2001))
    assert best.step_s <= brute * (1 + 1e-9)
    assert best.step_s >= brute * (1 - 1e-3)  # the grid's spacing from the exact minimum
    assert best.resident == resident and best.streamed + best.host == n - resident


def test_best_host_share_never_takes_resident_states():
    rates = costs.preset("workstation-pcie4")
    n = 10**6
    everything = costs.best_host_share(costs.Setup(), rates, n, resident=n)
    assert (everything.resident, everything.host, everything.host_share) == (n, 0, 0.0)
    some = costs.best_host_share(costs.Setup(), rates, n, resident=n // 2)
    assert some.resident == n // 2 and 0 < some.host < n // 2


def test_no_host_share_pays_on_the_h100_preset():
    """h100-pcie5: 75 GB/s of host memory per GPU against 100 GB/s over the link both ways. A streamed
    step crosses host memory with its copies both ways, so host memory bounds it (7B x 24 bytes / 75
    GB/s = 2240 ms for fp32 states and masters); a host-computed element crosses it with more (its
    kernel's bytes, its gradient and parameter down and its parameter up), so the best share is none,
    for every precision."""
    rates = costs.preset("h100-pcie5")
    n = 7 * 10**9
    for (state, master), (_, _, each_way, _) in ADAMW_BYTES.items():
        setup = costs.Setup("adamw", BF16, None, state, master)
        streamed = costs.predict_step(setup, rates, n)
        assert (streamed.step_s, streamed.bound) == (pytest.approx(n * 2 * each_way / 75e9), "host memory")
        best = costs.best_host_share(setup, rates, n)
        assert (best.host, best.step_s) == (0, pytest.approx(streamed.step_s)), (state, master)
    apollo = costs.Setup("apollo", BF16, None, "fp32", "fp32")
    assert costs.best_host_share(apollo, rates, n).host == 0


# workstation-pcie4 (25 GB/s each way, 45 both, 80 GB/s of host memory): the link bounds streaming.
# Per element, at a share x: s bytes each way streamed; host-computed 2 up (the parameter), 2 + 2 down
# (the gradient and the parameter) and k kernel bytes through host memory. The terms, in bytes / (GB/s):
#   h2d (s(1 - x) + 2x) / 25, d2h (s(1 - x) + 4x) / 25, both (2s(1 - x) + 6x) / 45,
#   host memory (2s(1 - x) + (k + 6)x) / 80.
# The best share is where the falling link term meets the first rising one:
# - fp32 states and masters (s 12, k 28): both (24 - 18x) / 45 meets host memory (24 + 10x) / 80 at
#   x = 4 / 9 (d2h, (12 - 8x) / 25, is below it there): 16 / 45 against 24 / 45, 2 / 3 of streaming's.
# - bf16 states, no master (s 4, k 14): both (8 - 2x) / 45 meets d2h, 4 / 25 at any x, at x = 2 / 5,
#   where host memory (8 + 12x) / 80 is 4 / 25 too: 9 / 10 of streaming's.
# - 8-bit states, split8 masters (s 3 + 1/32 = 97/32 with the scales, k 12 + 1/16): both (97 - x) / 720
#   falls slowly and meets d2h (97 + 31x) / 800 at x = 7760 / 23120 = 97 / 289: 1 - x / 97 = 288 / 289.
# - 8-bit states, no master (s 2 + 1/32): a host-computed element moves 6 bytes over the link, more
#   than the 4 + 1/16 a streamed one does: no share, 1.
# - Apollo copies 28 bytes up (12, then 16: a phase each) and 16 down, k 50: h2d (28 - 26x) / 25 binds
#   and meets host memory (44 + 12x) / 80 at x = 1140 / 2380, the step 1 - 26x / 28 of streaming's.
WORKSTATION = {
    ("adamw", "fp32", "fp32"): (4 / 9, 2 / 3),
    ("adamw", "bf16", "none"): (2 / 5, 9 / 10),
    ("adamw", "8bit", "split8"): (97 / 289, 288 / 289),
    ("adamw", "8bit", "none"): (0.0, 1.0),
    ("apollo", "fp32", "fp32"): (1140 / 2380, 1 - 26 / 28 * 1140 / 2380),
}


@pytest.mark.parametrize("optimizer,state,master", list(WORKSTATION), ids=["-".join(k) for k in WORKSTATION])
def test_the_host_share_on_the_workstation_preset(optimizer, state, master):
    """The issue's target for 7B fp32 states was 0.6x of streaming only here: the model gives 2/3
    (0.67). Compressed states gain less (their streamed bytes come nearer the 6 a host-computed
    element moves instead, or fall below them); Apollo's extra copies gain more."""
    share, ratio = WORKSTATION[optimizer, state, master]
    setup = costs.Setup(optimizer, BF16, None, state, master)
    rates = costs.preset("workstation-pcie4")
    n = 7 * 10**9
    streamed = costs.predict_step(setup, rates, n)
    best = costs.best_host_share(setup, rates, n)
    assert (best.host_share, best.step_s / streamed.step_s) == (pytest.approx(share, abs=1e-9),
                                                                pytest.approx(ratio, rel=1e-9))
    assert streamed.bound == "link"


def test_calibration_fills_what_it_did_not_measure_from_a_preset():
    base = costs.preset("h100-pcie5")
    measured = calibrate.Calibration(threads=3, numel=1, host_kernel={("adamw", "fp32", "fp32"): 7e8},
                                     host_copy=4e9, host_inplace=6e9).rates(base)
    assert measured.name == "measured host + h100-pcie5"
    assert (measured.h2d, measured.both, measured.device_memory) == (base.h2d, base.both, base.device_memory)
    assert (measured.host_memory, measured.host_threads, measured.host_elements_per_s(costs.Setup())) == (6e9, 3, 7e8)
    assert measured.host_elements_per_s(costs.Setup("adam")) == 7e8  # Adam runs AdamW's kernel


def test_calibration_times_the_host_kernel():
    rates = calibrate.measure_host_kernel(1, numel=4096, repeats=1, warmup=0, setups=[("adamw", "8bit", "split8")])
    assert list(rates) == [("adamw", "8bit", "split8")] and rates["adamw", "8bit", "split8"] > 0


# ---- the command ----------------------------------------------------------------------------------

# hidden 64, 2 layers, MLP 128, vocab 100, 4 heads of 16, 2 key/value heads: embeddings 100 x 64 twice
# (untied); per layer q 64 x 64, k and v 64 x 32 each, o 64 x 64, gate/up/down 3 x 64 x 128, 2 norms of 64;
# the final norm 64.
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=100, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False, model_type="llama")
TINY_PARAMS = 2 * 6400 + 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192 + 2 * 64) + 64


def write_config(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY, **changes}))
    return path


@pytest.mark.parametrize("config,published", [
    # Llama 2 7B and Llama 3 8B: their config.json's figures, and the counts published for them.
    (dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=32,
          num_key_value_heads=32, vocab_size=32000), 6_738_415_616),
    (dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32,
          num_key_value_heads=8, vocab_size=128256), 8_030_261_248),
], ids=["llama-2-7b", "llama-3-8b"])
def test_config_parameter_count_of_published_models(tmp_path, config, published):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "model_type": "llama", "tie_word_embeddings": False}))
    assert planner.config_params(path) == published


def test_config_parameter_count(tmp_path):
    assert planner.config_params(write_config(tmp_path)) == TINY_PARAMS == 86848
    assert planner.config_params(write_config(tmp_path, tie_word_embeddings=True)) == TINY_PARAMS - 6400
    assert planner.config_params(write_config(tmp_path, attention_bias=True)) == TINY_PARAMS + 2 * (64 + 2 * 32 + 64)


def table_rows(out: str) -> list[dict[str, str]]:
    """The printed table's rows, by column header (the mark's column is "")."""
    lines = [line for line in out.splitlines() if line.startswith("|") and not line.startswith("|---")]
    header, *rows = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    return [dict(zip(header, row)) for row in rows]


def by_setup(rows: list[dict[str, str]]) -> dict[tuple[str, str, str], dict[str, str]]:
    return {(row["states"], row["master"], row["placement"]): row for row in rows}


def test_the_command_on_a_config(tmp_path, capsys):
    planner.main(["--config", str(write_config(tmp_path)), "--rates", "workstation-pcie4"])
    out = capsys.readouterr().out
    assert "86,848 parameters" in out
    rows = table_rows(out)
    assert len(rows) == 3 * 4 * 4  # states x masters x placements
    chosen = [row for row in rows if row[""] == "*"]
    # Everything fits in 80 GB: resident is fastest, for the default precisions.
    assert [(row["states"], row["master"], row["placement"], row["fits"]) for row in chosen] == [
        ("fp32", "fp32", "resident", "yes")]
    # offload='auto' keeps every state resident where all fit: no host share, the resident step.
    auto = by_setup(rows)["fp32", "fp32", "auto + host share"]
    assert (auto["resident"], auto["host share"], auto["step ms"]) == (
        "1.00", "0.00", by_setup(rows)["fp32", "fp32", "resident"]["step ms"])


def test_the_command_chooses_the_auto_budget_and_a_host_share_when_states_do_not_fit(capsys):
    planner.main(["--params", "7e9", "--rates", "h100-pcie5", "--gpu-memory", "80GB"])
    rows = table_rows(capsys.readouterr().out)
    fp32 = {placement: row for (state, master, placement), row in by_setup(rows).items()
            if (state, master) == ("fp32", "fp32")}
    assert fp32["resident"]["fits"] == "no"  # 16 bytes x 7e9 = 112 GB
    assert [row["placement"] for row in rows if row[""] == "*"] == ["auto + host share"]
    # The resident states shorten the step; on this preset a host share never does (host memory bounds).
    assert float(fp32["auto + host share"]["step ms"]) < float(fp32["host share"]["step ms"]) \
        == float(fp32["streamed"]["step ms"])
    assert fp32["auto + host share"]["host share"] == fp32["host share"]["host share"] == "0.00"
    # 72 GB of the 80 (10% headroom): the parameters and gradients (28 GB), the buffers, the resident states.
    assert fp32["auto + host share"]["GPU GB"] == "72.0"


def test_auto_resident_is_the_engines_automatic_budget():
    buffers = 2 * 3 * 4 * 2**22
    available = 72 * 10**9 - 4 * 7 * 10**9  # 90% of 80 GB, less the bf16 parameters and gradients
    assert costs.auto_resident(costs.Setup(), 7 * 10**9, 80 * 10**9) == (available - buffers) // 12
    assert costs.auto_resident(costs.Setup(), 10**9, 80 * 10**9) == 10**9  # 16 GB fit whole
    assert costs.auto_resident(costs.Setup(), 7 * 10**9, 20 * 10**9) == 0  # not even the parameters fit


def test_the_command_shows_host_memory_bounding_the_h100_presets_streamed_step(capsys):
    planner.main(["--params", "7e9", "--rates", "h100-pcie5"])
    rows = by_setup(table_rows(capsys.readouterr().out))
    streamed = rows["fp32", "fp32", "streamed"]
    assert (streamed["bound"], streamed["step ms"]) == ("host memory", "2240")  # 7e9 x 24 bytes / 75 GB/s


def test_the_command_with_measured_rates_takes_the_host_kernels_rate(capsys, monkeypatch):
    """--rates measured: the host side as measured (here a stand-in for the measurement), the link and
    the device from the H100 preset where there is no GPU."""
    measured = calibrate.Calibration(threads=2, numel=1, host_kernel={("adamw", "fp32", "fp32"): 1e9},
                                     host_copy=5e10, host_inplace=2e11)
    monkeypatch.setattr(calibrate, "measure", lambda threads=None: measured)
    planner.main(["--params", "7e9", "--rates", "measured"])
    out = capsys.readouterr().out
    assert "rates measured host + h100-pcie5:" in out and "its kernel measured on 2 threads" in out
    rows = by_setup(table_rows(out))
    # Per element, the link (24 (1 - x) + 6 x bytes at 100 GB/s: 0.24 - 0.18 x ns; d2h, (12 - 8 x) / 55,
    # is below it) meets the measured host kernel (x ns at 1e9 elements/s) at x = 0.24 / 1.18 = 0.203,
    # where host memory (24 + 10 x bytes at 200 GB/s: 0.130 ns) has room: the rate decides.
    assert rows["fp32", "fp32", "host share"]["host share"] == "0.20"
    # A setup it did not measure is timed by its bytes at the measured bandwidth: bf16 states with fp32
    # masters, 16 (1 - x) streamed + (20 + 6) x host-computed bytes at 200 GB/s against the link's
    # (16 - 10 x) / 100 ns: x = 8 / 15 (where d2h, (8 - 4 x) / 55, comes to the same 8 / 75 ns).
    assert rows["bf16", "fp32", "host share"]["host share"] == "0.53"


def test_the_command_says_when_nothing_fits(tmp_path, capsys):
    # 800 KB: 8-bit states without masters fit resident (86848 x (4 + 2 + 1/32) bytes), bf16 states
    # with fp32 masters (12 bytes more each) do not, and nothing streamed does (its buffers).
    planner.main(["--config", str(write_config(tmp_path)), "--gpu-memory", "800KB", "--state-precision", "bf16"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert not [row for row in rows if row[""] == "*"]
    assert by_setup(rows)["8bit", "none", "resident"]["fits"] == "yes"
    assert "nothing fits with bf16 states: see the rows that fit above" in out
    # With 1 MB reserved, no row fits: the least any needs is said.
    planner.main(["--config", str(write_config(tmp_path)), "--gpu-memory", "800KB", "--reserve", "1MB"])
    out = capsys.readouterr().out
    assert not [row for row in table_rows(out) if row["fits"] == "yes"]
    least = (TINY_PARAMS * (2 + 2 + 2 + 2 * 4 / 256) + 10**6) / 1e9
    assert f"nothing fits: every row needs {least:.3g} GB of GPU memory or more" in out


@pytest.mark.parametrize("argv,message", [
    (["--params", "0"], "must be positive"),
    (["--params=-7e9"], "positive number"),
    (["--params", "seven"], "positive number"),
    (["--params", "7X"], "positive number"),
    (["--params", "1e400"], "must be positive"),
    (["--params", "7e9", "--gpu-memory", "80 parsecs"], "memory size"),
    (["--params", "7e9", "--gpu-memory", "0GB"], "must be positive"),
    (["--params", "7e9", "--host-memory=-1TB"], "memory size"),
    (["--params", "7e9", "--threads", "0", "--rates", "measured"], "at least 1"),
    (["--params", "7e9", "--param-dtype", "fp32", "--master-precision", "fp32"], "keep no master"),
    (["--params", "7e9", "--optimizer", "apollo", "--state-precision", "8bit"], "fp32 states only"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        planner.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "one JSON object"),
    (json.dumps({k: v for k, v in TINY.items() if k != "intermediate_size"}), "no intermediate_size"),
    (json.dumps({**TINY, "hidden_size": -64}), "hidden_size must be a positive integer"),
    (json.dumps({**TINY, "num_hidden_layers": "2"}), "num_hidden_layers must be a positive integer"),
    (json.dumps({**TINY, "num_local_experts": 8}), "mixture of experts"),
    (json.dumps({**TINY, "num_key_value_heads": 3}), "not a multiple of num_key_value_heads"),
])
def test_unreadable_configs_exit_2_with_a_message(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        planner.main(["--config", str(path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
