#!/usr/bin/env bash
# One entry point that sets up a fresh machine (no GPU needed) and then runs what you ask:
#   bash scripts/dev.sh train [launch.train flags...]   # the default tiny run on CPU
#   bash scripts/dev.sh test  [pytest flags...]         # the test suite
#   bash scripts/dev.sh setup                           # only create .venv (and .venv-torch)
#   bash scripts/dev.sh cuda-plugin                     # .venv plus the CUDA plugin (4.9 GB):
#                                                       # deviceless GPU compiles for launch.plan
# Set-up: a Python 3.12 virtual environment in .venv with the pinned versions of
# constraints.txt (jax/jaxlib 0.11.2, the GPU image's version). Re-running it is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for p in "${TITANAX_PYTHON:-}" python3.12 \
           "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.12.1/bin/python3")" \
           "$HOME/.pyenv/versions/3.12.1/bin/python3" python3; do
    [ -n "$p" ] || continue
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  echo "error: titanax needs Python >= 3.12 (jax 0.11 does); install it (e.g. pyenv install 3.12) or set TITANAX_PYTHON" >&2
  return 1
}

setup() {
  local stamp=.venv/.titanax-installed
  if [ -f "$stamp" ] && [ "$stamp" -nt constraints.txt ] && [ "$stamp" -nt pyproject.toml ]; then
    return 0
  fi
  local py; py=$(find_python)
  [ -x .venv/bin/python ] || "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # eval: lm-evaluation-harness for launch.eval and tests/test_eval.py (no torch: its core needs none).
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test,eval]"
  touch "$stamp"
}

# The PyTorch peer (Python 3.11: the CPU torch wheel on these machines is built for it): used by
# tests that check HF exports with transformers and by the PyTorch baseline benchmark.
setup_torch() {
  local stamp=.venv-torch/.titanax-installed
  if [ -f "$stamp" ] && [ "$stamp" -nt constraints-torch.txt ]; then
    return 0
  fi
  local py=${TITANAX_TORCH_PYTHON:-python3.11}
  if ! command -v "$py" >/dev/null 2>&1; then
    echo "note: no $py; tests that compare against transformers will skip" >&2
    return 0
  fi
  [ -x .venv-torch/bin/python ] || "$py" -m venv .venv-torch
  # lm_eval + accelerate: lm-eval's own `hf` model, the reference tests/test_eval.py compares with.
  # peft: the LoRA reference of tests/test_lora_export.py.
  .venv-torch/bin/python -m pip install -q -c constraints-torch.txt torch transformers safetensors numpy \
    lm_eval==0.4.13 accelerate peft
  touch "$stamp"
}

# The CUDA PJRT plugin (4.9 GB with its CUDA wheels) for deviceless GPU compiles in the tests
# (titanax.perf.aot): pip --target into .venv/cuda-plugin, outside .venv's site-packages, so
# only the subprocesses that put it on sys.path (with JAX_PLATFORMS=cpu) ever load CUDA.
setup_cuda_plugin() {
  local dir=.venv/cuda-plugin stamp=.venv/cuda-plugin/.titanax-installed
  if [ -f "$stamp" ] && [ "$stamp" -nt constraints-cuda.txt ]; then
    return 0
  fi
  rm -rf "$dir.partial"
  if .venv/bin/python -m pip install -q --target "$dir.partial" -c constraints-cuda.txt \
       "jax-cuda12-plugin[with-cuda]==0.11.2"; then
    setup_nvdisasm "$dir.partial"
    rm -rf "$dir" && mv "$dir.partial" "$dir" && touch "$stamp"
  else
    rm -rf "$dir.partial"
    echo "note: could not install the CUDA plugin; deviceless GPU compile tests will skip" >&2
  fi
}

# nvdisasm for the SASS audit (titanax.perf.sass_audit, launch.ptxas_report --sass): the
# nvidia-cuda-nvdisasm wheel (CUDA 13 only on PyPI; it reads sm_90a and sm_100a cubins) in
# tools/, off sys.path (its nvidia/cu13 would make jax take nvidia.cu13, which has no ptxas,
# for its CUDA path), linked into nvidia/cuda_nvcc/bin where jaxlib's MOSAIC_GPU_DUMP_SASS
# runs it ($CUDA_ROOT/bin/nvdisasm). Without it the SASS tests skip (fail in CI).
setup_nvdisasm() {
  local dir=$1
  if .venv/bin/python -m pip install -q --no-deps --target "$dir/tools" -c constraints-cuda.txt \
       nvidia-cuda-nvdisasm; then
    ln -sf ../../../tools/nvidia/cu13/bin/nvdisasm "$dir/nvidia/cuda_nvcc/bin/nvdisasm"
  else
    echo "note: could not install nvdisasm; the SASS audit tests will skip" >&2
  fi
}

# SLURM for tests/test_slurm.py (a local 2-node cluster runs launch/slurm/train.sbatch): Debian's
# slurmctld, slurmd, slurm-client and munge, installed when missing and we are root with apt.
# Without them (or on failure) those tests skip and say why; nothing else needs SLURM.
setup_slurm() {
  if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
     && command -v sbatch >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: SLURM is not installed and this is not root with apt-get; the SLURM tests will skip" >&2
    return 0
  fi
  echo "installing SLURM for the SLURM tests (apt-get: slurmctld slurmd slurm-client munge)" >&2
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
           slurmctld slurmd slurm-client munge >/dev/null; }; then
    echo "note: could not install SLURM; the SLURM tests will skip" >&2
  fi
  return 0
}

# TCMalloc, which the launchers preload on their own (launch/common.py use_tcmalloc): XLA:CPU
# allocates a step's temporaries anew each step and glibc makes every step page-fault them in
# again (16% of the CPU benchmark's step). Debian's libtcmalloc-minimal4 when root with apt;
# without it everything runs on glibc's malloc.
setup_tcmalloc() {
  if [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] \
     || [ -e /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 ] \
     || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    return 0
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; } \
    || echo "note: could not install TCMalloc; runs use glibc's malloc" >&2
  return 0
}

cmd=${1:-test}; shift || true
setup
setup_tcmalloc
case "$cmd" in
  setup) setup_torch ;;
  cuda-plugin) setup_cuda_plugin
         [ -f .venv/cuda-plugin/.titanax-installed ] || exit 1
         echo "CUDA plugin installed in .venv/cuda-plugin: launch.plan now compiles for the GPU" ;;
  train) exec .venv/bin/python -m launch.train "$@" ;;
  test)  setup_torch; setup_cuda_plugin; setup_slurm
         # Lint first (seconds): pyflakes, pycodestyle and import order, as pyproject.toml says.
         .venv/bin/ruff check . || { echo "error: ruff found problems; run .venv/bin/ruff check --fix ." >&2; exit 1; }
         # Two workers (CI has 2 cores; TITANAX_TEST_WORKERS overrides, 0 runs in this
         # process), each test file on one worker so its module-scoped compiles are shared,
         # the longest files first (conftest.py reads tests/durations.json).
         workers=${TITANAX_TEST_WORKERS:-2}
         if [ "$workers" = 0 ]; then exec .venv/bin/python -m pytest -q "$@"; fi
         exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@" ;;
  *) echo "usage: bash scripts/dev.sh train|test|setup|cuda-plugin [args...]" >&2; exit 2 ;;
esac
