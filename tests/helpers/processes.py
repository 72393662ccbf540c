"""launch.train in several local processes, as on a multi-node cluster (2 x 4 simulated CPU devices)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from tests.helpers.small import ROOT, SMALL

STEPS = 6


SETS = [f"--set={k}={v}" for k, v in {
    **SMALL, "mesh.fsdp": -1, "train.steps": STEPS, "train.log_every": 1,
    "train.eval_every": 0, "train.progress_bar": False, "optim.warmup_steps": 2,
    "checkpoint.every_steps": 0, "checkpoint.async_save": False}.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_train(workdir, name, *args, extra=()):
    out = open(workdir / f"{name}.log", "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in [k for k in env if k.startswith(("SLURM_", "TITANAX_", "JAX_COORDINATOR"))]:
        del env[k]  # a test run inside a SLURM job must not take the job's settings
    proc = subprocess.Popen([sys.executable, "-m", "launch.train", "--workdir", str(workdir),
                             *args, *SETS, *extra], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT)
    proc.log_path = workdir / f"{name}.log"
    return proc


def start_pair(workdir, name, extra=()):
    port = free_port()
    return [start_train(workdir, f"{name}.p{i}", "--host-devices", "4",
                   "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(i), "--heartbeat-timeout", "30", extra=extra)
            for i in range(2)]


def wait_all(procs, timeout=420):
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"hung; log tail:\n{p.log_path.read_text()[-3000:]}")
    return codes


def metrics_rows(workdir) -> list[dict]:
    """The rows a run, running or done, has written to WORKDIR/metrics.jsonl ([] before the file
    exists; a row still being written is left out)."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a row being written
    return rows


def logged_losses(workdir) -> dict[int, float]:
    """{step: loss} of a finished run, every training step logged once."""
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def logged_steps(workdir) -> int:
    """The last training step a run, running or done, has logged (0: none yet)."""
    return max((r["step"] for r in metrics_rows(workdir) if "loss" in r), default=0)


def wait_for_step(procs, workdir, step: int, timeout: float = 300) -> None:
    """Returns once the run has logged training step `step`; fails with the first process's
    log tail if one of procs ends first or `timeout` seconds pass."""
    deadline = time.time() + timeout
    while logged_steps(workdir) < step:
        assert all(p.poll() is None for p in procs), procs[0].log_path.read_text()[-3000:]
        assert time.time() < deadline, f"the run never logged step {step}"
        time.sleep(0.02)
