#!/usr/bin/env bash
# The one command a GPU loan runs (docs/gpu_check.md), from the repository root as it arrives
# on the loan machine: no install, the machine's `python3`, results in at most three files.
#
#   OUT=$OUT bash scripts/gpu_loan.sh                 # on the loan: everything, at most 545 s
#   OUT=/tmp/loan bash scripts/gpu_loan.sh --dry-run  # the same on the CPU, tiny shapes (CI)
#
# 1. Preflight (launch.gpu_check --preflight, at most ~35 s): every package imports (a missing
#    one: one `error:` line naming it, exit 2), jax is the pinned 0.11.2, and, on the loan,
#    jax has a GPU: JAX_PLATFORMS=cuda, so a CUDA plugin that fails to start is one `error:`
#    line (what jax said, the plugins and CUDA versions found) and a gpu_check.json/.md in
#    $OUT saying so, exit 3, instead of a loan spent on the CPU.
# 2. python3 -m launch.gpu_check, its sections in order of value (device, kernels, train with
#    cuDNN first, attention, fp8, choices: the A/B rows of choices.py, each default chosen
#    without a GPU against its alternative, first the sm90 fused backward, shipped on by the
#    static bound, against the dq and dkv kernels at head_dim 128 and 64) under a 510 s limit
#    that includes killing a section past its budget, each row saved as it finishes, working
#    files in
#    $GPU_LOAN_WORK (default runs/gpu_loan), and after every section gpu_check.json,
#    gpu_check.md and logs.tar.gz in $OUT (default runs/gpu_loan/out): a loan returns at most
#    8 files of $OUT, so a run stopped at any point still returns what it measured. Sections
#    run in this command's process group: the loan's own limit takes them down with it.
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
dry=0
for arg in "$@"; do [ "$arg" = --dry-run ] && dry=1; done
if [ "$dry" = 0 ]; then
    export JAX_PLATFORMS=cuda  # never a silent fall-back to the CPU
fi

echo "== gpu_loan: $(date -u +%FT%TZ) $(hostname) $PWD"
if [ "$dry" = 1 ]; then
    "$PY" -m launch.gpu_check --preflight --dry-run --out "$work" --pack "$out" || exit $?
else
    "$PY" -m launch.gpu_check --preflight --out "$work" --pack "$out" || exit $?
fi
exec "$PY" -m launch.gpu_check --out "$work" --pack "$out" "$@"
