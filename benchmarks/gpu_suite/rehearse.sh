#!/usr/bin/env bash
# The GPU suite's rehearsal on a machine without a GPU (CI runs it, so that the suite cannot rot between
# the rare GPU runs): gpu_suite.sh runs for real, every stage, in a copy of this working tree (no prebuilt
# extension, like the fresh copy a GPU machine gets), with the GPU machine's own package set, and the
# failures the GPU run must survive are forced.
#
# The GPU machine's image is fixed (no internet): torch 2.11.0, triton 3.6.0, Python 3.12, no expecttest,
# deepspeed, torchao or bitsandbytes. benchmarks/gpu_suite/image_packages.txt lists what of it the suite uses and
# every distribution the image holds; every check here runs with the python of a venv (.venv-gpu-image,
# made from that file with Python 3.12 where there is one, and kept while the file is unchanged) that
# holds those packages and nothing else, so a package the suite needs and the image lacks fails here.
#
#   check (in order) what it shows
#   image-packages the venv holds the file's versions and no distribution the image lacks (image_packages.py)
#   build-timeout  a JIT build stopped at its limit in mid-compile (--limit-s 3 counted from the compile)
#                  leaves no lock, no module and no compiler behind; then, beside a stale lock planted
#                  where torch <= 2.11 would wait on it for ever, a load with FUSEDOFF_NO_JIT=1 reports
#                  "unavailable" at once
#   suite          bash benchmarks/gpu_suite.sh: every stage exits 0. env; build: the real JIT build
#                  (C++ only: nvcc on 2 cores would not fit) into a fresh dir; tests-streams, tests,
#                  triton: the cuda tests skip here, and cuda-tests.log lists the order they would run in;
#                  bench: the dry run, a CSV row per contender; report; the verdict
#   test-collection each test stage collected its tests (pytest's exit 2, a collection error, or "no tests"
#                  fail it), and which modules skipped for a package the image lacks
#   test-order     that order: test_offload, test_optimizer_state, test_memory before any other cuda test
#   verdict        the suite printed its stages and the targets table
#   test-timeouts  under cuda_tests.py: a test past --test-timeout fails and the run goes on; a test stuck
#                  where the signal cannot reach it ends its pytest, which starts again without it, and the
#                  test after it runs
#   bench-kill     a dry-run bench (loading the suite's build with FUSEDOFF_NO_JIT=1) killed with SIGKILL
#                  after the first rows of its first group keeps every row it had written, in a CSV that
#                  reads back whole
#
#   bash benchmarks/gpu_suite.sh --rehearse OUTDIR     (default $TMPDIR/fusedoff_gpu_suite_rehearsal)
#
# PYTHON: run with this python instead (not the image's package set: image-packages says what differs);
# GPU_IMAGE_VENV (.venv-gpu-image); GPU_IMAGE_BASE_PYTHON (python3.12, else pyenv's 3.12, else python3): what
# makes that venv; MAX_JOBS (2).
# Exit status 1 if any check fails. It prints each check, then a table, and the time it took.
set -uo pipefail
{  # read whole before it runs: an edit to this file during a rehearsal cannot change the rehearsal
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-${TMPDIR:-/tmp}/fusedoff_gpu_suite_rehearsal}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
rm -rf "$out/suite"
t0=$(date +%s)
: > "$out/checks.tsv"
check() {  # check NAME PASS(0/1/2: not run) DETAIL
  local verdict=PASS
  [ "$2" = 0 ] || verdict=FAIL
  [ "$2" = 2 ] && verdict=SKIP
  printf '%s\t%s\t%s\n' "$1" "$verdict" "$3" >> "$out/checks.tsv"
  echo "[$verdict] $1: $3"
}

