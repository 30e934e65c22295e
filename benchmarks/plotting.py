"""The benchmarks' figures, drawn alike and written once.

  * ``figure``: a row of panels, drawn without a display (Agg), titled, laid out and saved; matplotlib is
    the bench extra's, so a script without it catches the ImportError and says so.
  * ``category_axis``: bar labels that never print on top of each other: wrapped at underscores and
    spaces, and turned when they would still collide.
  * ``size_axis`` and ``mark_loaded``: the log2 parameter axis of a sweep, and the rows timed while other
    processes used the CPUs.
  * ``step_bars``: median step time per contender against its bound, one panel per group (the chart
    bench_apollo, bench_cpu_adam and bench_host_cost share).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

CHARACTER_WIDTH = 0.6  # a label character's width, in units of its font size (DejaVu Sans, on average)


def pyplot():
    """matplotlib.pyplot on the Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def figure(path: Path, title: str, panels: int = 1, *, panel_size: tuple[float, float] = (6.0, 4.8),
           dpi: int = 120, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Iterator[tuple]:
    """Yields (figure, [axes]) for `panels` panels side by side; then titles, lays out (within `rect`,
    the rest left to a figure legend) and saves them to `path`. Raises ImportError without matplotlib."""
    plt = pyplot()
    fig, axes = plt.subplots(1, panels, figsize=(panel_size[0] * panels, panel_size[1]), squeeze=False)
    try:
        yield fig, list(axes[0])
        fig.suptitle(title, fontsize=9)
        fig.tight_layout(rect=rect)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def wrap_label(label: str, width: int) -> str:
    """`label` in lines of at most `width` characters where it can be broken: after an underscore, at a
    space, or at a line break already in it."""
    lines = []
    for part in label.split("\n"):
        line = ""
        for piece in re.findall(r"[^_ ]+_?|_| ", part):
            if piece == " ":
                line += " "
                continue
            if line.strip() and len(line.rstrip()) + len(piece) > width:
                lines.append(line.rstrip())
                line = ""
            line += piece
        lines.append(line.rstrip())
    return "\n".join(lines)


def category_axis(ax, labels: Sequence[str], *, width: int = 12, fontsize: int = 8) -> None:
    """Ticks 0 .. n-1 labelled with `labels`, wrapped at `width` characters, and turned 30 degrees
    (anchored at their right end, under their bar) when even wrapped they are wider than their share of
    the panel."""
    wrapped = [wrap_label(str(label), width) for label in labels]
    longest = max((len(line) for label in wrapped for line in label.split("\n")), default=0)
    panel_points = ax.get_position().width * ax.figure.get_figwidth() * 72
    share = panel_points / max(len(labels), 1)
    turned = (longest + 1) * CHARACTER_WIDTH * fontsize > share
    ax.set_xticks(range(len(labels)), wrapped, fontsize=fontsize)
    if turned:
        ax.tick_params(axis="x", labelrotation=30)
        for text in ax.get_xticklabels():
            text.set_horizontalalignment("right")
            text.set_rotation_mode("anchor")


def size_axis(ax) -> None:
    """A log2 axis of parameter counts labelled 16M, 1G, ..."""
    from matplotlib.ticker import FuncFormatter

    from benchmarks import timing

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: timing.format_size(int(x))))


def mark_loaded(ax, rows: Sequence[Mapping], x: str, y: str, loaded: Callable[[Mapping], bool], note: str) -> None:
    """A black cross on each row timed under load (`loaded(row)`), labelled `note` once."""
    marked = [r for r in rows if loaded(r)]
    if marked:
        ax.scatter([r[x] for r in marked], [r[y] for r in marked], marker="x", s=40, color="black", zorder=4,
                   label=note)


def step_bars(groups: Mapping[str, Sequence[Mapping[str, object]]], path: Path, title: str,
              label: Callable[[Mapping[str, object]], str], highlight: Callable[[Mapping[str, object]], bool]) -> None:
    """One panel per group: median step time per contender (whiskers p10-p90), the bound as a red tick.

    Rows need ms_median, ms_q10, ms_q90, bound_ms and bytes_per_param.
    """
    with figure(path, title, len(groups), panel_size=(5, 4.8), rect=(0, 0.06, 1, 1)) as (fig, axes):
        for ax, (name, rs) in zip(axes, groups.items()):
            x = list(range(len(rs)))
            err = [[r["ms_median"] - r["ms_q10"] for r in rs], [r["ms_q90"] - r["ms_median"] for r in rs]]
            colors = ["tab:green" if highlight(r) else "tab:gray" for r in rs]
            ax.bar(x, [r["ms_median"] for r in rs], yerr=err, capsize=4, color=colors,
                   label="median step (whiskers p10-p90)")
            ax.scatter(x, [r["bound_ms"] for r in rs], marker="_", s=900, color="tab:red", zorder=3,
                       label="bandwidth bound: bytes / best in-place pass")
            for i, r in enumerate(rs):
                ax.annotate(f"{r['ms_median']:.1f} ms\n{r['bytes_per_param']} B/param", (i, 0), ha="center",
                            va="bottom", xytext=(0, 4), textcoords="offset points", fontsize=8, color="white")
            category_axis(ax, [label(r) for r in rs])
            ax.set_ylabel("step time, ms")
            ax.set_title(name)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
