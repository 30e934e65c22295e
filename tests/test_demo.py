"""The README's first command: the demo trains with both optimizers and reports their agreement."""

from fusedoff import demo


def test_demo_runs_and_the_two_optimizers_agree(capsys):
    status = demo.main(["--steps", "12", "--model-size", "32", "--context", "32", "--batch", "8", "--window", "4"])
    out = capsys.readouterr().out
    assert "torch.optim.AdamW" in out and "fusedoff.AdamW" in out
    assert status == 0, out
    assert ": OK" in out


def test_demo_fails_loudly_when_runs_disagree(capsys):
    # A tolerance nobody can meet exercises the FAIL path: the agreement check can fail.
    status = demo.main(["--steps", "6", "--model-size", "32", "--context", "32", "--batch", "8", "--window", "1",
                        "--tolerance", "0", "--lr", "0.05"])
    out = capsys.readouterr().out
    assert status == 1 and ": FAIL" in out