# ---- the GPU image's packages, in a venv of their own ----------------------------------------------------
packages=benchmarks/gpu_suite/image_packages.txt
venv_s=0
made=0
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
else
  venv=${GPU_IMAGE_VENV:-$PWD/.venv-gpu-image}
  base=${GPU_IMAGE_BASE_PYTHON:-}
  if [ -z "$base" ]; then  # the image's Python is 3.12: a pyenv shim of a version not selected does not run
    for base in python3.12 "$(pyenv root 2> /dev/null)"/versions/3.12*/bin/python3.12 python3; do
      "$base" -c "" 2> /dev/null && break
    done
  fi
  # made again when the file, the constraints or the base python change
  wanted=$(cat "$packages" constraints-oldest.txt; "$base" --version 2>&1)
  if [ "$(cat "$venv/.gpu-image-packages" 2> /dev/null)" != "$wanted" ]; then
    start=$(date +%s)
    echo "== making $venv with $("$base" --version 2>&1) from $packages"
    [ ! -e "$venv" ] || [ -f "$venv/pyvenv.cfg" ] || { echo "$venv is not a venv: not replaced"; exit 1; }
    rm -rf "$venv"
    "$base" -m venv "$venv" > "$out/image-venv.log" 2>&1 &&
      "$venv/bin/pip" install --quiet -c constraints-oldest.txt -r "$packages" >> "$out/image-venv.log" 2>&1 &&
      echo "$wanted" > "$venv/.gpu-image-packages"
    made=$?
    venv_s=$(( $(date +%s) - start ))
  fi
  py=$venv/bin/python
fi
"$py" benchmarks/gpu_suite/image_packages.py > "$out/image-packages.log" 2>&1
rc=$?
found=$(tr '\n' ' ' < "$out/image-packages.log" | cut -c1-700)
if [ "$made" != 0 ]; then
  check image-packages 1 "making the venv failed (image-venv.log): $(grep -v "is ignored" "$out/image-venv.log" | tail -n 3 | tr '\n' ' ')"
elif [ -n "${PYTHON:-}" ]; then
  check image-packages 2 "PYTHON=$py given, not the image's package set: $found"
else
  check image-packages "$rc" "$venv $( ((venv_s)) && echo "made in $venv_s s" || echo "as made before"); $found"
fi
scratch=$(mktemp -d "${TMPDIR:-/tmp}/fusedoff_rehearsal.XXXXXX")
bench_pid=
cleanup() { [ -n "$bench_pid" ] && kill -9 "$bench_pid" 2> /dev/null; rm -rf "$scratch"; }
trap cleanup EXIT
repo=$scratch/repo
mkdir -p "$repo"
git ls-files -z -co --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2> /dev/null | tar -xf - -C "$repo"
# FUSEDOFF_NO_PREBUILT: an editable install here may still point at this checkout's own prebuilt module
# TORCH_EXTENSIONS_DIR: nothing here builds into (or waits on) the shared cache; each check names its own
export PYTHON=$py FUSEDOFF_NO_PREBUILT=1 FUSEDOFF_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} PYTHONUNBUFFERED=1 \
  TORCH_EXTENSIONS_DIR=$scratch/ext-unused
unset FUSEDOFF_NO_JIT
echo "== rehearsal of the GPU suite in $repo ($(date -u +%FT%TZ), $(nproc) CPUs, MAX_JOBS=$MAX_JOBS)"

# ---- build-timeout ------------------------------------------------------------------------------------
ext=$scratch/ext-stopped
(cd "$repo" && "$py" benchmarks/gpu_suite/jit_build.py --ext-dir "$ext" --limit-s 3 --limit-from compile) \
  > "$out/build-timeout.log" 2>&1
