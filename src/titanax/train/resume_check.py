"""A resumed run checked against its own log: the first step it logs again is compared with the
loss the run logged at that step before it stopped (WORKDIR/metrics.jsonl, the rows the resume
is about to drop), and a jump no real resume shows refuses the checkpoint it resumed from.

Why. A step's files are checked against its manifest before a resume (checkpoint/integrity.py),
but a step without one (its run died between the commit and the checksums, or it was written
before manifests existed) is only checked for NaN and inf. A flipped bit in a stored chunk
decodes silently to a finite value (an output weight of 1e35): such a step resumes, and the run
diverges from there. Its own log says so at the first step it repeats.

The bound. A resume restores the exact bytes of the train state and the data position, and the
train step is a pure function of (state, batch): the losses it logs again are bitwise the ones
logged before (README, tests/test_resume.py). What a resume may change without changing the
model is how the weights are computed (execution: attention kernel, remat, mesh shape, loss
chunking): that reorders sums, which moves a mean loss by float rounding, ~1e-6 relative in
float32 and ~1e-3 at worst in bfloat16. A relative difference above REL_TOL = 1e-2 is ten times
the largest of those, and far below what damage that matters does (a weight at 1e35 puts the
loss at 1e30 or more, or at inf); a loss that moved less than 1% is no threat to the run. A
non-finite loss where the log has a finite one is refused too.

The check runs only where the comparison means something: the run resumes its own checkpoint
(its data position with it), the data, optimizer and lr schedule are the ones that logged the
rows (the logged step may lie a few updates past the checkpoint), the batch and sequence the
same, and the compute dtype and matmul precision unchanged. Otherwise it says nothing.

On a refusal the step is moved aside to `<step>.corrupt` (as a damaged step found at restore
is, checkpoint/fallback.py restore_latest_good), so that the same command resumes from the
previous step; where there is none, nothing is moved and the dropped rows are written back, so
that every rerun is refused the same way until the step is dealt with.
"""

from __future__ import annotations

import json
import math
import pathlib

from titanax.train.bad_steps import TrainingDiverged

REL_TOL = 1e-2
# The train fields that decide which tokens a step sees (the rest: how long, how often to log).
_BATCH_FIELDS = ("batch_size", "seq_len", "seed")
_EXECUTION_FIELDS = ("dtype", "matmul_precision")
# The sections whose every field does (the data, the optimizer, the adapters trained).
_WHOLE_SECTIONS = ("data", "optim", "lora")


class ResumeDiverged(TrainingDiverged):
    """The first step after a resume logged a loss that no real resume gives: the checkpoint
    holds damaged values (launch.train: one line, exit 1, as a damaged checkpoint)."""


def _rows(path: pathlib.Path) -> list[tuple[int, str, dict]]:
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            out.append((int(row["step"]), line, row))
        except (ValueError, KeyError, TypeError):  # a row a kill cut short
            continue
    return out


def _comparable(saved: dict, now: dict) -> bool:
    """Would the rows the saved run logged after its checkpoint be logged again, bitwise or to
    rounding, by the config `now`? (saved, now: Config.to_dict() of each)"""
    if any(saved.get(section) != now.get(section) for section in _WHOLE_SECTIONS):
        return False
    for section, fields in (("train", _BATCH_FIELDS), ("execution", _EXECUTION_FIELDS)):
        a, b = saved.get(section) or {}, now.get(section) or {}
        if any(a.get(f) != b.get(f) for f in fields):
            return False
    return True


class ResumeCheck:
    """Built after the restore, before the rows after the checkpoint are dropped; check() at
    every logged step (only the first one after the resume compares)."""

    def __init__(self, workdir: pathlib.Path, step: int, *, saved: dict | None = None,
                 now: dict | None = None, own_run: bool = False, schedule_change: str = ""):
        self.workdir, self.step = pathlib.Path(workdir), step
        self.logged: dict[int, float] = {}
        self.dropped: list[str] = []  # the rows after the checkpoint, as the run wrote them
        if not step or saved is None or not own_run or schedule_change:
            return
        if now is not None and not _comparable(saved, now):
            return
        for s, line, row in _rows(self.workdir / "metrics.jsonl"):
            if s > step:
                self.dropped.append(line)
                if isinstance(row.get("loss"), (int, float)):
                    self.logged[s] = float(row["loss"])

    def check(self, step: int, loss: float, ckpt, log) -> None:
        """Raises ResumeDiverged when `loss`, the first loss logged since the resume, is not the
        one the run logged at `step` (see the module docstring for the bound); ckpt: the
        run's Checkpointer, whose resumed step is moved aside when an older one exists."""
        if not self.logged:
            return
        before, self.logged = self.logged.get(step), {}  # the first logged step only
        if before is None or not math.isfinite(before):
            return
        jump = abs(loss - before) / max(abs(before), 1e-12) if math.isfinite(loss) else math.inf
        if jump <= REL_TOL:
            return
        older = [s for s in ckpt.all_steps() if s < self.step]
        where = ckpt.step_dir(self.step)
        said = (f"the loss at step {step}, the first logged after resuming from {where}, is "
                f"{loss:.6g} where the run logged {before:.6g} at that step (a resume repeats "
                f"its logged losses to float rounding; relative difference above {REL_TOL:g}): "
                f"checkpoint {self.step} holds damaged values")
        if older:
            ckpt.quarantine([self.step], log)
            raise ResumeDiverged(f"{said}; it is moved aside to {where}.corrupt: run the same "
                                 f"command again to resume from step {older[-1]}")
        self._restore_rows()
        raise ResumeDiverged(f"{said}; no older checkpoint to resume from: move {where} aside "
                             "to start this run over, or train in a new --workdir")

    def _restore_rows(self) -> None:
        """metrics.jsonl as the run left it: its rows up to the checkpoint, then the ones it
        logged after (the resume dropped them), so a rerun is refused the same way."""
        import jax

        if jax.process_index() != 0:  # process 0 writes the run's files
            return
        path = self.workdir / "metrics.jsonl"
        kept = [line for s, line, _ in _rows(path) if s <= self.step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept + self.dropped))
        tmp.replace(path)
