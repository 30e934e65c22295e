"""How fast do checkpoints decode and encode 8-bit states? (issue 31, finding 6)

A 64M-element parameter on the CPU with AdamW's 8-bit states: the codec on its own (both moments:
decode for ``state_dict``/``fp32_state_dict``/DCP, encode for loading fp32 moments into 8-bit ones)
by the host kernel (``fusedoff.ops.encode_8bit``/``decode_8bit``, csrc/cpu/codec_cpu.cpp) and by the
PyTorch codec it replaced (fusedoff/kernels/codec.py, the same bits), interleaved; and
``fp32_state_dict()`` end to end. The bound is the bytes the codec moves (1 B of code and 4 B of fp32
per element, and the scales) at the in-place bandwidth measured in the same loop.

    .venv/bin/python benchmarks/bench_checkpoint_codec.py [--numel 64M] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff import ops  # noqa: E402
from fusedoff.kernels import codec  # noqa: E402

NAME = "bench_checkpoint_codec"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=timing.parse_size, default=64 * 2**20)
    parser.add_argument("--repeats", type=int, default=5, help="samples of each native contender")
    parser.add_argument("--pytorch-repeats", type=int, default=2, help="samples of the PyTorch codec (slow)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out-dir", type=Path, default=timing.RESULTS_DIR)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.numel

    param = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    opt = fusedoff.AdamW([param], lr=1e-3, state_precision="8bit", backend="cpu")
    param.grad = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-2
    opt.step()
    state = opt.state[param]
    moments = [(state[name], state[f"{name}_absmax"], name == "exp_avg") for name in ("exp_avg", "exp_avg_sq")]
    decoded = [ops.decode_8bit(codes, absmax, signed) for codes, absmax, signed in moments]
    for (codes, absmax, signed), values in zip(moments, decoded):  # the same bits, or nothing to time
        assert torch.equal(values.view(torch.int32), codec.dequantize(codes, absmax, signed=signed).view(torch.int32))

    def decode(native: bool):
        fn = ops.decode_8bit if native else (lambda c, a, s: codec.dequantize(c, a, signed=s))
        return lambda: [fn(codes, absmax, signed) for codes, absmax, signed in moments]

    def encode(native: bool):
        fn = ops.encode_8bit if native else (lambda x, s: codec.quantize(x, signed=s))
        return lambda: [fn(values, signed) for values, (_, _, signed) in zip(decoded, moments)]

    x, y = torch.ones(n), torch.ones(n)
    scale = timing.bandwidth_kernels(x, y)[0]
    with timing.LoadMonitor() as load:
        fast = timing.time_interleaved({"decode native": decode(True), "encode native": encode(True),
                                        "fp32_state_dict native": opt.fp32_state_dict, scale.name: scale.fn},
                                       repeats=args.repeats, warmup=1)
        slow = timing.time_interleaved({"decode pytorch": decode(False), "encode pytorch": encode(False)},
                                       repeats=args.pytorch_repeats, warmup=0)
    samples = {**fast, **slow}
    bandwidth = scale.bytes_per_call / timing.summarize(samples[scale.name]).median
    # Both moments: 1 B of code and 4 B of fp32 per element, one fp32 scale per block, each way once.
    codec_bytes = 2 * (5 * n + 4 * codec.num_blocks(n))
    rows = []
    for contender in ("decode native", "decode pytorch", "encode native", "encode pytorch", "fp32_state_dict native"):
        s = timing.summarize(samples[contender])
        rows.append({"contender": contender, "numel": n, "elements": 2 * n, **timing.summary_columns("s", s, digits=4),
                     "ns_per_element": round(s.median / (2 * n) * 1e9, 2),
                     "elements_per_s": round(2 * n / s.median), "bound_s": round(codec_bytes / bandwidth, 4),
                     "fraction_of_bound": round(codec_bytes / bandwidth / s.median, 3)})
    for kind in ("decode", "encode"):
        native, pytorch = (next(r for r in rows if r["contender"] == f"{kind} {who}") for who in ("native", "pytorch"))
        native["speedup_over_pytorch"] = round(pytorch["s_median"] / native["s_median"], 1)
    meta = timing.hardware_metadata(args.threads, {"bandwidth_gb_per_s": round(bandwidth / 1e9, 1)})
    timing.write_csv(args.out_dir / f"{NAME}.csv", rows, meta)
    table = timing.markdown_table(rows, [
        ("contender (both moments)", lambda r: r["contender"]),
        ("median s", lambda r: r["s_median"]),
        ("p10-p90 s", lambda r: f"{r['s_q10']}-{r['s_q90']}"),
        ("ns/element", lambda r: r["ns_per_element"]),
        ("M elements/s", lambda r: round(r["elements_per_s"] / 1e6)),
        ("bound s", lambda r: r["bound_s"]),
        ("% of bound", lambda r: f"{100 * r['fraction_of_bound']:.0f}%"),
        ("vs PyTorch codec", lambda r: f"{r['speedup_over_pytorch']}x" if "speedup_over_pytorch" in r else None),
    ])
    markdown = (f"## 8-bit states in checkpoints: the codec on {timing.format_size(n)} elements ({NAME}.py)\n\n"
                f"Command: `{timing.command_line()}`, {meta['date_utc']}, {args.threads} threads, torch "
                f"{torch.__version__}.\n{timing.hardware_lines(meta)}\n"
                f"- load: {timing.load_note(load)}\n- bound: {codec_bytes / 1e6:.0f} MB (codes, fp32 values and scales "
                f"of both moments) at the in-place bandwidth measured in the same loop, {bandwidth / 1e9:.1f} GB/s\n\n"
                f"{table}\n\nThe native and PyTorch codecs give the same bits (checked here, and by "
                "tests/test_checkpoint_codec.py over every code and the fp32 range). `fp32_state_dict` decodes both "
                "moments and copies the rest of the state dict.\n")
    timing.update_results_section(args.out_dir / "RESULTS.md", NAME, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
