#!/usr/bin/env bash
# The one-shot GPU check, for a fresh copy of the repository on a machine with one GPU (an H200) and no
# internet: it uses that machine's own python3, torch, nvcc and ninja. At most 8 minutes
# (SUITE_BUDGET_S=480); every stage has its own timeout, a failed or timed-out stage never stops the
# ones after it, and the verdict table comes last whatever happened. The benchmark measures the bound
# first, then loads the extension (finishing, on its own clock, a JIT build the build stage left
# unfinished) and measures the peers even without it.
#
#   stage    limit                         what, into OUTDIR
#   env      -                             nvidia-smi, versions, tools                      suite.log
#   peers    60 s, then in the background  optional: wheels in $PEER_WHEELS (default .whl/, see
#                                          peer_wheels.sh) installed to a temp dir; DeepSpeed's cpu_adam
#                                          op built beside the extension (killed if unfinished at bench)
#   build    270 s                         JIT build of fusedoff._C, TORCH_CUDA_ARCH_LIST=9.0   build.log
#                                          (about 200 s on 2 loaded cores here; ops.cpp is the long pole)
#   tests    100 s                         pytest -m "cuda and not triton": the CUDA kernels,   cuda-tests.log
#                                          the streams, FSDP2 on one GPU (skipped if the build failed)
#   bench    what is left but 35 s         bench_step.py --device cuda: the bound, then the     bench.log,
#                                          targets' configurations at 1G, then the sweep         bench_step_cuda.csv,
#                                          16M..1G; stops starting work at its deadline         .png, RESULTS.md
#   report   30 s                          the table and PNG again from the CSV, if the bench was cut short
#   triton   what is left but 35 s         pytest -m "cuda and triton" (each kernel variant     cuda-tests.log
#                                          compiles on first use: last, so it cannot starve the bench)
#   verdict  30 s                          targets.py: stages, then each target beside its figure   stdout
#
# Stage limits shrink so that later stages keep their share when an earlier one runs long. Without a GPU
# the same stages run as a dry run (the tests skip; bench_step.py --dry-run on the CPU, tiny sizes).
#
#   bash benchmarks/gpu_suite.sh OUTDIR        (or OUT=OUTDIR bash benchmarks/gpu_suite.sh)
#
# OUTDIR holds at most 8 files at the end (what the device tool brings back): suite.log, stages.tsv,
# build.log, cuda-tests.log, bench.log, bench_step_<cuda|dry>.csv and .png, RESULTS.md.
# Environment: PYTHON (python3), SUITE_BUDGET_S (480), BUILD_LIMIT_S (270), TESTS_LIMIT_S (100),
# PEER_WHEELS (.whl), BENCH_ARGS (extra bench_step.py arguments), TORCH_CUDA_ARCH_LIST (9.0), MAX_JOBS.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_suite_out}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
budget=${SUITE_BUDGET_S:-480}
t0=$(date +%s)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # fusedoff from this checkout, built in place by the JIT
: > "$out/stages.tsv"
: > "$out/suite.log"

say() { echo "$*" | tee -a "$out/suite.log"; }
left() { echo $(( budget - ($(date +%s) - t0) )); }
# limit WANTED RESERVE: WANTED seconds, or fewer so that RESERVE seconds stay for the stages after (>= 5)
limit() { local l=$(( $(left) - $2 )); (( l > $1 )) && l=$1; (( l < 5 )) && l=5; echo "$l"; }
# run_stage NAME LIMIT LOG COMMAND...: the command under a timeout, its output appended to LOG;
# stages.tsv gets name, exit status (124/137: timed out), seconds, limit and the log's last line.
run_stage() {
  local name=$1 lim=$2 logf=$3 start rc
  shift 3
  start=$(date +%s)
  say "-- $name: limit ${lim} s, $(left) s of the budget left ($(date -u +%T))"
  timeout -k 10 "$lim" "$@" >> "$out/$logf" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$lim" \
    "$(grep -v '^\s*$' "$out/$logf" | tail -n 1 | tr '\t' ' ' | cut -c1-200)" >> "$out/stages.tsv"
  return "$rc"
}
skip_stage() { printf '%s\t200\t0\t0\t%s\n' "$1" "$2" >> "$out/stages.tsv"; say "-- $1: skipped ($2)"; }

# ---- env ---------------------------------------------------------------------------------------------
{
  echo "== fusedoff GPU suite, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi 2>&1 | head -n 20
  "$py" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda',
torch.version.cuda, '| gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1) | ninja $(ninja --version 2>/dev/null) | c++ $(c++ -dumpversion 2>/dev/null)"
  echo "cpus $(nproc), $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}'), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
} >> "$out/suite.log" 2>&1
gpu=0
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && gpu=1
if [ "$gpu" = 1 ]; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}  # DeepSpeed's wheel built on a CPU machine would otherwise guess
else
  say "NO GPU: a dry run (the tests skip, the benchmark runs its plumbing on the CPU)"
