"""Exact resume through the command line: a run SIGKILLed, then interrupted by Ctrl-C, then
SIGTERMed, restarted each time with the same command, logs the
same per-step losses (bitwise) as a run never interrupted. CPU, one device, deterministic. A
signal during start-up, before the first step, ends the command at once with exit 75."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import logged_losses, logged_steps, metrics_rows, wait_for_step
from tests.helpers.small import ROOT, SMALL, seed_data

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

STEPS = 20
SETS = [f"--set={k}={v}" for k, v in {
    **SMALL, "train.steps": STEPS, "train.log_every": 1, "train.eval_every": 0,
    "train.progress_bar": False, "optim.warmup_steps": 2, "checkpoint.every_steps": 2,
    "checkpoint.keep": 2}.items()]


def _log(workdir, log_name):
    """Beside the workdir, not in it: a workdir holding files of its own but no config.json is
    refused (launch/train.py, _refuse_foreign_folder)."""
    return workdir.parent / f"{workdir.name}.{log_name}"


def _start(workdir, log_name):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = open(_log(workdir, log_name), "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.train", "--workdir", str(workdir),
                             "--host-devices", "1", *SETS], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT)
    proc.log_path = _log(workdir, log_name)
    return proc, out


def _run_until(workdir, step, sig, log_name):
    """Starts the run, sends `sig` once a training row for `step` or later is logged."""
    proc, out = _start(workdir, log_name)
    try:
        wait_for_step([proc], workdir, step)
        proc.send_signal(sig)
        return proc.wait(timeout=300), _log(workdir, log_name).read_text()
    finally:
        proc.kill()
        out.close()


def test_killed_and_preempted_run_resumes_exactly(tmp_path):
    ref = seed_data(tmp_path / "ref")
    proc, out = _start(ref, "log.txt")
    assert proc.wait(timeout=600) == 0, _log(ref, "log.txt").read_text()[-3000:]
    out.close()
    want = logged_losses(ref)
    assert sorted(want) == list(range(1, STEPS + 1))

    work = seed_data(tmp_path / "work")
    # Each target lies past what the previous, killed process could have logged, so the row
    # watched for is always the new process's own.
    rc, _ = _run_until(work, 5, signal.SIGKILL, "kill.txt")
    assert rc == -signal.SIGKILL
    # Ctrl-C saves like SIGTERM (no traceback) and exits 130, as a shell reports it.
    rc, text = _run_until(work, 13, signal.SIGINT, "int.txt")
    assert rc == 130, text[-3000:]
    assert "preempted (SIGINT): saved a checkpoint at step" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    rc, text = _run_until(work, 17, signal.SIGTERM, "term.txt")
    assert rc == 75, text[-3000:]  # EX_TEMPFAIL: saved, rerun to resume
    assert "resumed from" in text and "preempted (SIGTERM): saved a checkpoint at step" in text
    stopped = int(text.split("saved a checkpoint at step ")[1].split()[0])
    assert (work / "checkpoints" / str(stopped) / "titanax_manifest.json").is_file()
    assert logged_steps(work) == stopped < STEPS

    proc, out = _start(work, "final.txt")
    assert proc.wait(timeout=600) == 0, _log(work, "final.txt").read_text()[-3000:]
    out.close()
    assert f"at step {stopped}" in _log(work, "final.txt").read_text()
    assert logged_losses(work) == want  # bitwise: every step, once


def _catches(pid: int, sig: int) -> bool:
    """Has process pid installed a handler for sig (SigCgt in /proc/PID/status)?"""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines()
                      if line.startswith("SigCgt:")), 16)
    return bool(caught >> (sig - 1) & 1)


@pytest.mark.parametrize("sig, code, when", [
    (signal.SIGTERM, 75, "compile"),  # the run announced, its state built, the step compiling
    (signal.SIGUSR1, 75, "early"),  # launch.train's start-up guard just installed
    (signal.SIGINT, 130, "early")])
def test_signal_during_start_up_exits_at_once_for_a_requeue(tmp_path, sig, code, when):
    work = tmp_path / "run"
    work.mkdir()
    proc, out = _start(work, "log.txt")
    try:
        deadline = time.time() + 120
        while not (_catches(proc.pid, signal.SIGTERM) if when == "early" else
                   "titanax:" in _log(work, "log.txt").read_text()):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.01)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == code
    finally:
        proc.kill()
        out.close()
    text = _log(work, "log.txt").read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"stopped by {signal.Signals(sig).name} during start-up" in \
        errors[0], text[-3000:]
    assert "Traceback" not in text and not [r for r in metrics_rows(work) if "loss" in r]
    assert not list((work / "checkpoints").glob("[0-9]*"))
    if when == "compile":  # written whole before the data and the compile
        assert json.loads((work / "config.json").read_text())["train"]["steps"] == STEPS
