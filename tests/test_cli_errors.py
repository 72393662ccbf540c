"""Bad input, tried as a new user would, ends in one `error:` line (exit 2 for configuration, 1
for a run that cannot go on), never a traceback, and leaves the folders as they were."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.helpers.cli import CLI_SMALL, ROOT, assert_one_error, cli, snapshot


@pytest.mark.parametrize("line, message", [
    ("model.n_layers = = 4", "Unable to parse value"),  # gin's own parser
    ("model.n_layers = [1, 2", "unexpected EOF"),  # Python's tokenizer under gin
])
def test_gin_syntax_error_is_one_line_with_file_and_line(tmp_path, line, message):
    gin = tmp_path / "bad.gin"
    gin.write_text(f"model.d_model = 64\n{line}\n")
    r = cli("launch.train", "--config", gin, "--workdir", tmp_path / "run")
    assert_one_error(r, 2, f"error: {gin}:2: ", message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gin"]


def test_read_only_commands_on_a_folder_without_a_run_create_nothing(tmp_path):
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    r = cli("launch.generate", "--workdir", empty, "--prompt", "x")
    assert_one_error(r, 2, "no checkpoint", "launch.train")
    r = cli("launch.generate", "--workdir", missing, "--prompt", "x")
    assert_one_error(r, 2, "does not exist")
    r = cli("launch.export_hf", "--workdir", empty, "--out", tmp_path / "hf")
    assert_one_error(r, 2, "no checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert not any(empty.iterdir())


def _damaged_run(workdir: pathlib.Path, steps=(1, 2)) -> list[str]:
    """A run folder as launch.train leaves it (config.json, checkpoints of CLI_SMALL) with every
    checkpoint's largest file cut in half; returns the --set flags of its config."""
    from titanax.checkpoint.manager import Checkpointer
    from titanax.config import apply_overrides, load_config
    from titanax.parallel.mesh import single_device_mesh
    from titanax.train.optim import make_optimizer
    from titanax.train.state import create_train_state

    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.gin"), CLI_SMALL)
    _, state, _ = create_train_state(cfg, single_device_mesh(), make_optimizer(cfg))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    for step in steps:
        ckpt.save(step, state.to_saved(), data_state=None, config=cfg.to_dict())
        ckpt.wait()
    ckpt.close()
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    for step in steps:
        files = [p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*")
                 if p.is_file()]
        victim = max(files, key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return [f"--set={k}={v}" for k, v in CLI_SMALL.items()]


def test_every_checkpoint_damaged_stops_in_one_line_and_moves_nothing(tmp_path):
    work = tmp_path / "run"
    sets = _damaged_run(work)
    before = snapshot(work)
    r = cli("launch.train", "--config", "configs/tiny.gin", "--workdir", work, *sets)
    assert_one_error(r, 1, "no checkpoint under", "restores")
    # Nothing moved, deleted, written or created among the checkpoints (training may have
    # started its compilation cache beside them by then).
    after = snapshot(work)
    assert {k: v for k, v in after.items() if k.startswith("checkpoints")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoints")}
    assert after["config.json"] == before["config.json"]


def test_sampling_a_damaged_checkpoint_stops_in_one_line_naming_the_step_to_try(tmp_path):
    _damaged_run(tmp_path)
    before = snapshot(tmp_path)
    # Each reader checks the step against its manifest before reading it (the cut file's
    # size tells), and names the older step and --no-verify.
    r = cli("launch.generate", "--workdir", tmp_path, "--prompt", "x")
    assert_one_error(r, 1, "checkpoints/2 is damaged:", "were written", "--step 1",
                     "--no-verify")
    r = cli("launch.export_hf", "--workdir", tmp_path, "--out", tmp_path / "hf")
    assert_one_error(r, 1, "checkpoints/2 is damaged:", "--step 1")
    # Unverified, the restore's own failure is still one line.
    r = cli("launch.generate", "--workdir", tmp_path, "--prompt", "x", "--no-verify")
    assert_one_error(r, 1, "checkpoints/2: reading its parameters failed", "--step 1")
    # Read-only commands write nothing (an export into the run folder takes its lock, whose
    # file a trainer would have left there already).
    after = snapshot(tmp_path)
    after.pop(".titanax.lock", None)
    assert after == before
