"""``python -m fusedoff.demo``: train a small language model twice from the same seed, once with a
familiar optimizer and once with fusedoff's, check that the losses agree, and show where the
memory goes (``fusedoff.memory``).

The model is a small decoder-only transformer over the characters of a generated corpus (nothing
is downloaded). On a GPU it trains in bf16 (parameters and gradients) with fp32 master weights:
``torch.optim.AdamW(fused=True)`` runs the usual mixed precision (fp32 master copies, gradients
upcast with ``.float()``), ``fusedoff.AdamW`` keeps its states and masters in host memory and
streams them (offload="stream"). On a CPU both train in fp32 with the C++ cpu backend.
``--optimizer apollo`` compares ``fusedoff.Apollo`` with the eager reference Apollo
(``fusedoff.kernels.reference.ApolloReference``) in the same way.

After training, the optimizer step itself is timed with the two optimizers alternating round by
round (see ``time_steps``), beside the forward and backward passes of the same training steps.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn

try:
    from tqdm import tqdm
except ImportError:  # the `demo` extra; without it the runs show no progress bars
    tqdm = None

import fusedoff
from fusedoff import memory
from fusedoff.kernels.reference import ApolloReference
from fusedoff.offload.plan import ALIGN_ELEMENTS, round_up

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Model and batch by device: about a minute on a 2-core CPU; on a GPU a model large enough that the
# optimizer's bytes show beside the activations.
PRESETS = {
    "cpu": dict(model_size=128, layers=2, context=64, batch=16),
    "cuda": dict(model_size=512, layers=4, context=256, batch=32),
}
# Learning rates that make the loss fall within a few hundred steps. Apollo's step is m / |B| with
# the curvature B floored at 0.01, so its lr is not Adam's: on the CPU model 0.01, 0.03 and 0.1
# all learn (0.03 fastest) and 0.3 diverges; it warms up from lr / 1000 over APOLLO_WARMUP steps.
LEARNING_RATES = {"adamw": 3e-3, "apollo": 0.03}
APOLLO_WARMUP = 50
# NOTE: the agreement check. Two correct implementations round differently (the order of fp32
# sums: ~1e-7 relative per step; with bf16 parameters, now and then a weight that rounds the other
# way, 2**-8 relative), and training amplifies any difference, so the single-step losses of the two
# runs drift apart while both learn equally well. Hence two checks:
# - each of the first 10 steps, before the difference has grown, within EARLY_TOLERANCE: above
#   what two correct runs differ by, below what an update wrong by 10% moves the loss by;
# - the mean losses over windows of 50 steps must agree within 5%, well above what correct runs
#   differ by. (The figures: see 'Demo agreement check' in benchmarks/results/RESULTS.md.)
EARLY_STEPS = 10
EARLY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-3}
WINDOW_TOLERANCE = 0.05
# With compressed states (--state-precision) fusedoff's run differs from the first update on by the
# storage's rounding, so there is no early check; the 50-step windows must agree within the first
# figure and the last window (the final loss) within the second.
COMPRESSED_TOLERANCE = {"bf16": (0.03, 0.02), "8bit": (0.05, 0.04)}
# Rounds of the step timing after training: each round times one training step of each run.
TIMING_ROUNDS = 50
QUANTILES = (0.1, 0.9)


NOUNS = [("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("farmer", "farmers"), ("child", "children"),
         ("teacher", "teachers"), ("king", "kings"), ("fox", "foxes"), ("horse", "horses"), ("sailor", "sailors")]
VERBS = [("sees", "see"), ("likes", "like"), ("follows", "follow"), ("watches", "watch"), ("finds", "find"),
         ("helps", "help"), ("calls", "call")]
ADJECTIVES = ["old", "small", "green", "quiet", "happy", "red", "tall", "brave"]
PLACES = ["near the river", "in the garden", "by the sea", "under the tree", "at the market", "on the hill"]


def make_corpus(num_chars: int, seed: int = 0) -> str:
    """Deterministic text from a small grammar: words to spell, subject-verb agreement to learn,
    and free choices that set the loss's floor. Its loss falls smoothly, without the sudden drops
    of a task learnt all at once, so two runs can be compared step window by step window."""
    rng = random.Random(seed)

    def noun_phrase() -> tuple[str, bool]:
        plural = rng.random() < 0.4
        noun = rng.choice(NOUNS)[plural]
        article = rng.choice(["the", "some"] if plural else ["the", "a"])
        adjective = rng.choice(ADJECTIVES) + " " if rng.random() < 0.5 else ""
        return f"{article} {adjective}{noun}", plural

    out, length = [], 0
    while length < num_chars:
        subject, plural = noun_phrase()
        verb = rng.choice(VERBS)[plural]
        place = " " + rng.choice(PLACES) if rng.random() < 0.3 else ""
        sentence = f"{subject} {verb} {noun_phrase()[0]}{place}. "
        out.append(sentence)
        length += len(sentence)
    return "".join(out)[:num_chars]


class TinyLM(nn.Module):
    """A decoder-only transformer over characters."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        x = self.blocks(x, mask=self.causal[:t, :t].to(x.dtype), is_causal=True)
        return self.head(self.norm(x))


