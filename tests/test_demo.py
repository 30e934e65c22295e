"""The README's first command: the demo trains with both optimizers, reports their agreement and
where the memory goes. Tiny models and a few steps: a second or two a run on an idle 2-core machine."""

import dataclasses

import pytest
import torch

from fusedoff import demo
from tests.optional_packages import require

TINY = ["--steps", "8", "--model-size", "32", "--context", "32", "--batch", "8", "--window", "4", "--timing-rounds", "3"]


def run_demo(capsys, *extra):
    status = demo.main([*TINY, *extra])
    return status, capsys.readouterr().out


def test_demo_runs_and_the_two_optimizers_agree(capsys):
    status, out = run_demo(capsys)
    assert "torch.optim.AdamW" in out and "fusedoff.AdamW" in out
    assert status == 0, out
    assert "the two runs agree: OK" in out
    for phase in ("forward", "backward", "step"):
        assert f" {phase} " in out
    assert "fp32 gradient copies" in out and "streaming buffers" in out
    # the step timed alone, the runs alternating: each run's median and spread, its share of a
    # training step, and the round-by-round ratio
    assert "the two runs alternating for 3 rounds" in out
    for name in ("torch.optim.AdamW", "fusedoff.AdamW"):
        line = next(line for line in out.splitlines() if line.startswith(f"  {name} ") and " step " in line)
        assert "% of its training step" in line, line
    assert "fusedoff.AdamW / torch.optim.AdamW, round by round: " in out


def test_quantiles_interpolate_between_order_statistics():
    samples = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert [demo.quantile(samples, q) for q in (0.0, 0.1, 0.5, 0.9, 1.0)] == pytest.approx([1.0, 1.4, 3.0, 4.6, 5.0])
    assert demo.quantile([7.0], 0.9) == 7.0
    assert demo.spread([1.0, 2.0, 3.0]) == "2.00 [1.20-2.80]"


def test_demo_fails_loudly_when_an_update_is_ten_percent_off(capsys, monkeypatch):
    # At the demo's own tolerances: fusedoff with a 10% larger lr must not pass as agreeing.
    make_optimizer = demo.make_optimizer

    def ten_percent_off(which, model, cfg):
        return make_optimizer(which, model, dataclasses.replace(cfg, lr=cfg.lr * 1.1) if which == "fusedoff" else cfg)

    monkeypatch.setattr(demo, "make_optimizer", ten_percent_off)
    status, out = run_demo(capsys, "--steps", "4")
    assert status == 1 and "the two runs agree: FAIL" in out
    early = next(line for line in out.splitlines() if line.startswith("first 4 steps"))
    assert float(early.split("difference ")[1].split()[0]) > 10 * demo.EARLY_TOLERANCE[torch.float32], early


def test_demo_bf16_recipe_of_the_gpu_runs_on_cpu(capsys):
    # The GPU's recipe (bf16 parameters, torch with fp32 masters and upcast gradients against
    # fusedoff streaming states and masters from host memory), on CPU: agreement, and the
    # optimizer's own memory_stats equal to the prediction.
    status, out = run_demo(capsys, "--dtype", "bfloat16", "--offload", "stream")
    assert status == 0, out
    assert "torch.optim.AdamW + fp32 upcast" in out and "offload=stream" in out
    assert "memory_stats(): states on the device 0.00 MiB" in out and "as predicted" in out
    assert "torch + upcast" in out and "torch on bfloat16" in out  # the alternatives' columns


def test_demo_device_budget_splits_states_as_predicted(capsys):
    # 100,000 bytes of the tiny model's 0.21 MiB of AdamW states stay in place, the rest stream.
    status, out = run_demo(capsys, "--device-budget", "100000")
    assert status == 0, out
    line = next(line for line in out.splitlines() if "memory_stats():" in line)
    resident = float(line.split("states on the device ")[1].split(" MiB")[0])
    streamed = float(line.split("streamed ")[1].split(" MiB")[0])
    assert 0 < resident <= 100000 / 2**20 and streamed > 0.05 and "as predicted" in line


def test_demo_apollo_against_the_reference(capsys):
    status, out = run_demo(capsys, "--optimizer", "apollo")
    assert status == 0, out
    assert "ApolloReference" in out and "fusedoff.Apollo" in out


def test_demo_plot(capsys, tmp_path):
    require("matplotlib")
    path = tmp_path / "memory.png"
    status, out = run_demo(capsys, "--steps", "2", "--plot", str(path))
    assert status == 0, out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_fails_when_memory_stats_differ_from_the_prediction(capsys, monkeypatch):
    monkeypatch.setattr(demo.memory, "check_memory_stats", lambda prediction, stats: ["host_bytes 1 != predicted 2"])
    status, out = run_demo(capsys, "--steps", "3")
    assert status == 1 and "DIFFERS from the prediction: host_bytes 1 != predicted 2" in out
