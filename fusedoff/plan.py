"""Will it fit, and how fast? The step's cost model (fusedoff/costs.py) for a model before training.

    python -m fusedoff.plan --params 7e9 --rates h100-pcie5
    python -m fusedoff.plan --config path/config.json --gpu-memory 24GB --rates workstation-pcie4
    python -m fusedoff.plan --params 1.5B --optimizer apollo --rates measured

For every state precision x master precision the optimizer takes, four placements: every state
resident on the GPU; every state streamed (offload='stream'); streamed with the best share stepped
by the host (the host-computed placement: gradient and parameter down, parameter up); and
offload='auto''s resident states (the engine's automatic budget on this GPU) with the best host
share of the rest.
Each row gives the GPU bytes (parameters, gradients, resident states, streaming buffers; activations
are not counted: ``--reserve`` sets bytes aside for them), the host bytes, the bytes over the link
each way, the predicted step and what bounds it, and whether it fits. The row marked ``*`` is the
automatic choice for the precisions asked for (``--state-precision``, ``--master-precision``: the
optimizer's defaults unless given): the fastest placement that fits. Every figure is a prediction of
the model, at the rates named.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fusedoff import costs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COUNT_UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
BYTE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
PLACEMENTS = ("resident", "streamed", "host share", "auto + host share")
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
# Keys of a mixture of experts: its parameter count is not the dense formula's.
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def _positive(text: str, units: dict[str, float], what: str) -> int:
    match = _NUMBER.match(text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in units:
        named = ", ".join(u for u in units if u)
        raise ValueError(f"{what} must be a positive number with an optional unit ({named}), got {text!r}")
    value = float(match.group(1)) * units[unit]
    if not math.isfinite(value) or round(value) < 1:
        raise ValueError(f"{what} must be positive and finite, got {text!r}")
    return round(value)


def parse_count(text: str) -> int:
    """'7e9', '7B', '1.5G', '350M' -> elements (K, M, B/G, T decimal)."""
    return _positive(text, COUNT_UNITS, "a parameter count")


def parse_bytes(text: str) -> int:
    """'80GB' (decimal), '24GiB' (binary), '1TB', '1000000' -> bytes."""
    return _positive(text, BYTE_UNITS, "a memory size")


def _config_int(config: dict, key: str, path: Path, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}" if key in config
                         else f"{path}: no {key}: a Llama-style config.json has hidden_size, num_hidden_layers, "
                              "intermediate_size, vocab_size and num_attention_heads")
    return value


def config_params(path: Path) -> int:
    """The parameter count of a Llama-style (dense decoder) Hugging Face config.json: embeddings, each
    layer's attention (q, k, v, o with grouped key/value heads; biases with ``attention_bias``) and
    gated MLP (gate, up, down; biases with ``mlp_bias``), two norms per layer, the final norm, and the
    output head unless ``tie_word_embeddings``."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config.json holds one JSON object, got {type(config).__name__}")
    experts = [key for key in _EXPERT_KEYS if config.get(key)]
    if experts:
        raise ValueError(f"{path}: a mixture of experts ({', '.join(experts)}) is not a Llama-style dense model: "
                         "pass its parameter count with --params")
    hidden = _config_int(config, "hidden_size", path)
    layers = _config_int(config, "num_hidden_layers", path)
    intermediate = _config_int(config, "intermediate_size", path)
    vocab = _config_int(config, "vocab_size", path)
    heads = _config_int(config, "num_attention_heads", path)
    kv_heads = _config_int(config, "num_key_value_heads", path, heads)
    if hidden % heads and "head_dim" not in config:
        raise ValueError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}: "
                         "give head_dim")
    head_dim = _config_int(config, "head_dim", path, hidden // heads)
    if heads % kv_heads:
        raise ValueError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    if config.get("attention_bias"):
        attention += q + 2 * kv + hidden
    mlp = 3 * hidden * intermediate + ((2 * intermediate + hidden) if config.get("mlp_bias") else 0)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden


@dataclass(frozen=True)
class PlanRow:
    placement: str  # one of PLACEMENTS
    prediction: costs.StepPrediction
    fits: bool
    chosen: bool = False


def setups(optimizer: str, param_dtype: torch.dtype, grad_dtype: torch.dtype | None) -> list[costs.Setup]:
    """Every state precision x master precision the optimizer takes for these dtypes."""
    states = ("fp32",) if optimizer == "apollo" else costs.STATE_PRECISIONS
    if param_dtype == torch.bfloat16:
        masters = costs.MASTER_PRECISIONS
    elif param_dtype == torch.float16:
        masters = ("fp32", costs.NO_MASTER)
    else:
        masters = (costs.NO_MASTER,)
    return [costs.Setup(optimizer, param_dtype, grad_dtype, state, master) for state in states for master in masters]


def plan(params: int, rates: costs.Rates, *, optimizer: str = "adamw", param_dtype: torch.dtype = torch.bfloat16,
         grad_dtype: torch.dtype | None = None, gpu_memory: int, host_memory: int | None = None, reserve: int = 0,
         state_precision: str = "fp32", master_precision: str | None = None) -> list[PlanRow]:
    """The rows of the table (see the module docstring), the automatic choice marked."""
    if master_precision is None:
        master_precision = "fp32" if param_dtype in costs.LOW_PRECISION else costs.NO_MASTER
    wanted = costs.Setup(optimizer, param_dtype, grad_dtype, state_precision, master_precision)  # (refusing)
    rows = []
    for setup in setups(optimizer, param_dtype, grad_dtype):
        auto = costs.auto_resident(setup, params, gpu_memory, reserve=reserve)
        placements = (("resident", costs.predict_step(setup, rates, params, resident=params)),
                      ("streamed", costs.predict_step(setup, rates, params)),
                      ("host share", costs.best_host_share(setup, rates, params)),
                      ("auto + host share", costs.best_host_share(setup, rates, params, resident=auto)))
        for placement, prediction in placements:
            fits = prediction.device_bytes + reserve <= gpu_memory and (
                host_memory is None or prediction.host_bytes <= host_memory)
            rows.append(PlanRow(placement, prediction, fits))
    candidates = [k for k, row in enumerate(rows) if row.fits and row.prediction.setup == wanted]
    if candidates:
        best = min(candidates, key=lambda k: rows[k].prediction.step_s)
        rows[best] = PlanRow(rows[best].placement, rows[best].prediction, True, chosen=True)
    return rows


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f}"