class UpcastMixedPrecision:
    """The mixed precision people write around a torch optimizer: it steps fp32 master copies of
    the parameters, with each low-precision gradient upcast by ``.float()`` into its master's
    ``.grad`` (4 bytes per parameter that fusedoff never allocates), then copies the masters back."""

    def __init__(self, params, make_optimizer) -> None:
        self.params = list(params)
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.optimizer = make_optimizer(self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        for master, p in zip(self.masters, self.params):
            master.grad = p.grad.float()
        self.optimizer.step()
        torch._foreach_copy_(self.params, self.masters)  # rounds to the parameters' dtype


@dataclass
class Config:
    device: torch.device
    dtype: torch.dtype
    optimizer: str
    offload: str
    backend: str
    chunk_size: int
    steps: int
    model_size: int
    layers: int
    context: int
    batch: int
    lr: float
    seed: int
    device_budget: int | None = None
    state_precision: str = "fp32"

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32

    @property
    def streams(self) -> bool:
        """The demo streams on a GPU (a model this small would fit: 'auto' would keep it resident)."""
        return (self.offload == "stream" or (self.offload == "auto" and self.device.type == "cuda")
                or self.device_budget is not None)


def optimizer_names(cfg: Config) -> tuple[str, str]:
    """The names of the baseline run and of the fusedoff run."""
    if cfg.optimizer == "apollo":
        baseline, ours = "ApolloReference", "fusedoff.Apollo"
    else:
        baseline, ours = "torch.optim.AdamW", "fusedoff.AdamW"
    if cfg.state_precision != "fp32":
        ours += f" ({cfg.state_precision} states)"
    return (baseline + " + fp32 upcast" if cfg.low_precision else baseline), ours


def predict(params, setup: str, cfg: Config, offload: str | None = None) -> memory.MemoryPrediction:
    """The memory prediction of one setup, labelled for the report's columns."""
    offload = offload or ("stream" if cfg.streams else "none")
    baseline = "reference" if cfg.optimizer == "apollo" else "torch"
    label = {"fusedoff": f"fusedoff {offload}" + ("" if cfg.state_precision == "fp32" else f" {cfg.state_precision}"),
             "upcast": f"{baseline} + upcast",
             "plain": f"{baseline} on {str(cfg.dtype).removeprefix('torch.')}"}[setup]
    return memory.predict(params, setup=setup, optimizer=cfg.optimizer, offload=offload, chunk_size=cfg.chunk_size,
                          device_budget=cfg.device_budget if offload == "stream" else None, device=cfg.device,
                          label=label, state_precision=cfg.state_precision if setup == "fusedoff" else "fp32")


def make_optimizer(which: str, model: nn.Module, cfg: Config):
    """The optimizer of one run (with zero_grad and step) and the memory prediction of its setup."""
    params = list(model.parameters())
    if which == "fusedoff":
        placement = dict(offload="stream", device_budget=cfg.device_budget) if cfg.streams else dict(offload="none")
        if cfg.optimizer == "apollo":
            opt = fusedoff.Apollo(params, lr=cfg.lr, warmup=APOLLO_WARMUP, backend=cfg.backend,
                                  chunk_size=cfg.chunk_size, **placement)
        else:
            opt = fusedoff.AdamW(params, lr=cfg.lr, weight_decay=0.01, backend=cfg.backend,
                                 chunk_size=cfg.chunk_size, state_precision=cfg.state_precision, **placement)
        return opt, predict(params, "fusedoff", cfg)

    def baseline(tensors):
        if cfg.optimizer == "apollo":
            return ApolloReference(tensors, lr=cfg.lr, warmup=APOLLO_WARMUP)
        return torch.optim.AdamW(tensors, lr=cfg.lr, weight_decay=0.01, fused=True)

    if cfg.low_precision:
        return UpcastMixedPrecision(params, baseline), predict(params, "upcast", cfg)
    return baseline(params), predict(params, "plain", cfg)


@dataclass
class Run:
    name: str
    model: nn.Module
    opt: object  # zero_grad() and step()
    batches: torch.Generator  # the run's stream of batch indices, the same in both runs
    losses: list[float]
    measured: memory.MeasuredRun
    memory_problems: list[str]  # where the optimizer's memory_stats() differ from the prediction
    # time_steps: per round, milliseconds of the forward and backward passes, and of the step
    forward_backward_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def next_batch(corpus: torch.Tensor, cfg: Config, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, len(corpus) - cfg.context - 1, (cfg.batch,), generator=gen)
    return torch.stack([corpus[i : i + cfg.context + 1] for i in idx.tolist()]).to(cfg.device)


def forward(model: nn.Module, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(batch[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))


def train(which: str, cfg: Config, corpus: torch.Tensor, vocab: int) -> Run:
    name = optimizer_names(cfg)[which == "fusedoff"]
    loss_log = torch.zeros(cfg.steps, device=cfg.device)  # before the report: no allocation per step
    report = memory.MemoryReport(cfg.device)
    torch.manual_seed(cfg.seed)
    model = TinyLM(vocab, cfg.model_size, cfg.layers, 4, cfg.context).to(device=cfg.device, dtype=cfg.dtype)
    opt, prediction = make_optimizer(which, model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    bar = None if tqdm is None else tqdm(total=cfg.steps, desc=f"{name:<33}", file=sys.stderr, disable=None,
                                         leave=False)
    for step in range(cfg.steps):
        batch = next_batch(corpus, cfg, gen)
        opt.zero_grad(set_to_none=True)
        with report.phase("forward"):
            loss = forward(model, batch, vocab)  # its logits die on return: autograd keeps what backward needs
        with report.phase("backward"):
            loss.backward()
        with report.phase("step"):
            opt.step()
        loss_log[step] = loss.detach()
        if bar is not None:
            bar.update()
            if step % 10 == 0 or step == cfg.steps - 1:
                bar.set_postfix(loss=f"{loss.item():.3f}")
    if bar is not None:
        bar.close()
    notes, problems = [], []
    if which == "fusedoff":
        stats = opt.memory_stats()
        problems = memory.check_memory_stats(prediction, stats)
        pinned = " (pinned)" if stats["host_pinned"] else ""
        notes.append(f"{name}.memory_stats(): states on the device {stats['resident_bytes'] / memory.MIB:.2f} MiB, "
                     f"streamed {stats['streamed_bytes'] / memory.MIB:.2f} MiB{pinned}, device total "
                     f"{stats['device_bytes'] / memory.MIB:.2f} MiB (budget {stats['device_budget']}): "
                     + ("as predicted" if not problems else "DIFFERS from the prediction: " + "; ".join(problems)))
    return Run(name, model, opt, gen, loss_log.tolist(), memory.MeasuredRun(name, prediction, report, notes),
               problems)


def time_steps(runs: list[Run], cfg: Config, corpus: torch.Tensor, vocab: int, rounds: int) -> None:
    """Times the optimizer step itself, and the forward and backward passes before it, round by
    round with the runs alternating (A B, B A, ...): a machine that slows down or speeds up during
    the timing (other processes, clocks, caches) weighs on both runs alike, where two runs timed one
    after the other can differ several times over on a busy machine. The optimizers are warm
    (states, buffers and kernels made during training); on a GPU each interval ends with a
    synchronisation."""
    for r in range(rounds):
        for run in runs if r % 2 == 0 else runs[::-1]:
            batch = next_batch(corpus, cfg, run.batches)
            run.opt.zero_grad(set_to_none=True)
            synchronize(cfg.device)
            start = time.perf_counter()
            forward(run.model, batch, vocab).backward()
            synchronize(cfg.device)
            stepped = time.perf_counter()
            run.opt.step()
            synchronize(cfg.device)
            run.forward_backward_ms.append((stepped - start) * 1e3)
            run.step_ms.append((time.perf_counter() - stepped) * 1e3)


def quantile(samples: list[float], q: float) -> float:
    """The q-quantile, interpolating linearly between order statistics."""
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(samples: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``median [q10-q90]``."""
    low, high = (quantile(samples, q) * scale for q in QUANTILES)
    return f"{quantile(samples, 0.5) * scale:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def print_step_times(baseline: Run, ours: Run) -> None:
    low, high = (f"{q:.0%}" for q in QUANTILES)
    print(f"\noptimizer step alone, the two runs alternating for {len(ours.step_ms)} rounds after training "
          f"(median [{low}-{high}]):")
    for run in (baseline, ours):
        whole = [s + fb for s, fb in zip(run.step_ms, run.forward_backward_ms)]
        shares = [s / w for s, w in zip(run.step_ms, whole)]
        print(f"  {run.name:<33} step {spread(run.step_ms)} ms, {spread(shares, 100, 1)}% of its training step "
              f"({quantile(whole, 0.5):.1f} ms)")
    ratios = [o / b for o, b in zip(ours.step_ms, baseline.step_ms)]
    print(f"  {ours.name} / {baseline.name}, round by round: {spread(ratios)}x")


def warm_up(cfg: Config, vocab: int) -> None:
    """One forward and backward pass before either run, so that one-time allocations (cuBLAS's
    workspace on a GPU, oneDNN's caches and thread pools on a CPU) land in neither run's report."""
    model = TinyLM(vocab, cfg.model_size, cfg.layers, 4, cfg.context).to(device=cfg.device, dtype=cfg.dtype)
    tokens = torch.zeros(cfg.batch, cfg.context, dtype=torch.long, device=cfg.device)
    model(tokens).float().sum().backward()
    synchronize(cfg.device)


def windowed_agreement(reference: list[float], candidate: list[float], window: int) -> float:
    """The largest relative difference between the two runs' mean losses over windows of steps
    (window 1: between single steps)."""
    worst = 0.0
    for begin in range(0, len(reference), window):
        ref = reference[begin : begin + window]
        got = candidate[begin : begin + window]
        worst = max(worst, abs(sum(got) - sum(ref)) / abs(sum(ref)))
    return worst


def check_agreement(reference: list[float], candidate: list[float], dtype: torch.dtype, window: int,
                    tolerance: float, state_precision: str = "fp32") -> bool:
    """Prints and returns the two checks of the NOTE above: the first steps one by one, then windows
    (with compressed states: every window, then the last one, see COMPRESSED_TOLERANCE)."""
    early = min(EARLY_STEPS, len(reference))
    if state_precision != "fp32":
        windows, final = COMPRESSED_TOLERANCE[state_precision]
        last = len(reference) - min(window, len(reference))
        checks = [
            (f"{window}-step mean losses", windowed_agreement(reference, candidate, window), windows),
            (f"final loss (mean of the last {len(reference) - last} steps)",
             windowed_agreement(reference[last:], candidate[last:], window), final),
        ]
    else:
        checks = [
            (f"first {early} steps, each", windowed_agreement(reference[:early], candidate[:early], 1),
             EARLY_TOLERANCE[dtype]),
            (f"{window}-step mean losses", windowed_agreement(reference, candidate, window), tolerance),
        ]
    for what, worst, limit in checks:
        print(f"{what}: largest relative difference {worst:.1e} (tolerance {limit:.0e})")
    finite = all(math.isfinite(x) for x in (*reference, *candidate))
    if not finite:
        print("a loss is not finite")
    return finite and all(worst <= limit for _, worst, limit in checks)


def parse_args(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m fusedoff.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--optimizer", choices=("adamw", "apollo"), default="adamw")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when a GPU is present")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="parameters and gradients; auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--offload", choices=("auto", "none", "stream"), default="auto",
                        help="fusedoff's states: auto streams from host memory on cuda, keeps them in place on cpu")
    parser.add_argument("--backend", default="auto", help="fusedoff backend: auto, cpu, cuda, triton, torch")
    parser.add_argument("--device-budget", type=int, default=None, metavar="BYTES",
                        help="fusedoff keeps this many bytes of states on the device and streams the rest")
    parser.add_argument("--chunk-size", type=int, default=0,
                        help="elements per streamed chunk; 0: an eighth of the parameters (fusedoff's own "
                             "default, 4M elements, is sized for models of billions of parameters)")
    parser.add_argument("--model-size", type=int, help="transformer width (default by device: 128 cpu, 512 cuda)")
    parser.add_argument("--layers", type=int, help="transformer layers (default by device: 2 cpu, 4 cuda)")
    parser.add_argument("--context", type=int, help="tokens per sequence (default by device: 64 cpu, 256 cuda)")
    parser.add_argument("--batch", type=int, help="sequences per step (default by device: 16 cpu, 32 cuda)")
    parser.add_argument("--lr", type=float, help="learning rate (default: 3e-3 adamw, 0.03 apollo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-precision", choices=("fp32", "bf16", "8bit"), default="fp32",
                        help="fusedoff's moment states: fp32, bf16 (stochastic rounding) or 8bit (block-wise); "
                             "compressed runs are checked against the fp32-state baseline within "
                             "3%%/5%% per window and 2%%/4%% for the final loss")
    parser.add_argument("--tolerance", type=float, default=WINDOW_TOLERANCE,
                        help="largest allowed relative difference of the two runs' windowed mean losses")
    parser.add_argument("--window", type=int, default=50, help="steps per window of the loss comparison")
    parser.add_argument("--timing-rounds", type=int, default=TIMING_ROUNDS,
                        help="training steps of each run timed after training, the two runs alternating")
    parser.add_argument("--plot", metavar="PATH", help="write predicted vs measured memory per phase as a PNG "
                                                       "(needs matplotlib)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.window < 1 or args.timing_rounds < 1:
        parser.error("--steps, --window and --timing-rounds must be at least 1")

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if cuda else torch.float32)
    preset = PRESETS[device.type]
    sizes = {key: getattr(args, key) or value for key, value in preset.items()}
    cfg = Config(device=device, dtype=dtype, optimizer=args.optimizer, offload=args.offload, backend=args.backend,
                 chunk_size=args.chunk_size, steps=args.steps, lr=args.lr or LEARNING_RATES[args.optimizer],
                 seed=args.seed, device_budget=args.device_budget, state_precision=args.state_precision, **sizes)
    if args.device_budget is not None and args.offload == "none":
        raise SystemExit("--device-budget streams what does not fit: not with --offload none")
    if args.state_precision != "fp32" and args.optimizer == "apollo":
        raise SystemExit("--state-precision bf16/8bit is for adamw: fusedoff.Apollo keeps fp32 states")
    return cfg, args


def auto_chunk_size(model: nn.Module) -> int:
    """An eighth of the parameters, so that the model streams through the buffers in several chunks."""
    numel = sum(round_up(p.numel(), ALIGN_ELEMENTS) for p in model.parameters())
    return max(ALIGN_ELEMENTS, round_up(numel // 8, ALIGN_ELEMENTS))


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    text = make_corpus(200_000)
    chars = sorted(set(text))
    corpus = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    with torch.device("meta"):  # shapes and dtypes for the predictions, without memory
        probe = TinyLM(len(chars), cfg.model_size, cfg.layers, 4, cfg.context).to(cfg.dtype)
    num_params = sum(p.numel() for p in probe.parameters())
    if cfg.chunk_size == 0:
        cfg.chunk_size = auto_chunk_size(probe)
    baseline_name, ours_name = optimizer_names(cfg)
    offload = "stream" if cfg.streams else "none"
    print(f"fusedoff demo: {baseline_name} vs {ours_name} on {cfg.device}, {str(cfg.dtype).removeprefix('torch.')} "
          f"parameters and gradients, offload={offload}" + (f" (chunks of {cfg.chunk_size} elements)" if cfg.streams
                                                            else ""))
    print(f"model: {num_params / 1e6:.2f}M parameters (width {cfg.model_size}, {cfg.layers} layers, context "
          f"{cfg.context}); {cfg.steps} steps of {cfg.batch} sequences; corpus {len(text)} chars, vocab {len(chars)}")

    warm_up(cfg, len(chars))
    runs = [train(which, cfg, corpus, len(chars)) for which in ("baseline", "fusedoff")]
    baseline, ours = runs
    time_steps(runs, cfg, corpus, len(chars), args.timing_rounds)

    print(f"\n{'step':>6} {baseline_name:>33} {ours_name:>16}")
    for step in sorted(set(range(0, cfg.steps, max(1, cfg.steps // 10))) | {cfg.steps - 1}):
        print(f"{step:>6} {baseline.losses[step]:>33.4f} {ours.losses[step]:>16.4f}")
    agree = check_agreement(baseline.losses, ours.losses, cfg.dtype, args.window, args.tolerance,
                            cfg.state_precision)
    print(f"the two runs agree: {'OK' if agree else 'FAIL'}")
    print_step_times(baseline, ours)

    print()
    predictions = [ours.measured.prediction, baseline.measured.prediction]
    params = list(probe.parameters())
    if not cfg.streams:  # what streaming would change, beside what this run did
        predictions.insert(1, predict(params, "fusedoff", cfg, offload="stream"))
    if cfg.low_precision:  # the optimizer straight on bf16 parameters: bf16 states, no masters
        predictions.append(predict(params, "plain", cfg))
    print(memory.format_report(predictions, [baseline.measured, ours.measured]))
    if args.plot:
        memory.plot_report([baseline.measured, ours.measured], args.plot)
        print(f"plot: {args.plot}")
    return 0 if agree and not ours.memory_problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
