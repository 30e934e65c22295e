"""Training quality of split master weights: the demo's model in bf16, one seed, each master precision.

Trains ``fusedoff.demo``'s character transformer with bf16 parameters and gradients from one seed
on the same batches with:
  torch_upcast        the usual mixed precision: fp32 master copies, gradients upcast with
                      ``.float()``, torch.optim.AdamW on the masters, the bf16 parameters copied
                      from them: the reference every row is compared with;
  fusedoff_fp32       fusedoff.AdamW, fp32 master weights (4 bytes per parameter);
  fusedoff_split      master_precision="split" (2 bytes): exact, so its losses must be fusedoff_fp32's
                      to the bit (the row says whether they are);
  fusedoff_split8     master_precision="split8" (1 byte): the master rounded stochastically to 24 bits;
  fusedoff_8bit_split8  8-bit states and split8 masters: the fewest bytes per parameter.
Each row: master and state bytes per parameter, the largest relative difference of the 50-step mean
losses from the reference's, and the final loss (mean of the last 50 steps) and its relative
difference. Targets for the lossy rows: windows within 5%, final loss within 4% (as for 8-bit states).
Writes results/quality_master_precision.csv, a PNG of the loss curves, and its RESULTS.md section.

  python benchmarks/quality_master_precision.py [--steps 300] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing  # noqa: E402
from benchmarks import training_quality as quality  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff import demo  # noqa: E402

TOLERANCE = (0.05, 0.04)  # (50-step windows, final loss) for the lossy rows
LR, WEIGHT_DECAY = demo.LEARNING_RATES["adamw"], 0.01


class UpcastAdamW:
    """torch.optim.AdamW on fp32 copies of bf16 parameters: the usual mixed-precision step."""

    def __init__(self, params):
        self.params = list(params)
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, lr=LR, weight_decay=WEIGHT_DECAY)
        self.state = {}

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _fusedoff(**options):
    return lambda ps: fusedoff.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, **options)


# name: (builder, lossy)
OPTIMIZERS = {
    "torch_upcast": (UpcastAdamW, False),
    "fusedoff_fp32": (_fusedoff(), False),
    "fusedoff_split": (_fusedoff(master_precision="split"), False),
    "fusedoff_split8": (_fusedoff(master_precision="split8"), True),
    "fusedoff_8bit_split8": (_fusedoff(master_precision="split8", state_precision="8bit"), True),
}


def optimizer_bytes(opt, numel: int) -> tuple[float, float]:
    """(master, other state) bytes per parameter that the optimizer keeps (UpcastAdamW: its masters)."""
    if isinstance(opt, UpcastAdamW):
        states = sum(v.numel() * v.element_size() for s in opt.inner.state.values() for k, v in s.items()
                     if k != "step" and isinstance(v, torch.Tensor))
        return 4.0, states / numel
    master = other = 0
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                size = value.numel() * value.element_size()
                master += size if key.startswith("master") else 0
                other += 0 if key.startswith("master") else size
    return master / numel, other / numel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=timing.RESULTS_DIR, help="where the CSV, PNG and RESULTS.md go")
    args = parser.parse_args(argv)

    data, vocab = quality.corpus()
    cfg = demo.Config(device=torch.device(args.device), dtype=torch.bfloat16, optimizer="adamw", offload="none",
                      backend="auto", chunk_size=0, steps=args.steps, lr=LR, seed=args.seed,
                      **demo.PRESETS[args.device])
    curves, rows = {}, []
    for name, (_, lossy) in OPTIMIZERS.items():
        losses, opt, model = quality.train(OPTIMIZERS[name][0], cfg, data, vocab, torch.bfloat16)
        master_bytes, state_bytes = optimizer_bytes(opt, sum(p.numel() for p in model.parameters()))
        curves[name] = losses
        reference = curves["torch_upcast"]
        windows = demo.windowed_agreement(reference, losses, args.window)
        final, final_ref = quality.final_loss(losses, args.window), quality.final_loss(reference, args.window)
        ok = windows <= TOLERANCE[0] and abs(final - final_ref) <= TOLERANCE[1] * final_ref
        row = {"optimizer": name, "master_bytes_per_param": round(master_bytes, 3),
               "state_bytes_per_param": round(state_bytes, 3), "window_max_rel_diff": round(windows, 5),
               "final_loss": round(final, 5), "final_rel_diff": round((final - final_ref) / final_ref, 5),
               "same_losses_as_fusedoff_fp32": (losses == curves["fusedoff_fp32"]) if name != "torch_upcast" else "",
               "within_target": ok if lossy else ""}
        rows.append(row)
        print({k: v for k, v in row.items() if v != ""}, flush=True)

    meta = timing.hardware_metadata(torch.get_num_threads(),
                                    {"steps": args.steps, "window": args.window, "seed": args.seed,
                                     "model": f"demo TinyLM width {cfg.model_size}, {cfg.layers} layers, context "
                                              f"{cfg.context}, batch {cfg.batch}, bf16", "lr": LR})
    args.out.mkdir(parents=True, exist_ok=True)
    timing.write_csv(args.out / "quality_master_precision.csv", rows, meta)
    table = timing.markdown_table(rows, [
        ("optimizer", lambda r: r["optimizer"]),
        ("master B/param", lambda r: f"{r['master_bytes_per_param']:.2f}"),
        ("state B/param", lambda r: f"{r['state_bytes_per_param']:.2f}"),
        (f"max {args.window}-step window diff", lambda r: f"{r['window_max_rel_diff']:.2%}"),
        (f"final loss (last {args.window})", lambda r: f"{r['final_loss']:.4f}"),
        ("vs torch upcast", lambda r: f"{r['final_rel_diff']:+.2%}"),
        ("losses = fusedoff_fp32's", lambda r: {True: "yes, bit for bit", False: "no", "": ""}[r["same_losses_as_fusedoff_fp32"]]),
        ("target 5% / 4%", lambda r: {True: "within", False: "OUTSIDE", "": ""}[r["within_target"]]),
    ])
    print(table)
    picture = quality.plot(curves, args.out / "quality_master_precision.png",
                           "demo model in bf16, one seed: master weight precision", dashed=("fusedoff_split",))
    quality.write_section(args.out, "quality_master_precision",
                          "Training quality by master precision (`quality_master_precision.py`)", meta,
                          f"The demo's model ({meta['model']}), {args.steps} steps, seed {args.seed}, lr {LR}, same "
                          "batches; every row against torch.optim.AdamW on fp32 master copies (gradients upcast).",
                          table, picture)


if __name__ == "__main__":
    main()