def format_table(rows: Sequence[PlanRow]) -> str:
    header = ("", "states", "master", "placement", "resident", "host share", "GPU GB", "host GB", "to GPU GB",
              "to host GB", "step ms", "bound", "fits")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        p = row.prediction
        lines.append(f"| {'*' if row.chosen else ''} | {p.setup.state_precision} | {p.setup.master_precision} "
                     f"| {row.placement} | {p.resident / p.params if p.params else 0:.2f} | {p.host_share:.2f} "
                     f"| {_gb(p.device_bytes)} | {_gb(p.host_bytes)} "
                     f"| {_gb(p.h2d_bytes)} | {_gb(p.d2h_bytes)} | {p.step_s * 1e3:.0f} | {p.bound} "
                     f"| {'yes' if row.fits else 'no'} |")
    return "\n".join(lines)


def _rates(name: str, threads: int | None) -> costs.Rates:
    if name != "measured":
        return costs.preset(name)
    from fusedoff import calibrate

    print("measuring this machine's host side (fusedoff.calibrate)...", flush=True)
    return calibrate.measure(threads).rates(costs.preset("h100-pcie5"))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fusedoff.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", help="the parameter count: 7e9, 7B, 350M")
    size.add_argument("--config", type=Path, help="a Llama-style Hugging Face config.json, read locally")
    parser.add_argument("--param-dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--grad-dtype", choices=tuple(DTYPES), help="default: the parameters'")
    parser.add_argument("--optimizer", choices=costs.OPTIMIZERS, default="adamw")
    parser.add_argument("--state-precision", choices=costs.STATE_PRECISIONS, default="fp32",
                        help="the precision the automatic choice keeps (default fp32)")
    parser.add_argument("--master-precision", choices=costs.MASTER_PRECISIONS,
                        help="likewise (default fp32 for bf16/fp16 parameters, none for fp32)")
    parser.add_argument("--gpu-memory", default="80GB", help="the GPU's memory: 80GB, 24GiB (default 80GB)")
    parser.add_argument("--host-memory", help="host memory for this GPU's states (default: not checked)")
    parser.add_argument("--reserve", default="0", help="GPU bytes set aside for activations and workspace")
    parser.add_argument("--rates", choices=(*costs.PRESETS, "measured"), default="h100-pcie5",
                        help="a preset (assumed figures) or 'measured': this machine's host side, measured now, "
                             "and the link and device of h100-pcie5 where there is no GPU")
    parser.add_argument("--threads", type=int, help="host threads for --rates measured (default: torch's)")
    args = parser.parse_args(argv)
    try:
        params = parse_count(args.params) if args.params is not None else config_params(args.config)
        gpu_memory = parse_bytes(args.gpu_memory)
        host_memory = parse_bytes(args.host_memory) if args.host_memory is not None else None
        reserve = 0 if args.reserve.strip() == "0" else parse_bytes(args.reserve)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        rates = _rates(args.rates, args.threads)
        rows = plan(params, rates, optimizer=args.optimizer, param_dtype=DTYPES[args.param_dtype],
                    grad_dtype=DTYPES[args.grad_dtype] if args.grad_dtype else None, gpu_memory=gpu_memory,
                    host_memory=host_memory, reserve=reserve, state_precision=args.state_precision,
                    master_precision=args.master_precision)
    except ValueError as exc:
        parser.error(str(exc))
    grads = args.grad_dtype or args.param_dtype
    print(f"{params:,} parameters ({params / 1e9:.2f}B; {args.param_dtype} parameters, {grads} gradients), "
          f"{args.optimizer}, "
          f"GPU memory {gpu_memory / 1e9:.1f} GB" + (f" ({reserve / 1e9:.1f} GB reserved)" if reserve else "")
          + (f", host memory {host_memory / 1e9:.1f} GB" if host_memory else ""))
    print(f"rates {rates.name}: link {rates.h2d / 1e9:.0f}/{rates.d2h / 1e9:.0f} GB/s each way, {rates.both / 1e9:.0f} "
          f"both, device {rates.device_memory / 1e12:.2f} TB/s, host memory {rates.host_memory / 1e9:.0f} GB/s"
          + (f" and its kernel measured on {rates.host_threads} threads" if rates.host_kernel else "")
          + f" ({rates.source})")
    print(format_table(rows))
    chosen = [row for row in rows if row.chosen]
    if chosen:
        p = chosen[0].prediction
        print(f"* the automatic choice for {p.setup.label}: {chosen[0].placement}"
              + (f" (host share {p.host_share:.2f})" if chosen[0].placement == "host share" else "")
              + f", {p.step_s * 1e3:.0f} ms per step, predicted")
    elif any(row.fits for row in rows):
        print(f"nothing fits with {args.state_precision} states: see the rows that fit above")
    else:
        least = min(row.prediction.device_bytes for row in rows) + reserve
        print(f"nothing fits: every row needs {least / 1e9:.3g} GB of GPU memory or more")


if __name__ == "__main__":
    main()