rc=$?
build_dir=$(ls -d "$ext"/fusedoff_C_* 2> /dev/null | head -n 1)
left=$(ls "$build_dir"/lock "$build_dir"/*.so 2> /dev/null | tr '\n' ' ')
sleep 1
compilers=$(pgrep -f -- "$repo/csrc" | tr '\n' ' ')
ok=1
[ "$rc" = 124 ] && [ -n "$build_dir" ] && [ -z "$left" ] && [ -z "$compilers" ] && grep -q "took its lock" "$out/build-timeout.log" && ok=0
check build-timeout-stop "$ok" "jit_build.py exit $rc (124: timed out); left behind: ${left:-nothing}; compilers still running: ${compilers:-none}"
touch "$build_dir/lock"  # what a build killed under torch <= 2.11 leaves: later loads would wait on it for ever
start=$(date +%s)
(cd "$repo" && FUSEDOFF_NO_JIT=1 TORCH_EXTENSIONS_DIR=$ext timeout 120 "$py" -c "
from fusedoff._ext import load_extension, NativeExtensionUnavailable
try:
    load_extension()
except NativeExtensionUnavailable as exc:
    print('unavailable:', exc)
") > "$out/no-jit-load.log" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
ok=1
[ "$rc" = 0 ] && grep -q "^unavailable: .*FUSEDOFF_NO_JIT" "$out/no-jit-load.log" && ok=0
check build-timeout-no-wait "$ok" "FUSEDOFF_NO_JIT=1 load beside a stale lock: exit $rc after ${took} s (python and torch's import included): $(head -c 160 "$out/no-jit-load.log")"

# ---- the suite itself ----------------------------------------------------------------------------------
start=$(date +%s)
# SUITE_BUDGET_S 900: a loaded CI machine builds slower than the GPU machine; every stage must still run
commit="$(git rev-parse --short HEAD 2> /dev/null || echo '?')$(git diff --quiet HEAD 2> /dev/null || echo '+changes')"
SUITE_COMMIT=$commit SUITE_EXT_DIR=$scratch/ext BENCH_ARGS=${BENCH_ARGS:---sizes 1M} SUITE_BUDGET_S=${SUITE_BUDGET_S:-900} \
  bash "$repo/benchmarks/gpu_suite.sh" "$out/suite" > "$out/suite-stdout.log" 2>&1
rc=$?
stages=$(cut -f1,2 "$out/suite/stages.tsv" | tr '\t\n' '= ' )
check suite "$rc" "gpu_suite.sh exit $rc in $(( $(date +%s) - start )) s; stages (exit status): $stages"
echo "    $(grep "^build\s" "$out/suite/stages.tsv" | cut -f5) (the stage: $(grep "^build\s" "$out/suite/stages.tsv" | cut -f3) s)"
# test-collection: each stage's pytest ran every test the listing gave it (here they all skip), and nothing
# failed to collect; a module that skips whole for a package the image lacks is named
log=$out/suite/cuda-tests.log
ok=0
ran=
for group in streams kernels triton; do
  listed=$(sed -n "s/^== $group: \([0-9]*\) tests, in this order:$/\1/p" "$log" | head -n 1)
  line=$(grep -E "^$group: .*; exit [0-9]+$" "$log" | tail -n 1)
  counts=${line#"$group": }
  total=$(echo "${counts%; exit *}" | awk -F', ' '{ for (i = 1; i <= NF; i++) { split($i, w, " "); if (w[1] ~ /^[0-9]+$/) s += w[1] } } END { print s + 0 }')
  if [ -n "$line" ]; then ran="$ran$group: ${listed:-?} listed, ${counts%; exit *} (exit ${counts##*exit }); "
  else ran="$ran$group: ${listed:-?} listed, not run; "; fi
  [ "${listed:-0}" -gt 0 ] && [ "${total:-0}" = "$listed" ] && [[ "$line" == *"; exit 0" ]] || ok=1
done
errors=$(grep -c -E "^ERROR collecting|errors? during collection" "$log")
[ "$errors" = 0 ] || ok=1
skipped=$(sed -n "s/^  skipped \(tests\/[^:]*\): needs \([^,]*\),.*/\1 (\2)/p" "$log" | sort -u | tr '\n' ' ')
check test-collection "$ok" "${ran}collection errors: $errors; modules skipped whole: ${skipped:-none}"
order=$(grep -n "^  tests/" "$out/suite/cuda-tests.log" | head -n 400)
first_other=$(echo "$order" | grep -v -E "tests/test_(offload|optimizer_state|memory)\.py" | head -n 1 | cut -d: -f1)
last_stream=$(echo "$order" | grep -E "tests/test_(offload|optimizer_state|memory)\.py" | tail -n 1 | cut -d: -f1)
ok=1
[ -n "$first_other" ] && [ -n "$last_stream" ] && (( last_stream < first_other )) && ok=0
check test-order "$ok" "$(grep -c "^  tests/" "$out/suite/cuda-tests.log") cuda tests listed; the real-stream ones first: $(grep "^== " "$out/suite/cuda-tests.log" | head -n 3 | tr '\n' ' ')"
ok=1
grep -q "== GPU suite verdict" "$out/suite/suite.log" && grep -q "| target | wanted | measured | verdict |" "$out/suite/suite.log" && ok=0
check verdict "$ok" "$(grep -c '| \(meets\|MISSES\|not measured\) |' "$out/suite/suite.log") targets in the table; $(grep "rows measured" "$out/suite/suite.log" | head -n 1)"

# ---- test-timeouts (written into the copy only) -------------------------------------------------------
cat > "$repo/tests/test_rehearsal_hangs.py" << 'EOF'
import signal
import time


def test_1_passes():
    pass


def test_2_too_slow():  # past --test-timeout: fails, and the run goes on
    time.sleep(60)


def test_3_stuck_in_c():  # SIGALRM held off, as in a CUDA synchronisation that never returns
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)