fi

# ---- peers (optional) --------------------------------------------------------------------------------
wheels=${PEER_WHEELS:-.whl}
if compgen -G "$wheels/*.whl" > /dev/null; then
  run_stage peer-wheels 60 suite.log "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/fusedoff_peers "$wheels"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/fusedoff_peers"
fi
ds_log=/tmp/fusedoff_deepspeed_op.log
ds_pid=
if "$py" -c "import deepspeed" > /dev/null 2>&1; then
  # DeepSpeedCPUAdam JIT-builds its op on first use: build it now, beside the extension, not in the bench.
  timeout 300 "$py" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load();
print('deepspeed cpu_adam op ready')" > "$ds_log" 2>&1 &
  ds_pid=$!
else
  say "-- deepspeed: not importable here, the ZeRO-Offload peer will say so"
fi

# ---- build -------------------------------------------------------------------------------------------
run_stage build "$(limit "${BUILD_LIMIT_S:-270}" 160)" build.log "$py" -c "
import time; t = time.time()
from fusedoff._ext import load_extension
m = load_extension()
print(f'built: cuda kernels {m.with_cuda}, cpu isa {m.cpu_isa()}, {time.time() - t:.0f} s')"
build=$?

# ---- tests -------------------------------------------------------------------------------------------
tests=0
if [ "$build" -eq 0 ]; then
  run_stage tests "$(limit "${TESTS_LIMIT_S:-100}" 170)" cuda-tests.log \
    "$py" -m pytest -m "cuda and not triton" -q -p no:cacheprovider -rfE
  tests=$?
else
  skip_stage tests "the build failed"
fi

# ---- bench -------------------------------------------------------------------------------------------
skip=()
if [ -n "$ds_pid" ]; then
  # wait for DeepSpeed's op while at least 240 s stay for the bench (2 minutes at most), then give up on it
  ds_wait=$(( $(left) - 240 ))
  (( ds_wait > 120 )) && ds_wait=120
  while kill -0 "$ds_pid" 2> /dev/null && (( ds_wait > 0 )); do sleep 2; ds_wait=$(( ds_wait - 2 )); done
  if kill -0 "$ds_pid" 2> /dev/null; then
    kill "$ds_pid" 2> /dev/null
    skip=(--skip zero_offload)
    say "-- deepspeed: its op was not built in time; the ZeRO-Offload peer is skipped"
  fi
  wait "$ds_pid" 2> /dev/null
  { echo "== deepspeed cpu_adam op build"; cat "$ds_log"; } >> "$out/build.log" 2>&1
fi
deadline=$(( $(left) - 35 - ${TRITON_TESTS_S:-60} ))  # the Triton tests run after the bench
(( deadline < 10 )) && deadline=10
if [ "$gpu" = 1 ]; then mode=(--device cuda); name=bench_step_cuda; else mode=(--dry-run); name=bench_step_dry; fi
# shellcheck disable=SC2086
run_stage bench $(( deadline + 15 )) bench.log "$py" benchmarks/bench_step.py "${mode[@]}" --out-dir "$out" \
  --deadline-s "$deadline" ${skip[@]+"${skip[@]}"} ${BENCH_ARGS:-}
bench=$?
csv="$out/$name.csv"
if [ -f "$csv" ] && { [ "$bench" -ne 0 ] || [ "$csv" -nt "$out/$name.png" ]; }; then
  run_stage report "$(limit 30 15)" bench.log "$py" benchmarks/bench_step.py --from-csv "$csv" --out-dir "$out"
fi

# ---- triton tests -------------------------------------------------------------------------------------
if [ "$build" -eq 0 ]; then
  run_stage triton "$(limit 600 35)" cuda-tests.log "$py" -m pytest -m "cuda and triton" -q -p no:cacheprovider -rfE
  tests=$(( tests || $? ))
else
  skip_stage triton "the build failed"
fi

# ---- verdict -----------------------------------------------------------------------------------------
{
  echo
  echo "== GPU suite verdict ($(date -u +%FT%TZ), $(( $(date +%s) - t0 )) s of a ${budget} s budget) =="
  timeout 30 "$py" benchmarks/targets.py "$out" 2>&1 || { echo "(targets.py failed; the stages:)"; cat "$out/stages.tsv"; }
} | tee -a "$out/suite.log"
exit $(( build || tests || bench ))
