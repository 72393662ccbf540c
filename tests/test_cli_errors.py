"""Bad input, tried as a new user would, ends in one `error:` line (exit 2 for configuration, 1
for a run that cannot go on), never a traceback, and leaves the folders as they were."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# configs/tiny.gin made small, on random tokens (no tokenizer to train, no data caches written).
SMALL = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_dim": 128, "model.vocab_size": 512, "train.batch_size": 2,
         "train.seq_len": 32, "data.source": "synthetic", "mesh.data": 1}


def _cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _snapshot(folder: pathlib.Path) -> dict[str, str]:
    """path -> sha256 of every file under folder (empty folders as 'dir')."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def _assert_one_error(r: subprocess.CompletedProcess, code: int, *contains: str) -> str:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    assert len(errors) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for text in contains:
        assert text in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("line, message", [
    ("model.n_layers = = 4", "Unable to parse value"),  # gin's own parser
    ("model.n_layers = [1, 2", "unexpected EOF"),  # Python's tokenizer under gin
])
def test_gin_syntax_error_is_one_line_with_file_and_line(tmp_path, line, message):
    gin = tmp_path / "bad.gin"
    gin.write_text(f"model.d_model = 64\n{line}\n")
    r = _cli("launch.train", "--config", gin, "--workdir", tmp_path / "run")
    _assert_one_error(r, 2, f"error: {gin}:2: ", message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gin"]


def test_read_only_commands_on_a_folder_without_a_run_create_nothing(tmp_path):
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    r = _cli("launch.generate", "--workdir", empty, "--prompt", "x")
    _assert_one_error(r, 2, "no checkpoint", "launch.train")
    r = _cli("launch.generate", "--workdir", missing, "--prompt", "x")
    _assert_one_error(r, 2, "does not exist")
    r = _cli("launch.export_hf", "--workdir", empty, "--out", tmp_path / "hf")
    _assert_one_error(r, 2, "no checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert not any(empty.iterdir())


def _damaged_run(workdir: pathlib.Path, steps=(1, 2)) -> list[str]:
    """A run folder as launch.train leaves it (config.json, checkpoints of SMALL) with every
    checkpoint's largest file cut in half; returns the --set flags of its config."""
    from titanax.checkpoint.orbax_io import Checkpointer
    from titanax.config import apply_overrides, load_config
    from titanax.parallel.mesh import single_device_mesh
    from titanax.train.optim import make_optimizer
    from titanax.train.state import create_train_state

    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.gin"), SMALL)
    _, state, _ = create_train_state(cfg, single_device_mesh(), make_optimizer(cfg))
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    for step in steps:
        ckpt.save(step, state, data_state=None, config=cfg.to_dict())
        ckpt.wait()
    ckpt.close()
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    for step in steps:
        files = [p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*")
                 if p.is_file()]
        victim = max(files, key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    return [f"--set={k}={v}" for k, v in SMALL.items()]


def test_every_checkpoint_damaged_stops_in_one_line_and_moves_nothing(tmp_path):
    work = tmp_path / "run"
    sets = _damaged_run(work)
    before = _snapshot(work)
    r = _cli("launch.train", "--config", "configs/tiny.gin", "--workdir", work, *sets)
    _assert_one_error(r, 1, "no checkpoint under", "restores")
    # Nothing moved, deleted, written or created among the checkpoints (training may have
    # started its compilation cache beside them by then).
    after = _snapshot(work)
    assert {k: v for k, v in after.items() if k.startswith("checkpoints")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoints")}
    assert after["config.json"] == before["config.json"]


def test_sampling_a_damaged_checkpoint_stops_in_one_line_naming_the_step_to_try(tmp_path):
    _damaged_run(tmp_path)
    before = _snapshot(tmp_path)
    r = _cli("launch.generate", "--workdir", tmp_path, "--prompt", "x")
    _assert_one_error(r, 1, "checkpoints/2: reading its parameters failed", "--step 1")
    r = _cli("launch.export_hf", "--workdir", tmp_path, "--out", tmp_path / "hf")
    _assert_one_error(r, 1, "checkpoints/2: reading parameter")
    assert _snapshot(tmp_path) == before  # read-only commands write nothing
