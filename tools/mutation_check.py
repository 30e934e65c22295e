"""Does the test suite catch realistic bugs? Plants each mutation below, one at a time, in a scratch copy.

    .venv/bin/python tools/mutation_check.py                # every mutation: "N of M mutations caught"
    .venv/bin/python tools/mutation_check.py --list         # the mutations and the tests each runs
    .venv/bin/python tools/mutation_check.py --only NAME... # some of them
    .venv/bin/python tools/mutation_check.py --check        # only that every mutation still applies

Each mutation replaces one exact piece of text of one file (the text must occur exactly once: a
mutation whose text has changed is reported as stale, never silently skipped) and runs the test
files of that area (`-x`: the first failure ends the run), not the whole suite; the output names the
subset. Triton-interpreter tests run for Triton mutations only (the other backends' mutations cannot
reach them), cuda-marked tests skip on a machine without a GPU.

The scratch copy is the committed tree (`git archive HEAD`; `--source worktree` copies the checkout
instead, edits in progress included) with its own CPU-only build of the extension. A C++ mutation
rebuilds it (ninja recompiles the objects that include the changed file), and the unmutated objects
are put back afterwards. The copy also builds the CUDA kernels as host C++ (fusedoff._C_emulated,
csrc/emulation): a CUDA mutation is compiled with nvcc (to show that it is a valid device program),
then rebuilt into the emulated kernels and caught, or not, by the `emulated` tests of its area.

A test that fails on a mutation counts only if it passes on the unmutated copy (checked once per
test); one that fails there too is deselected and the mutation run again.

It takes about 30 minutes on two cores (C++ rebuilds, and every missed mutation runs its whole subset):
not part of every CI run. Exit status 0 when every runnable mutation is caught.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Test subsets, by area; most likely to catch first (the run stops at the first failure).
ADAM = ("tests/test_adam_op.py", "tests/test_adam_optimizer.py", "tests/test_grad_scaler.py")
APOLLO = ("tests/test_apollo.py", "tests/test_grad_scaler.py")
OPS = ("tests/test_adam_op.py", "tests/test_apollo.py", "tests/test_grad_scaler.py")
ENGINE = ("tests/test_offload.py", "tests/test_optimizer_state.py", "tests/test_checkpoint.py",
          "tests/test_stream_simulation.py", "tests/test_unaligned_views.py")
CLIPPING = ("tests/test_clipping.py", "tests/test_adam_optimizer.py")
GRAD_SCALER = ("tests/test_grad_scaler.py", "tests/test_adam_optimizer.py", "tests/test_offload.py")
CHECKPOINT = ("tests/test_checkpoint.py", "tests/test_offload.py", "tests/test_optimizer_state.py",
              "tests/test_adam_optimizer.py", "tests/test_apollo.py")
SHARDING = ("tests/test_distributed.py",)
OUTSIDE_WRITES = ("tests/test_outside_writes.py",)
TRITON_ADAM = ("tests/test_triton_adam.py", "tests/test_grad_scaler.py")
TRITON_APOLLO = ("tests/test_triton_apollo.py", "tests/test_apollo.py")
NOT_TRITON = "not cuda and not triton and not emulated"
TRITON = "triton and not cuda"
EMULATED = "emulated"
CUDA_EMULATION = ("tests/test_cuda_emulation.py",)


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    what: str  # the bug, in words
    tests: tuple[str, ...] = ()
    marker: str = NOT_TRITON

    @property
    def kind(self) -> str:
        if self.path.endswith((".cu", ".cuh")):
            return "cuda"
        return "cpp" if self.path.startswith("csrc/") else "python"

    @property
    def rebuilds(self) -> bool:
        return self.kind in ("cpp", "cuda")


M = Mutation
MUTATIONS = [
    # ---- math headers (csrc/include/fusedoff) --------------------------------------------------
    M("adam.h:bias-correction-without-sqrt", "csrc/include/fusedoff/adam.h",
      "s.bias_correction2_sqrt = static_cast<float>(sqrt(1.0 - pow(h.beta2, t)));",
      "s.bias_correction2_sqrt = static_cast<float>(1.0 - pow(h.beta2, t));",
      "the second bias correction without its square root", ADAM),
    M("adam.h:eps-inside-sqrt", "csrc/include/fusedoff/adam.h",
      "const F denom = LaneMath<F>::sqrt(vhat) / s.bias_correction2_sqrt + s.eps;",
      "const F denom = LaneMath<F>::sqrt(vhat + s.eps) / s.bias_correction2_sqrt;",
      "eps added under the square root", ADAM),
    M("adam.h:decoupled-decay-dropped", "csrc/include/fusedoff/adam.h",
      "  param = param * s.decay_factor;\n  exp_avg = s.beta1 * exp_avg + s.one_minus_beta1 * g;",
      "  exp_avg = s.beta1 * exp_avg + s.one_minus_beta1 * g;",
      "AdamW's decoupled decay dropped (the line lost in a reordering)", ADAM),
    M("adam.h:reciprocal-unscale", "csrc/include/fusedoff/adam.h",
      "F g = s.grad_sign * (grad / grad_scale);",
      "F g = s.grad_sign * (grad * (1.0f / grad_scale));",
      "the grad scale applied as a reciprocal multiply (1-ulp differences)", ADAM),
    M("adam.h:amsgrad-uses-v", "csrc/include/fusedoff/adam.h",
      "    max_exp_avg_sq = LaneMath<F>::max(max_exp_avg_sq, exp_avg_sq);\n    vhat = max_exp_avg_sq;",
      "    max_exp_avg_sq = LaneMath<F>::max(max_exp_avg_sq, exp_avg_sq);",
      "amsgrad keeps the max but divides by the current v", ADAM),
    M("apollo.h:belief-shift-times-alpha", "csrc/include/fusedoff/apollo.h",
      "c.rebound_shift = belief ? static_cast<float>(h.eps / alpha) : 0.0f;",
      "c.rebound_shift = belief ? static_cast<float>(h.eps * alpha) : 0.0f;",
      "belief rebound shift eps * alpha instead of eps / alpha", APOLLO),
    M("apollo.h:stable-decay-sum-not-mean", "csrc/include/fusedoff/apollo.h",
      "return static_cast<float>(h.weight_decay / (stats[kSumD] / static_cast<double>(numel)));",
      "return static_cast<float>(h.weight_decay / stats[kSumD]);",
      "'stable' decay divided by sum D, not its mean", APOLLO),
    M("apollo.h:warmup-off-by-one", "csrc/include/fusedoff/apollo.h",
      "const double k = t - 1.0;", "const double k = t;",
      "warmup lr from the step count after the increment", APOLLO),
    M("dtypes.h:bf16-truncates", "csrc/include/fusedoff/dtypes.h",
      "return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even",
      "return static_cast<uint16_t>(u >> 16);",
      "fp32 -> bf16 stores truncate instead of rounding to nearest even", OPS + ("tests/test_adam_optimizer.py",)),
    # ---- host kernels and their launch (csrc/cpu) ----------------------------------------------
    M("blocks.h:block-ends-early", "csrc/cpu/blocks.h",
      "std::min(tensors[i].numel, begin + kBlockElements)});",
      "std::min(tensors[i].numel, begin + kBlockElements - 1)});",
      "a CPU block ends one element early", OPS),
    M("adam_cpu:scale-ignored", "csrc/cpu/adam_cpu.cpp",
      "select_range_fn(launch, /*scaled=*/grad_scale != 1.0f);",
      "select_range_fn(launch, /*scaled=*/false);",
      "the Adam CPU kernel ignores the grad scale", OPS),
    M("adam_cpu:found-inf-only-one", "csrc/cpu/adam_cpu.cpp",
      "if (launch.found_inf != nullptr && *launch.found_inf != 0.0f) return;",
      "if (launch.found_inf != nullptr && *launch.found_inf == 1.0f) return;",
      "the Adam CPU kernel skips only when found_inf is exactly 1 (GradScaler sums the devices' flags)",
      OPS),
    M("apollo_cpu:bf16-scale-ignored", "csrc/cpu/apollo_cpu.cpp",
      "const float grad_scale = launch.grad_scale != nullptr ? *launch.grad_scale : 1.0f;",
      "const float grad_scale = launch.grad_scale != nullptr && launch.grad_dtype != DType::BFloat16\n"
      "                             ? *launch.grad_scale : 1.0f;",
      "the Apollo CPU kernel ignores the grad scale of bf16 gradients", APOLLO),
    M("apollo_cpu:last-block-sum", "csrc/cpu/apollo_cpu.cpp",
      "stats[kSumYD] += partials[b].sum_yd;", "stats[kSumYD] = partials[b].sum_yd;",
      "sum y*d keeps the last block's partial only", APOLLO),
    M("apollo_cpu:l2-flag", "csrc/cpu/apollo_cpu.cpp",
      "const bool l2 = launch.hyper.decay == ApolloDecay::L2;",
      "const bool l2 = launch.hyper.decay == ApolloDecay::Decoupled;",
      "the parameter read for the wrong decay type (L2's gradient sees p = 0)", APOLLO),
    # ---- the boundary file (csrc/ops.cpp) -------------------------------------------------------
    M("ops.cpp:betas-swapped", "csrc/ops.cpp",
      "  FUSEDOFF_ADAM_HYPERPARAMETERS(FUSEDOFF_SET_FIELD, FUSEDOFF_NOTHING)\n  return hyper;",
      "  FUSEDOFF_ADAM_HYPERPARAMETERS(FUSEDOFF_SET_FIELD, FUSEDOFF_NOTHING)\n"
      "  std::swap(hyper.beta1, hyper.beta2);\n  return hyper;",
      "beta1 and beta2 swapped in the hyperparameters both Adam ops give the kernels", OPS),
    M("ops.cpp:range-size-as-total", "csrc/ops.cpp",
      "                               p.numel(),\n                               total_numels[i]};",
      "                               p.numel(),\n                               p.numel()};",
      "an Apollo range's size taken as its tensor's (mean D of a split tensor)",
      ("tests/test_apollo.py", "tests/test_offload.py")),
    M("ops.cpp:no-grad-size-check", "csrc/ops.cpp",
      '  TORCH_CHECK(g.numel() == p.numel(), "fusedoff: grads[", i, "] has ", g.numel(), '
      '" elements but its parameter has ",\n              p.numel());\n',
      "", "a gradient of the wrong size is not refused", OPS),
    # ---- device kernels (csrc/cuda): nvcc-compiled, run by the CUDA emulation ---------------------
    M("multi_tensor.cuh:block-search", "csrc/cuda/multi_tensor.cuh",
      "if (table.first_block[mid] <= block) {", "if (table.first_block[mid] < block) {",
      "a block is given to the tensor before the one it belongs to", ADAM + APOLLO, EMULATED),
    M("multi_tensor.cuh:block-search-misses-last-tensor", "csrc/cuda/multi_tensor.cuh",
      "  int hi = table.num_tensors - 1;\n", "  int hi = table.num_tensors > 1 ? table.num_tensors - 2 : 0;\n",
      "the block search never reaches a launch's last tensor: its blocks go to the one before", ADAM, EMULATED),
    M("multi_tensor.cuh:vectors-from-element-0", "csrc/cuda/multi_tensor.cuh",
      "  const int begin = head < numel ? head : numel;\n", "  const int begin = 0;\n",
      "16-byte accesses from a chunk's first element, not from its vector head (views at an offset)",
      CUDA_EMULATION + ("tests/test_unaligned_views.py",), EMULATED),
    M("adam_cuda:head-run-stops-early", "csrc/cuda/adam_cuda.cu",
      "for (int i = thread; i < runs.vector_begin; i += kThreads)",
      "for (int i = thread; i + 1 < runs.vector_begin; i += kThreads)",
      "the scalar run before the vector head leaves its last element out", CUDA_EMULATION + ADAM, EMULATED),
    M("adam_cuda:tail-run-stops-early", "csrc/cuda/adam_cuda.cu",
      "for (int i = runs.vector_end + thread; i < work.numel; i += kThreads)",
      "for (int i = runs.vector_end + thread; i + 1 < work.numel; i += kThreads)",
      "the scalar run after the last whole vector leaves a chunk's last element out", ADAM, EMULATED),
    M("adam_cuda:found-inf-only-one", "csrc/cuda/adam_cuda.cu",
      "*table.args.found_inf != 0.0f;", "*table.args.found_inf == 1.0f;",
      "the CUDA Adam kernel skips only when found_inf is exactly 1", ADAM, EMULATED),
    M("apollo_cuda:warp-reduce-misses-lane", "csrc/cuda/apollo_cuda.cu",
      "for (int offset = 16; offset > 0; offset /= 2)", "for (int offset = 16; offset > 1; offset /= 2)",
      "the warp reduction of the Apollo partials stops one shuffle early", APOLLO, EMULATED),
    # ---- Triton kernels ---------------------------------------------------------------------------
    M("triton_adam:step-size-beta2", "fusedoff/kernels/triton_adam.py",
      "step_size = (lr / (1.0 - fp64_pow(beta1, t))).to(tl.float32)",
      "step_size = (lr / (1.0 - fp64_pow(beta2, t))).to(tl.float32)",
      "Triton Adam's step size bias-corrected with beta2", TRITON_ADAM, TRITON),
    M("triton_common:found-inf-only-one", "fusedoff/kernels/triton_common.py",
      "numel = tl.where(tl.load(found_inf_ptr) == 0.0, numel, 0)",
      "numel = tl.where(tl.load(found_inf_ptr) != 1.0, numel, 0)",
      "Triton kernels skip only when found_inf is exactly 1", TRITON_ADAM, TRITON),
    M("triton_apollo:combine-overwrites", "fusedoff/kernels/triton_apollo.py",
      "new = tl.where(cols == 3, _nan_max(old, max_abs_y), old + total)",
      "new = tl.where(cols == 3, _nan_max(old, max_abs_y), total)",
      "Triton Apollo's combine overwrites the stats instead of adding (ranges of a tensor in several calls)",
      TRITON_APOLLO, TRITON),
    # ---- the offload engine (fusedoff/offload) --------------------------------------------------
    M("plan:no-alignment", "fusedoff/offload/plan.py",
      "used = round_up(used + lead + n, align)", "used = used + lead + n",
      "streamed tensors packed without 64-byte alignment", ENGINE),
    M("plan:piece-one-short", "fusedoff/offload/plan.py",
      "pieces.append(Piece(t, lo - self.offsets[t], lo - begin, hi - lo))",
      "pieces.append(Piece(t, lo - self.offsets[t], lo - begin, max(hi - lo - 1, 1)))",
      "each piece of a chunk one element short", ENGINE),
    M("engine:all-phases-in-one-visit", "fusedoff/offload/run.py",
      "if len(update.phases) > 1:", "if len(update.phases) > 3:",
      "chunks of tensors spanning chunks run every phase in one visit (Apollo's sums incomplete)", ENGINE),
    M("pipeline:written-not-read", "fusedoff/offload/pipeline.py",
      "read, write = tuple(dict.fromkeys(tuple(read) + tuple(write))), tuple(write)",
      "read, write = tuple(read), tuple(write)",
      "states a pass writes but does not read are not copied in (pieces sitting out go back stale)",
      ENGINE),
    M("store:first-segment", "fusedoff/offload/store.py",
      "return self.slabs[name][self.plan.segment_of[tensor]][begin:end]",
      "return self.slabs[name][0][begin:end]",
      "every tensor's state viewed in the first slab", ENGINE),
    M("placement:strict-fit", "fusedoff/offload/placement.py",
      "fits = left is None or size <= left", "fits = left is None or size < left",
      "a tensor whose states fill the budget exactly is streamed", ENGINE + ("tests/test_torch_conformance.py",)),
    # ---- clipping ---------------------------------------------------------------------------------
    M("clipping:factor-10%-small", "fusedoff/optim/clipping.py",
      "return torch.clamp(max_norm / (total + 1e-6), max=1.0)",
      "return torch.clamp(0.9 * max_norm / (total + 1e-6), max=1.0)",
      "the clip factor 10% too small", CLIPPING),
    M("base:clip-never-reset", "fusedoff/optim/base.py",
      "            if self._engine.steps_taken != taken:\n                self._clip_coef = None\n", "",
      "the clip factor is never reset after its step", CLIPPING),
    M("clipping:upcast-all-gradients", "fusedoff/optim/clipping.py",
      "local_grads = [local_tensor(params[t].grad) for t in rows]",
      "local_grads = [local_tensor(params[t].grad).float() for t in rows]",
      "the norm computed from fp32 copies of every gradient at once", CLIPPING),
    # ---- GradScaler -------------------------------------------------------------------------------
    M("ops:steps-one-minus-found-inf", "fusedoff/ops.py",
      "stepped = (found_inf.reshape(()).to(steps[0].device) == 0).to(steps[0].dtype)",
      "stepped = (1 - found_inf.reshape(()).to(steps[0].device)).to(steps[0].dtype)",
      "step counts advance by 1 - found_inf (backwards when two devices overflow)", GRAD_SCALER),
    M("engine:found-inf-not-passed", "fusedoff/offload/engine.py",
      "update = rules._fused_update(w.group, bucket.backend, divisor, found_inf, bucket.names, bucket.params)",
      "update = rules._fused_update(w.group, bucket.backend, divisor, None, bucket.names, bucket.params)",
      "the kernels never see found_inf (an overflowing step updates with inf gradients)", GRAD_SCALER),
    M("base:grad-scale-ignored", "fusedoff/optim/base.py",
      "return clipping.grad_divisor(grad_scale, clip, device), inf",
      "return clipping.grad_divisor(None, clip, device), inf",
      "GradScaler's grad_scale is ignored (gradients stay scaled)", GRAD_SCALER),
    # ---- checkpoints ------------------------------------------------------------------------------
    M("checkpoint:streamed-load-drops-masters", "fusedoff/optim/checkpoint.py",
      '            if key == "step":\n                state[key] = value.to(',
      '            if key == "master_param" and optimizer._config["offload"] != "none":\n'
      '                continue\n            if key == "step":\n                state[key] = value.to(',
      "a streamed load_state_dict drops the master weights", CHECKPOINT),
    M("bucket:adopt-restarts-streamed-masters", "fusedoff/offload/bucket.py",
      "            if value is None:\n                if spec.follows_param:\n                    shaped.copy_(",
      "            if value is None or spec.follows_param:\n                if spec.follows_param:\n"
      "                    shaped.copy_(",
      "a streamed state taken by value restarts the master weights from the parameters", CHECKPOINT),
    M("master.h:written-param-ignored", "csrc/include/fusedoff/master.h",
      "  return reference - high + 0x8000u <= 0x10000u ? u : high;",
      "  return u;",
      "a bf16 parameter written between steps keeps its stale master", OUTSIDE_WRITES),
    M("master.h:tie-taken-for-a-write", "csrc/include/fusedoff/master.h",
      "  return reference - high + 0x8000u <= 0x10000u ? u : high;",
      "  return reference - high + 0x8000u < 0x10000u ? u : high;",
      "torch's cast of a master at a tie is taken for a write, and the master lost", OUTSIDE_WRITES),
    M("master.h:fp16-written-param-ignored", "csrc/include/fusedoff/master.h",
      "  return (p.bits == rounded || other_at_tie) ? master : value;",
      "  return master;",
      "an fp16 parameter written between steps keeps its stale master", OUTSIDE_WRITES),
    M("bucket:stale-param-views", "fusedoff/offload/bucket.py",
      "            if known is not None:\n                self._forget_views(t)\n",
      "",
      "a parameter whose storage was replaced is still updated through its old flat view", OUTSIDE_WRITES),
    M("checkpoint:no-size-check", "fusedoff/optim/checkpoint.py",
      "            if value.numel() != expected:\n",
      "            if False:\n",
      "a loaded state of the wrong size is not refused up front", CHECKPOINT),
    # ---- sharding ---------------------------------------------------------------------------------
    M("sharding:max-as-sum", "fusedoff/sharding.py",
      'op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]', "op=dist.ReduceOp.SUM",
      "shards' maxima (inf norm, Apollo's max |y|) added instead", SHARDING),
    M("sharding:column-slice-not-written-back", "fusedoff/sharding.py",
      "            rows.copy_(part)", "            pass",
      "a reduced column slice of the stats is not written back", SHARDING),
]


# ---- the scratch copy --------------------------------------------------------------------------

def run_command(args, cwd, env=None, timeout=None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def snapshot(source: str, scratch: Path) -> None:
    if source == "head":
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
    else:
        files = run_command(["git", "ls-files", "-co", "--exclude-standard", "-z"], ROOT).stdout.split("\0")
        for name in filter(None, files):
            target = scratch / name
            if (ROOT / name).is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target)
    # The project's configuration would put the checkout (and its unmutated package) first on sys.path.
    (scratch / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: x\n    triton: x\n    slow: x\n    emulated: x\n")


def build(scratch: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "FUSEDOFF_CUDA": "0", "FUSEDOFF_CUDA_EMULATION": "1", "MAX_JOBS": "2"}
    return run_command([PYTHON, "setup.py", "build_ext", "--inplace"], scratch, env)


def test_env(scratch: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1",
           "FUSEDOFF_REQUIRE_EMULATION": "1"}  # an emulated test never skips for want of its build
    env.pop("FUSEDOFF_EMULATED_EXTENSION", None)
    return env


class Scratch:
    def __init__(self, path: Path, source: str) -> None:
        self.path = path
        self.src = path / "src"
        self.src.mkdir(parents=True)
        snapshot(source, self.src)
        started = time.perf_counter()
        result = build(self.src)
        if result.returncode:
            raise SystemExit(f"the unmutated copy does not build:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        print(f"built the unmutated copy in {time.perf_counter() - started:.0f} s", flush=True)
        where = run_command([PYTHON, "-c", "import fusedoff, fusedoff._ext as e; e.load_extension(); "
                             "print(fusedoff.__file__)"], self.src, test_env(self.src))
        if not where.stdout.startswith(str(self.src)):
            raise SystemExit(f"the scratch copy is not the one imported: {where.stdout} {where.stderr[-2000:]}")
        # The unmutated build, put back after each C++ mutation (mtimes kept: ninja sees it up to date).
        self.pristine = path / "pristine-build"
        shutil.copytree(self.src / "build", self.pristine / "build", copy_function=shutil.copy2)
        self.libraries = sorted((self.src / "fusedoff").glob("_C*.so"))
        for lib in self.libraries:
            shutil.copy2(lib, self.pristine / lib.name)
        self.pristine_results: dict[str, bool] = {}

    def apply(self, mutation: Mutation) -> tuple[str, float]:
        target = self.src / mutation.path
        text = target.read_text()
        count = text.count(mutation.old)
        if count != 1:
            raise ValueError(f"stale mutation: its text occurs {count} times in {mutation.path}")
        mtime = target.stat().st_mtime
        target.write_text(text.replace(mutation.old, mutation.new))
        return text, mtime

    def restore(self, mutation: Mutation, original: tuple[str, float]) -> None:
        target = self.src / mutation.path
        target.write_text(original[0])
        os.utime(target, (original[1], original[1]))
        if mutation.rebuilds:
            shutil.rmtree(self.src / "build")
            shutil.copytree(self.pristine / "build", self.src / "build", copy_function=shutil.copy2)
            for lib in self.libraries:
                shutil.copy2(self.pristine / lib.name, lib)

    @contextlib.contextmanager
    def unmutated(self, mutation: Mutation, original: tuple[str, float]):
        """The unmutated source and extension for a while (the mutated build is kept aside)."""
        target = self.src / mutation.path
        mutated = target.read_text()
        libraries = {lib: lib.read_bytes() for lib in self.libraries} if mutation.rebuilds else {}
        target.write_text(original[0])
        for lib in libraries:
            shutil.copy2(self.pristine / lib.name, lib)
        try:
            yield
        finally:
            target.write_text(mutated)
            for lib, data in libraries.items():
                lib.write_bytes(data)

    def pytest(self, tests, marker: str, deselect=(), first_failure=True, timeout=3600):
        args = [PYTHON, "-m", "pytest", "-c", "pytest.ini", "-p", "no:cacheprovider", "-q", "-rfE", "-m", marker,
                *(["-x"] if first_failure else []), *(f"--deselect={t}" for t in deselect), *tests]
        try:
            result = run_command(args, self.src, test_env(self.src), timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, "timed out"
        output = result.stdout + result.stderr
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
        if result.returncode not in (0, 1, 5):  # 5: nothing collected
            failed = failed or [f"pytest exit status {result.returncode}"]
        tail = output.strip().splitlines()[-1] if output.strip() else ""
        return failed, tail

    def passes_unmutated(self, test: str, marker: str) -> bool:
        if test not in self.pristine_results:
            failed, _ = self.pytest([test], marker)
            self.pristine_results[test] = failed == []
        return self.pristine_results[test]


def existing(scratch: Scratch, tests) -> list[str]:
    return [t for t in tests if (scratch.src / t).exists()]


def compile_cuda(scratch: Scratch, mutation: Mutation) -> str:
    """nvcc on the mutated .cu (or the .cu files including the mutated .cuh): the kernels are ATen-free."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "not compiled (no nvcc)"
    sources = [mutation.path] if mutation.path.endswith(".cu") else \
        sorted(str(p.relative_to(scratch.src)) for p in (scratch.src / "csrc/cuda").glob("*.cu"))
    for source in sources:
        result = run_command([nvcc, "-std=c++17", "-O3", "-Icsrc/include", "-DFUSEDOFF_WITH_CUDA",
                              "-gencode", "arch=compute_90,code=sm_90", "-c", source, "-o", os.devnull], scratch.src)
        if result.returncode:
            return f"DOES NOT COMPILE: {result.stderr.strip()[-500:]}"
    return f"compiled ({', '.join(Path(s).name for s in sources)})"


