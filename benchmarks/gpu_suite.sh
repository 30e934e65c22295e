#!/usr/bin/env bash
# The GPU suite's entry point; its machinery lives in benchmarks/gpu_suite/ (run.sh says what each stage
# does, rehearse.sh what the rehearsal checks).
#
#   bash benchmarks/gpu_suite.sh OUTDIR              the one-shot GPU check (gpu_suite/run.sh)
#   bash benchmarks/gpu_suite.sh --rehearse OUTDIR   every stage on a machine without a GPU (gpu_suite/rehearse.sh)
set -uo pipefail
here=$(dirname "$0")/gpu_suite
if [ "${1:-}" = --rehearse ]; then
  shift
  exec bash "$here/rehearse.sh" "$@"
fi
exec bash "$here/run.sh" "$@"
