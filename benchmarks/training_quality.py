"""What the training-quality scripts share (quality_state_precision.py, quality_master_precision.py):
the demo's model trained on its corpus from one seed, the losses compared by windows, the curves
plotted and the results written beside the others."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import plotting, timing
from fusedoff import demo


def corpus() -> tuple[torch.Tensor, int]:
    """The demo's character corpus as indices, and its vocabulary size."""
    text = demo.make_corpus(200_000)
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.long), len(chars)


def train(build: Callable, cfg: demo.Config, data: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32):
    """`cfg.steps` steps of the demo's model (parameters in `dtype`) with the optimizer `build(params)`
    makes, on the same batches from `cfg.seed`. Returns the losses, the optimizer and the model."""
    torch.manual_seed(cfg.seed)
    model = demo.TinyLM(vocab, cfg.model_size, cfg.layers, 4, cfg.context).to(cfg.device, dtype)
    opt = build(list(model.parameters()))
    batches = torch.Generator().manual_seed(cfg.seed)
    losses = []
    for _ in range(cfg.steps):
        loss = demo.forward(model, demo.next_batch(data, cfg, batches), vocab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt, model


def final_loss(losses: list[float], window: int) -> float:
    return sum(losses[-window:]) / len(losses[-window:])


def plot(curves: dict[str, list[float]], path: Path, title: str, dashed: tuple[str, ...] = ()) -> Path | None:
    """The 10-step mean of each loss curve; None (and no file) without matplotlib."""
    try:
        with plotting.figure(path, title, panel_size=(8, 4.5)) as (fig, (ax,)):
            for name, losses in curves.items():
                smooth = [sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1])
                          for i in range(len(losses))]
                ax.plot(smooth, label=name, linewidth=1.2, linestyle="--" if name in dashed else "-")
            ax.set(xlabel="step", ylabel="training loss (10-step mean)")
            ax.legend()
    except ImportError:
        return None
    return path


def write_section(out: Path, key: str, title: str, meta: dict, description: str, table: str,
                  picture: Path | None) -> None:
    """`key`'s RESULTS.md section: the command, date, versions and hardware, then the table and plot."""
    section = (f"## {title}\n\n"
               f"`{timing.command_line()}`, {timing.datetime.date.today()}, torch {torch.__version__}.\n"
               f"{timing.hardware_lines(meta)}\n\n{description}\n\n{table}\n"
               + (f"\n![loss curves]({picture.name})\n" if picture else ""))
    timing.update_results_section(out / "RESULTS.md", key, section)
