#!/usr/bin/env bash
# The one command a GPU loan runs (docs/gpu_check.md), from the repository root as it arrives
# on the loan machine: no install, the machine's `python3`, results in at most three files.
#
#   OUT=$OUT bash scripts/gpu_loan.sh                 # on the loan: everything, ~8 minutes
#   OUT=/tmp/loan bash scripts/gpu_loan.sh --dry-run  # the same on the CPU, tiny shapes (CI)
#
# 1. Imports everything and prints the versions (titanax.perf.gpu_check.smoke, ~2 s); a missing
#    package ends the run here with one `error:` line naming it (exit 2).
# 2. python3 -m launch.gpu_check, its sections in order of value (device, kernels, train with
#    cuDNN first, attention, fp8), each row saved as it finishes, working files in
#    $GPU_LOAN_WORK (default runs/gpu_loan), and after every section gpu_check.json,
#    gpu_check.md and logs.tar.gz in $OUT (default runs/gpu_loan/out): a loan returns at most
#    8 files of $OUT, so a run stopped at any point still returns what it measured.
# Other arguments go to launch.gpu_check (--time-limit S, --sections a,b). Wheels carried in
# .loan/site (pip install --target; docs/gpu_check.md) come before the machine's packages.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=src:.
if [ -d .loan/site ]; then extra=src:.:.loan/site; fi
export PYTHONPATH="$extra${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
out=${OUT:-runs/gpu_loan/out}
work=${GPU_LOAN_WORK:-runs/gpu_loan}
mkdir -p "$out" "$work"

echo "== gpu_loan: $(date -u +%FT%TZ) $(hostname) $PWD"
if ! "$PY" -m titanax.perf.gpu_check.smoke; then
    exit 2
fi
exec "$PY" -m launch.gpu_check --out "$work" --pack "$out" "$@"