def test_4_after_the_hang():  # runs in the pytest started again
    pass
EOF
(cd "$repo" && "$py" benchmarks/gpu_suite/cuda_tests.py --paths tests/test_rehearsal_hangs.py --timeout-s 2 --grace-s 3) \
  > "$out/test-timeouts.log" 2>&1
rc=$?
rm -f "$repo/tests/test_rehearsal_hangs.py"
last=$(tail -n 1 "$out/test-timeouts.log")
ok=1
[ "$rc" = 1 ] && [[ "$last" == "tests: 2 passed, 1 timed-out (test_2_too_slow), 1 hung (test_3_stuck_in_c); exit 1" ]] && ok=0
check test-timeouts "$ok" "exit $rc; $last"

# ---- bench-kill ---------------------------------------------------------------------------------------
kill_dir=$scratch/bench-kill
# the extension the suite built, loaded as the suite's bench loads it (FUSEDOFF_NO_JIT: no build, no lock)
(cd "$repo" && FUSEDOFF_NO_JIT=1 TORCH_EXTENSIONS_DIR=$scratch/ext exec "$py" benchmarks/bench_step.py --dry-run \
  --sizes 1M --optimizers adamw --precisions bf16_master --out-dir "$kill_dir") > "$out/bench-kill.log" 2>&1 &
bench_pid=$!
count_rows='
import csv, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except (OSError, csv.Error):
    rows = []
print(sum(1 for r in rows if r.get("optimizer")))  # contender rows (the bound rows have none)'
seen=0
for _ in $(seq 600); do  # the first two contender rows of the first group, two minutes at most
  seen=$("$py" -c "$count_rows" "$kill_dir/bench_step_dry.csv" 2> /dev/null || echo 0)
  (( seen >= 2 )) && break
  kill -0 "$bench_pid" 2> /dev/null || break
  sleep 0.2
done
kill -9 "$bench_pid" 2> /dev/null
wait "$bench_pid" 2> /dev/null
bench_pid=
kept=$("$py" -c "$count_rows" "$kill_dir/bench_step_dry.csv" 2> /dev/null || echo 0)
group=$(grep -c "^  [a-z_0-9]* \.\.\.$" "$out/bench-kill.log")
ok=1
(( seen >= 2 && kept >= seen && kept < 9 )) && ok=0
check bench-kill "$ok" "killed after $seen contender rows had been written (of the group's 9; $group started): the CSV keeps $kept"
cp "$kill_dir/bench_step_dry.csv" "$out/bench-kill.csv" 2> /dev/null

# ---- the table ------------------------------------------------------------------------------------------
echo
echo "== rehearsal: $(( $(date +%s) - t0 )) s$( ((venv_s)) && echo ", $venv_s s of it making the venv") =="
echo "| check | result | detail |"
echo "|---|---|---|"
sed 's/\t/ | /g; s/^/| /; s/$/ |/' "$out/checks.tsv"
! grep -q "	FAIL	" "$out/checks.tsv"
exit
}
