#!/usr/bin/env bash
# The one-shot GPU check, for a fresh copy of the repository on a machine with one GPU (an H200) and no
# internet: it uses that machine's own python3, torch, nvcc and ninja. At most 8 minutes
# (SUITE_BUDGET_S=480); every stage has its own timeout, a failed or timed-out stage never stops the
# ones after it, and the verdict table comes last whatever happened.
#
#   stage          limit                      what, into OUTDIR
#   env            30 s                       versions, driver, GPU, tools, and the pinned-memory probe  suite.log
#                                             (cudaHostRegister and pin_memory on 64 MiB: pageable fallback?)
#   peers          60 s, then in background   optional: wheels in $PEER_WHEELS (default .whl/, see
#                                             peer_wheels.sh) installed to a temp dir; DeepSpeed's cpu_adam op
#                                             built beside the extension (stopped if unfinished at bench)
#   build          270 s                      jit_build.py: the one JIT build of fusedoff._C           build.log
#                                             (TORCH_CUDA_ARCH_LIST=9.0) into the suite's own extension dir;
#                                             at its limit the build's processes are stopped and its lock and
#                                             half-linked module removed. Every later stage runs with
#                                             FUSEDOFF_NO_JIT=1: it loads what was built or reports
#                                             "unavailable" at once, and never builds or waits on a lock.
#   tests-streams  60 s                       cuda_tests.py streams: the real streams, pinning, overlap  cuda-tests.log
#                                             and memory tests, first (skipped if the build failed)
#   tests          100 s less the above       cuda_tests.py kernels: every other cuda test, not Triton  cuda-tests.log
#                                             (each test: 60 s at most, TEST_TIMEOUT_S; a test that hangs
#                                             in C ends its pytest, which starts again without it)
#   host-cost      40 s                       bench_host_cost.py --device cuda: per-tensor step cost,   bench.log
#                                             torch fused beside fusedoff resident and streamed (its
#                                             table only: the CSV stays outside OUTDIR)
#   overlap        90 s                       measure_overlap.py: a streamed 1B step and the next forward,  bench.log
#                                             plain and overlapped, measured beside the timed simulator's
#                                             prediction at the link rates measured here
#   host-share     75 s                       measure_host_share.py: a streamed 1B step (fp32 states) with  bench.log
#                                             host_share=0 and "auto", beside the timed simulator's
#                                             prediction at the rates measured here; bits compared
#   bench          what is left but 95 s      bench_step.py --device cuda: the bound, then the targets'  bench.log,
#                                             configurations at 1G, then the sweep 16M..1G; a CSV row per  bench_step_cuda.csv,
#                                             contender as soon as it is measured; everything, building  .png, RESULTS.md
#                                             and warm-ups too, within its deadline
#   report         30 s                       the table and PNG again from the CSV, if the bench was cut short
#   triton         what is left but 35 s      cuda_tests.py triton (each kernel variant compiles on    cuda-tests.log
#                                             first use: last, so it cannot starve the bench)
#   verdict        30 s                       targets.py: stages, then each target beside its figure    stdout
#
# Stage limits shrink so that later stages keep their share when an earlier one runs long. Without a GPU
# the same stages run as a dry run: the tests skip (and the order they would run in is printed), the
# benchmark runs its plumbing on the CPU at tiny sizes (bench_step.py --dry-run).
#
#   bash benchmarks/gpu_suite.sh OUTDIR              (or OUT=OUTDIR bash benchmarks/gpu_suite.sh)
#   bash benchmarks/gpu_suite.sh --rehearse OUTDIR   every stage on a machine without a GPU, in the GPU
#                                                    image's package set (image_packages.txt), with the
#                                                    failures it must survive forced (rehearse.sh)
#
# OUTDIR holds at most 8 files at the end (what the device tool brings back): suite.log, stages.tsv,
# build.log, cuda-tests.log, bench.log, bench_step_<cuda|dry>.csv and .png, RESULTS.md.
# Environment: PYTHON (python3), SUITE_BUDGET_S (480), BUILD_LIMIT_S (270), STREAM_TESTS_LIMIT_S (60),
# TESTS_LIMIT_S (100, both test stages), TEST_TIMEOUT_S (60), PEER_WHEELS (.whl), BENCH_ARGS (more
# bench_step.py arguments), SUITE_EXT_DIR (the extension dir), SUITE_COMMIT (the commit to name, where the
# copy has no .git), TORCH_CUDA_ARCH_LIST (9.0), MAX_JOBS.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-gpu_suite_out}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
budget=${SUITE_BUDGET_S:-480}
t0=$(date +%s)
ext_dir=${SUITE_EXT_DIR:-${TMPDIR:-/tmp}/fusedoff_suite_ext_$(id -u)}
mkdir -p "$ext_dir"
# TORCH_EXTENSIONS_DIR: the suite's own, so that a lock found in it can only be a stopped build's
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1 \
  TORCH_EXTENSIONS_DIR=$ext_dir
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # fusedoff from this checkout
unset FUSEDOFF_NO_JIT  # until the build stage has run
for f in stages.tsv suite.log build.log cuda-tests.log bench.log; do : > "$out/$f"; done

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

