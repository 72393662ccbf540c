"""A resumed checkpoint checked against the run's own log (train/resume_check.py): a step without
its manifest whose damaged bytes decode to finite values passes every check a restore can make,
and the run would diverge from it. The first step logged again after the resume is compared with
the loss the run logged at that step; a jump no real resume shows stops the run in one line
(launch.train: exit 1, as a damaged checkpoint) and moves the step aside, and the same command
then resumes from the previous step and logs the uninterrupted run's losses."""

from __future__ import annotations

import shutil

import jax
import pytest

from tests.helpers.cli import CLI_SMALL, ROOT
from tests.helpers.verify_runs import drop_manifest, write_into_output
from titanax.config import apply_overrides, load_config
from titanax.train import loop
from titanax.train.metrics import read_metrics
from titanax.train.resume_check import ResumeDiverged


def _train(work, lines):
    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.gin"), {
        **CLI_SMALL, "train.steps": 3, "train.log_every": 1, "train.eval_every": 0,
        "checkpoint.every_steps": 1, "train.progress_bar": False,
        "train.compilation_cache": ""})
    return loop.train(cfg, work, log=lines.append, devices=jax.devices()[:1])


def test_a_resume_whose_loss_jumps_is_refused_and_the_older_step_resumes(tmp_path):
    work = tmp_path / "run"
    whole = _train(work, [])
    assert sorted(whole.losses) == [1, 2, 3]
    # Killed after logging step 3 and before its checkpoint committed; step 2 lost its
    # manifest (the run died before the checksums) and holds a damaged output weight that is
    # finite (2.6e23): no checksum to tell, the restore's NaN/inf check passes.
    shutil.rmtree(work / "checkpoints" / "3")
    drop_manifest(work / "checkpoints" / "2")
    write_into_output(work / "checkpoints" / "2")

    lines: list[str] = []
    with pytest.raises(ResumeDiverged) as refused:
        _train(work, lines)
    said = str(refused.value)
    assert "\n" not in said
    assert "the loss at step 3, the first logged after resuming from" in said
    assert f"where the run logged {whole.losses[3]:.6g} at that step" in said
    assert "checkpoint 2 holds damaged values" in said
    assert "run the same command again to resume from step 1" in said
    assert (work / "checkpoints" / "2.corrupt").is_dir()
    assert not (work / "checkpoints" / "2").exists()
    assert 3 not in {r["step"] for r in read_metrics(work) if "loss" in r}  # never written

    # The same command: resumes from step 1 (its logged step 2 compared and equal) and logs
    # the uninterrupted run's losses, bitwise.
    lines = []
    again = _train(work, lines)
    assert any("resumed from" in str(x) and "/1 at step 1" in str(x) for x in lines), lines
    assert again.losses == {2: whole.losses[2], 3: whole.losses[3]}
