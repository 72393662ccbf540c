"""launch/slurm/train.sbatch against a real SLURM: a local cluster of 2 emulated nodes
(tests/slurm_cluster.py) runs it in CPU mode, 2 nodes x 1 task x 4 simulated CPU devices, one
mesh over all 8 devices.

A: `sbatch --wait -N 2`: the job completes; metrics and the final checkpoint are there.
B: a longer job gets SIGTERM on its tasks after a few steps (as SLURM delivers a time limit's
   or a preemption's notice): every process saves at one step, exits 75, the batch script
   requeues the job, and the requeued run resumes at that step and finishes.

Skipped, saying why, only where SLURM is not installed (or cannot run: not root).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from slurm_cluster import LocalSlurmCluster, unavailable  # noqa: E402

from tests.helpers.processes import logged_steps, metrics_rows  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
NODES, DEVICES_PER_NODE = 2, 4
RUN = ["--set", "train.log_every=1", "--set", "train.eval_every=0", "--set", "mesh.fsdp=-1",
       "--set", "mesh.data=1", "--set", "train.batch_size=8", "--set", "train.seq_len=64",
       "--set", "data.embedded_max_bytes=2000000"]
WHY_NOT = unavailable()
needs_slurm = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    with LocalSlurmCluster(root, nodes=[f"n{i + 1}" for i in range(NODES)]) as c:
        yield c
    assert not c.leftover_pids(), "job processes outlived the cluster"


def _submit(cluster, workdir: pathlib.Path, steps: int, every: int, *, wait: bool):
    out = workdir.parent / f"{workdir.name}.out"
    env = cluster.job_env(TITANAX_CPU="1", TITANAX_HOST_DEVICES=str(DEVICES_PER_NODE))
    argv = ["-N", str(NODES), "--gpus-per-node=0", "-o", str(out), "-J", workdir.name,
            str(SBATCH), "--workdir", str(workdir), *RUN, "--set", f"train.steps={steps}",
            "--set", f"checkpoint.every_steps={every}"]
    # Submitted from the checkout, as a user would: the script finds the repo by the submit dir.
    job, rc = cluster.sbatch(argv, env=env, wait=wait, cwd=REPO, timeout_s=400)
    return job, rc, out


def _finished(info) -> bool:
    return info["JobState"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING")


def _check_run(workdir: pathlib.Path, steps: int, log: str) -> None:
    rows = metrics_rows(workdir)
    train = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(train) == list(range(1, steps + 1)), f"steps logged: {sorted(train)}\n{log}"
    assert all(math.isfinite(v) for v in train.values()), train
    val = [r for r in rows if "val_loss" in r]
    assert val and all(math.isfinite(r["val_loss"]) for r in val), rows
    assert (workdir / "checkpoints" / str(steps)).is_dir(), os.listdir(workdir / "checkpoints")
    # Two processes, one per node, sharing one mesh of 8 CPU devices; only process 0 logs.
    assert "process 0/2" in log and "process 1/2" in log, log
    assert "2 processes (jax.distributed), 4 local device(s)" in log, log
    assert "over 8 cpu device(s)" in log, log


@pytest.mark.slow
@needs_slurm
def test_two_node_cpu_job_trains_and_checkpoints(cluster, tmp_path):
    workdir = tmp_path / "run_a"
    job, rc, out = _submit(cluster, workdir, steps=6, every=3, wait=True)
    log = out.read_text(errors="replace") if out.exists() else "(no job output)"
    info = cluster.job(job)
    assert rc == 0 and info["JobState"] == "COMPLETED", f"{info}\n{log}\n{cluster.logs()}"
    assert info["NodeList"] == "n[1-2]", info
    _check_run(workdir, 6, log)
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                  if p.name.isdigit()) == [3, 6]


@pytest.mark.slow
@needs_slurm
def test_preempted_job_saves_requeues_and_resumes(cluster, tmp_path):
    workdir = tmp_path / "run_b"
    steps = 20
    job, _, out = _submit(cluster, workdir, steps=steps, every=100, wait=False)

    def log():
        return out.read_text(errors="replace") if out.exists() else "(no job output)"

    deadline = time.monotonic() + 240
    while logged_steps(workdir) < 3:
        info = cluster.job(job)
        assert info["JobState"] in ("PENDING", "RUNNING"), f"{info}\n{log()}"
        assert time.monotonic() < deadline, f"no 3 steps in 240 s\n{log()}\n{cluster.logs()}"
        time.sleep(0.25)
    # SIGTERM to every task of the job's steps, not the batch shell: what a time limit or a
    # preemption delivers to the training processes (with --signal=USR1@300 the warning is
    # SIGUSR1, handled the same way). The batch shell is left alone here because srun, if it
    # gets SIGTERM itself, kills its tasks at once (see launch/slurm/README.md).
    cluster.signal_steps(job, "TERM")

    # The first run saves, exits 75 and requeues itself; the second one runs to the end.
    cluster.wait_job(job, lambda i: i.get("Restarts", "0") != "0", 120,
                            "be requeued")
    info = cluster.wait_job(job, _finished, 300, "finish after its requeue")
    text = log()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"

    m = re.search(r"preempted \(SIG\w+\): saved a checkpoint at step (\d+)", text)
    assert m, text
    saved = int(m.group(1))
    assert 3 <= saved < steps, text
    assert "srun exited with 75" in text and f"requeued job {job}" in text, text
    assert re.search(rf"resumed from \S+/{saved} at step {saved}\b", text), text
    assert "(restart 1)" in text, text
    _check_run(workdir, steps, text)
    assert (workdir / "checkpoints" / str(saved)).is_dir()


# A stand-in for launch.train (TITANAX_PYTHON) for the batch script's own signal logic: it
# trains until SIGTERM/SIGUSR1, then "saves" and exits 75 like launch.train.
FAKE_TRAINER = """#!/bin/bash
trap 'echo "fake task $SLURM_PROCID got SIGTERM"; sleep 1; exit 75' TERM
trap 'echo "fake task $SLURM_PROCID got SIGUSR1"; sleep 1; exit 75' USR1
echo "fake task $SLURM_PROCID started: $*"
for i in $(seq 1500); do sleep 0.2; done
exit 0
"""


def _submit_fake(cluster, tmp_path, *sbatch_args):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_TRAINER)
    fake.chmod(0o755)
    out = tmp_path / "fake.out"
    env = cluster.job_env(TITANAX_CPU="1", TITANAX_PYTHON=str(fake), TITANAX_REPO=str(REPO))
    job, _ = cluster.sbatch(["-N", str(NODES), "--gpus-per-node=0", "-o", str(out),
                             *sbatch_args, str(SBATCH)], env=env)
    deadline = time.monotonic() + 60
    while (out.read_text() if out.exists() else "").count("fake task") < NODES:
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "(no output)"
        time.sleep(0.2)
    return job, out


@needs_slurm
def test_cancelled_job_is_not_requeued(cluster, tmp_path):
    """scancel means stop: the tasks still save (exit 75), but the job stays cancelled."""
    job, out = _submit_fake(cluster, tmp_path)
    subprocess.run(["scancel", str(job)], env=cluster.env, check=True)
    info = cluster.wait_job(job, _finished, 60, "end")
    text = out.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", f"{info}\n{text}"
    assert "srun exited with 75" in text and "the job was cancelled" in text, text


@needs_slurm
def test_time_limit_warning_reaches_the_tasks_and_requeues(cluster, tmp_path):
    """SLURM itself sends --signal=USR1@T (here 55 s before a 1-minute limit; SLURM checks
    about every 30 s) to every task; they save and the job is requeued."""
    job, out = _submit_fake(cluster, tmp_path, "--time=1", "--signal=USR1@55")
    cluster.wait_job(job, lambda i: i.get("Restarts", "0") != "0", 90, "be requeued")
    subprocess.run(["scancel", str(job)], env=cluster.env, check=True)  # not run it again
    cluster.wait_job(job, _finished, 60, "end")
    text = out.read_text()
    assert text.count("got SIGUSR1") == NODES and "batch shell got" not in text, text
    assert "srun exited with 75" in text and f"requeued job {job}" in text, text


@needs_slurm
def test_batch_shell_signal_is_passed_to_the_tasks(cluster, tmp_path):
    """With --signal=B:USR1@T only the batch shell gets the notice: it passes it on to the
    tasks, which save, and the job is requeued."""
    job, out = _submit_fake(cluster, tmp_path)
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job)], env=cluster.env,
                   check=True)
    cluster.wait_job(job, lambda i: i.get("Restarts", "0") != "0", 60, "be requeued")
    subprocess.run(["scancel", str(job)], env=cluster.env, check=True)  # not run it again
    cluster.wait_job(job, _finished, 60, "end")
    text = out.read_text()
    assert "batch shell got SIGUSR1" in text, text
    assert text.count("got SIGUSR1") >= 1 + NODES, text
    assert f"requeued job {job}" in text, text


def test_sbatch_script_is_valid_bash():
    p = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