def run_mutation(scratch: Scratch, mutation: Mutation) -> tuple[str, str]:
    """(verdict, details): verdict is caught, MISSED, or an error."""
    original = scratch.apply(mutation)
    try:
        if mutation.kind == "cuda":
            compiled = compile_cuda(scratch, mutation)
            if compiled.startswith("DOES NOT COMPILE"):
                return "BROKEN", compiled
        if mutation.rebuilds:
            result = build(scratch.src)
            if result.returncode:
                return "BROKEN", "the mutated copy does not build: " + (result.stdout + result.stderr)[-500:]
        tests = existing(scratch, mutation.tests)
        deselect: list[str] = []
        while True:
            failed, tail = scratch.pytest(tests, mutation.marker, deselect)
            if failed is None:
                return "caught", f"the tests hung (timed out): {' '.join(tests)}"
            if not failed:
                return "MISSED", f"{tail}"
            # Is the failure the mutation's? Only a test that passes unmutated counts.
            with scratch.unmutated(mutation, original):
                new = [t for t in failed if "::" not in t or scratch.passes_unmutated(t, mutation.marker)]
            if new:
                return "caught", new[0]
            deselect += failed
    finally:
        scratch.restore(mutation, original)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", help="names of the mutations to run")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true", help="check that every mutation applies, and exit")
    parser.add_argument("--source", choices=("head", "worktree"), default="head")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    if args.only and len(chosen) != len(args.only):
        raise SystemExit(f"unknown mutations: {set(args.only) - {m.name for m in chosen}}")
    if args.list:
        for m in chosen:
            print(f"{m.name:45} {m.path}: {m.what}\n{'':45} tests: {' '.join(m.tests)} (-m '{m.marker}')")
        return 0
    if args.check:
        stale = 0
        with tempfile.TemporaryDirectory(prefix="fusedoff_mutation_check_") as tmp:
            snapshot(args.source, Path(tmp))
            for m in chosen:
                count = (Path(tmp) / m.path).read_text().count(m.old)
                if count != 1:
                    stale += 1
                    print(f"stale: {m.name} (its text occurs {count} times in {m.path})")
        print(f"{len(chosen) - stale} of {len(chosen)} mutations apply")
        return 1 if stale else 0

    started = time.perf_counter()
    commit = run_command(["git", "log", "-1", "--format=%h %s"], ROOT).stdout.strip()
    print(f"fusedoff mutation check, {time.strftime('%Y-%m-%d')}: a scratch copy of "
          f"{'HEAD ' + commit[:60] if args.source == 'head' else 'the working tree'}; {os.cpu_count()} CPUs, "
          f"no GPU used; nvcc {'found' if shutil.which('nvcc') else 'not found'}", flush=True)
    path = Path(tempfile.mkdtemp(prefix="fusedoff_mutation_check_"))
    try:
        scratch = Scratch(path, args.source)
        caught, missed = 0, []
        for i, m in enumerate(chosen, start=1):
            t0 = time.perf_counter()
            try:
                verdict, details = run_mutation(scratch, m)
            except ValueError as error:
                verdict, details = "STALE", str(error)
            seconds = time.perf_counter() - t0
            subset = f"  [ran: {' '.join(Path(t).name for t in existing(scratch, m.tests))} -m '{m.marker}']"
            print(f"[{i}/{len(chosen)}] {verdict}: {m.name} ({m.path}): {m.what}\n      -> {details}{subset} "
                  f"({seconds:.0f} s)", flush=True)
            if verdict == "caught":
                caught += 1
            else:
                missed.append(m.name)
        print(f"\n{caught} of {len(chosen)} mutations caught ({time.perf_counter() - started:.0f} s)")
        if missed:
            print(f"not caught: {', '.join(missed)}")
        return 0 if caught == len(chosen) else 1
    finally:
        if args.keep:
            print(f"scratch kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
