"""Every command that reads a step's weights verifies the step's manifest first
(checkpoint/integrity.py, as a resume does): launch.generate, launch.export_hf and launch.eval
refuse a damaged step in one line naming the step, the damaged file and the fix (`--step N`,
`--no-verify`), exit 1 as training's refusal of a damaged checkpoint, and write nothing. The
damage here is the silent kind: one flipped bit in a stored chunk that orbax decodes without
a word into other finite output weights (up to 1e38 where they were below 0.1, measured). A step without a manifest is read as a
resume reads it: with one line saying so, its values checked to be finite."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.cli import one_error_line, snapshot
from tests.helpers.verify_runs import (
    copy_run,
    drop_manifest,
    flip_into_output,
    make_run,
    output_of,
)
from titanax.train.workdir_lock import LOCK_NAME


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """(a run whose step 2 has one flipped bit, the damaged file, the output weight it decodes
    to); each test works on a copy."""
    work = tmp_path_factory.mktemp("verify") / "run"
    make_run(work)
    victim, output = flip_into_output(work / "checkpoints" / "2")
    return work, victim.relative_to(work / "checkpoints" / "2").as_posix(), output


def _refused(main, argv, capsys, code: int, *contains: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return one_error_line(capsys.readouterr().err, exit_info.value.code, code, *contains)


def test_a_damaged_step_is_refused_by_every_reader_in_one_line(damaged, tmp_path, capsys):
    from launch import eval as eval_cmd
    from launch import export_hf, generate

    work, rel = copy_run(damaged[0], tmp_path / "run"), damaged[1]
    want = (f"checkpoint {work / 'checkpoints' / '2'} is damaged: {rel} does not match its "
            "checksum", "use an older step with --step 1", "--no-verify")
    before = snapshot(work)
    _refused(generate.main, ["--workdir", str(work), "--prompt", "x"], capsys, 1, *want)
    _refused(export_hf.main, ["--workdir", str(work), "--out", str(tmp_path / "hf")], capsys,
             1, *want)
    _refused(eval_cmd.main, ["--workdir", str(work), "--tasks", "titanax_tiny_mc"], capsys, 1,
             *want)
    # No eval/ folder, nothing moved; eval held the run's lock (its file names the holder).
    after = snapshot(work)
    assert after.pop(LOCK_NAME) and before.pop(LOCK_NAME) and after == before
    assert not (tmp_path / "hf").exists()
    # The older step is intact, and --step names it.
    from titanax.generate import load_for_inference

    assert load_for_inference(work, step=1)[3] == 1


def test_no_verify_reads_the_step_as_stored(damaged, tmp_path, capsys):
    """--no-verify skips the check: the damaged weights come back as orbax decodes them, the
    silent damage the manifest exists to catch."""
    from launch import export_hf, generate
    from titanax.generate import load_for_inference

    work, damaged_output = copy_run(damaged[0], tmp_path / "run"), damaged[2]
    _, _, params, step = load_for_inference(work, verify=False)
    assert step == 2 and np.array_equal(output_of(params), damaged_output)
    _, _, intact, _ = load_for_inference(work, step=1)  # the same weights, saved undamaged
    assert not np.array_equal(output_of(intact), damaged_output)
    assert np.isfinite(damaged_output).all()  # nothing a NaN/inf check would notice
    # generate gets past the load (to its next check: this synthetic run has no tokenizer)
    _refused(generate.main, ["--workdir", str(work), "--prompt", "x", "--no-verify"], capsys,
             2, "no tokenizer.json")
    export_hf.main(["--workdir", str(work), "--out", str(tmp_path / "hf"), "--no-verify",
                    "--dtype", "float32"])
    assert (tmp_path / "hf" / "config.json").is_file()


def test_a_step_without_manifest_is_read_with_one_line_and_refused_when_not_finite(
        tmp_path, capsys):
    from launch import export_hf
    from titanax.checkpoint.params_only import DamagedCheckpoint
    from titanax.generate import load_for_inference

    work = tmp_path / "run"
    make_run(work, steps=(1, 2, 3), nan_step=3)
    for step in (2, 3):
        drop_manifest(work / "checkpoints" / str(step))
    capsys.readouterr()
    _, _, params, _ = load_for_inference(work, step=2)
    notes = [line for line in capsys.readouterr().err.splitlines() if "no manifest" in line]
    assert len(notes) == 1 and notes[0].startswith(
        f"note: checkpoint {work / 'checkpoints' / '2'} has no manifest"), notes
    with pytest.raises(DamagedCheckpoint, match=r"checkpoints/3 is damaged: it has no manifest "
                                                r"and its parameter .*output.* holds NaN or inf; "
                                                r"use an older step with --step 2"):
        load_for_inference(work, step=3)
    _refused(export_hf.main, ["--workdir", str(work), "--out", str(tmp_path / "hf"),
                              "--step", "3"], capsys, 1, "checkpoints/3 is damaged",
             "parameter output holds NaN or inf", "--step 2")
    assert not (tmp_path / "hf").exists()


def test_a_lora_steps_damaged_base_is_refused_by_readers_and_by_a_resume(tmp_path):
    """A LoRA step holds adapters and names its frozen base (checkpoint/lora_base.py): the
    base's files are the step's weights, verified against the base's manifest by every reader
    and by training's restore, which then has no intact step to resume."""
    import jax

    from tests.helpers.cli import CLI_SMALL, ROOT
    from tests.helpers.verify_runs import largest_data_file
    from titanax.checkpoint.fallback import NoGoodCheckpoint
    from titanax.checkpoint.params_only import DamagedCheckpoint
    from titanax.config import apply_overrides, load_config
    from titanax.generate import load_for_inference
    from titanax.train import loop

    work = tmp_path / "run"

    def train(steps, **extra):
        cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.gin"), {
            **CLI_SMALL, "train.steps": steps, "train.eval_every": 0, "train.log_every": 1,
            "checkpoint.every_steps": 1, "train.progress_bar": False,
            "train.compilation_cache": "", **extra})
        return loop.train(cfg, work, log=lambda *_: None, devices=jax.devices()[:1])

    train(1)  # the base, step 1
    train(2, **{"lora.rank": 4})  # step 2: adapters on base 1
    assert (work / "checkpoints" / "2" / "lora_base").is_dir()
    victim = largest_data_file(work / "checkpoints" / "1")
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match=r"checkpoints/2 is damaged: its LoRA base "
                                                r".*checkpoints/1: .* does not match its "
                                                r"checksum; no older step to fall back to, "
                                                r"or --no-verify"):
        load_for_inference(work, step=2)
    with pytest.raises(NoGoodCheckpoint, match=r"step 2: .*its LoRA base .*checkpoints/1 is "
                                               r"damaged: .* does not match its checksum"):
        train(3, **{"lora.rank": 4})
