"""Runs scripts under the PyTorch venv (.venv-torch: torch CPU + transformers, created by
`bash scripts/dev.sh setup`) so tests can compare titanax with reference implementations."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PEER_DIR = pathlib.Path(__file__).resolve().parent / "hf_peer"


def torch_python() -> str:
    """The torch venv's interpreter; skips the calling test (with the fix) when it is absent."""
    path = pathlib.Path(os.environ.get("TITANAX_TORCH_PYTHON", ROOT / ".venv-torch" / "bin" / "python"))
    if not path.exists():
        pytest.skip(f"no PyTorch peer interpreter at {path}: run `bash scripts/dev.sh setup` "
                    "(creates .venv-torch) or set TITANAX_TORCH_PYTHON")
    return str(path)


def run_jobs(script: str, jobs: list[dict], workdir: pathlib.Path, timeout: float = 600) -> None:
    """Runs tests/hf_peer/SCRIPT with a JSON job list; raises with the peer's stderr on failure."""
    jobs_path = workdir / "peer_jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([torch_python(), str(PEER_DIR / script), str(jobs_path)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"peer {script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