# ---- env: what this machine is, first ----------------------------------------------------------------
say "== fusedoff GPU suite, $(date -u +%FT%TZ), commit ${SUITE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
run_stage env 30 suite.log "$py" benchmarks/gpu_suite/machine.py
env_rc=$?
sed -n '/^-- env:/,$p' "$out/suite.log" | tail -n +2  # what it found, on the terminal too
{
  echo "cpus $(nproc), $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}'), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" \
    "MAX_JOBS=$MAX_JOBS TORCH_EXTENSIONS_DIR=$ext_dir"
  nvidia-smi 2>&1 | head -n 20
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

# ---- build: once; every later stage loads what it built, or nothing ------------------------------------
# jit_build.py stops the build at its limit (cleanly: its lock removed); the stage's own timeout, later,
# is only a backstop
blim=$(limit "${BUILD_LIMIT_S:-270}" 160)
run_stage build $(( blim + 60 )) build.log "$py" benchmarks/gpu_suite/jit_build.py --ext-dir "$ext_dir" --limit-s "$blim"
build=$?
export FUSEDOFF_NO_JIT=1

# ---- tests: the real streams first, each test under a time limit -----------------------------------------
tests=0
test_args=(--timeout-s "${TEST_TIMEOUT_S:-60}")
if [ "$gpu" = 0 ]; then
  "$py" benchmarks/gpu_suite/cuda_tests.py streams kernels triton --collect-only >> "$out/cuda-tests.log" 2>&1
  say "-- tests: no GPU, the cuda tests skip; the order they would run in is in cuda-tests.log"
fi
if [ "$build" -eq 0 ]; then
  tests_t0=$(date +%s)
  lim=$(limit "${STREAM_TESTS_LIMIT_S:-60}" 120)  # before the other tests: they only get what is left
  run_stage tests-streams "$lim" cuda-tests.log "$py" benchmarks/gpu_suite/cuda_tests.py streams "${test_args[@]}" \
    --deadline-s $(( lim - 15 ))
  tests=$?
  lim=$(( ${TESTS_LIMIT_S:-100} - ($(date +%s) - tests_t0) ))
  (( lim < 30 )) && lim=30
  lim=$(limit "$lim" 170)
  run_stage tests "$lim" cuda-tests.log "$py" benchmarks/gpu_suite/cuda_tests.py kernels "${test_args[@]}" \
    --deadline-s $(( lim - 15 ))
  tests=$(( tests || $? ))
else
  skip_stage tests-streams "the build failed"
  skip_stage tests "the build failed"
fi

# ---- bench -------------------------------------------------------------------------------------------
skip=()
if [ -n "$ds_pid" ]; then
  # wait for DeepSpeed's op while at least 240 s stay for the bench (2 minutes at most), then give up on it
  ds_wait=$(( $(left) - 240 ))
  (( ds_wait > 120 )) && ds_wait=120
  while kill -0 "$ds_pid" 2> /dev/null && (( ds_wait > 0 )); do sleep 2; ds_wait=$(( ds_wait - 2 )); done
  kill "$ds_pid" 2> /dev/null
  wait "$ds_pid" 2> /dev/null
  if ! grep -q "deepspeed cpu_adam op ready" "$ds_log"; then
    # stopped or failed: the bench must not build it again, nor wait on the lock a stopped build leaves
    rm -f "$ext_dir"/cpu_adam*/lock
    skip=(--skip zero_offload)
    say "-- deepspeed: its op was not built in time (or failed); the ZeRO-Offload peer is skipped"
  fi
  { echo "== deepspeed cpu_adam op build"; cat "$ds_log"; } >> "$out/build.log" 2>&1
fi
if [ "$build" -eq 0 ]; then
  if [ "$gpu" = 1 ]; then host_cost=(--device cuda --repeats 10); else host_cost=(--device cpu --shapes 20x64 --repeats 2 --warmup 1); fi
  run_stage host-cost "$(limit 40 200)" bench.log "$py" benchmarks/bench_host_cost.py "${host_cost[@]}" \
    --out-dir "$(mktemp -d)"
  if [ "$gpu" = 1 ]; then overlap_args=(); else overlap_args=(--dry-run); fi
  run_stage overlap "$(limit 90 200)" bench.log "$py" benchmarks/measure_overlap.py ${overlap_args[@]+"${overlap_args[@]}"}
  run_stage host-share "$(limit 75 180)" bench.log "$py" benchmarks/measure_host_share.py ${overlap_args[@]+"${overlap_args[@]}"}
else
  skip_stage host-cost "the build failed"
  skip_stage overlap "the build failed"
  skip_stage host-share "the build failed"
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
  lim=$(limit 600 35)
  run_stage triton "$lim" cuda-tests.log "$py" benchmarks/gpu_suite/cuda_tests.py triton "${test_args[@]}" \
    --deadline-s $(( lim - 10 ))
  tests=$(( tests || $? ))
else
  skip_stage triton "the build failed"
fi

# ---- verdict -----------------------------------------------------------------------------------------
rm -f "$out"/.*.partial  # a CSV being written when the bench was stopped (the complete one is in place)
{
  echo
  echo "== GPU suite verdict ($(date -u +%FT%TZ), $(( $(date +%s) - t0 )) s of a ${budget} s budget) =="
  timeout 30 "$py" benchmarks/gpu_suite/targets.py "$out" 2>&1 || { echo "(targets.py failed; the stages:)"; cat "$out/stages.tsv"; }
} | tee -a "$out/suite.log"
exit $(( env_rc || build || tests || bench ))
