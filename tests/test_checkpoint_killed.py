"""A real process killed (SIGKILL) between orbax's commit of a step and that step's manifest:
the next run restores the step whole, checks it, checksums it and says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.helpers.cli import CLI_SMALL, ROOT, cli
from titanax.checkpoint import integrity

# The run's own process kills itself with SIGKILL the moment the manifest thread starts on
# step 2 (orbax has committed it): the exact window a kill -9 from outside would have to hit.
DIE_AT_SEAL = """
import os, signal, sys
from titanax.checkpoint import integrity
real = integrity.seal
def seal(step_dir, *a, **k):
    if str(step_dir).endswith("/2"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(step_dir, *a, **k)
integrity.seal = seal
sys.argv = ["launch.train", *sys.argv[1:]]
from launch.train import main
main()
"""


def test_step_committed_without_its_manifest_is_checked_then_checksummed(tmp_path):
    work = tmp_path / "run"
    sets = [x for k, v in {**CLI_SMALL, "train.steps": 3, "checkpoint.every_steps": 1,
                           "checkpoint.async_save": False}.items()
            for x in ("--set", f"{k}={v}")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "src"))),
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", DIE_AT_SEAL, "--workdir", str(work), *sets],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    step2 = work / "checkpoints" / "2"
    assert step2.is_dir() and integrity.load_manifest(step2) is None  # committed, unsealed
    r = cli("launch.train", "--workdir", work, *sets)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert f"checkpoint {step2} had no manifest" in out and "resumed from" in out
    assert integrity.has_manifest(step2) and integrity.find_damage(step2) is None
