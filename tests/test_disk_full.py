"""A full disk during training (checkpoint/disk_full.py DiskFull): one `error:` line naming the
folder and the bytes a checkpoint needs, exit 1, no partial step folder left, and the run
resumes from its newest complete checkpoint once there is room. On a small tmpfs (root), out of
bytes (refused before the save starts) and out of inodes (orbax fails mid-save); elsewhere
with the free space reported by shutil.disk_usage made small."""

from __future__ import annotations

import os
import shutil
import subprocess

import jax
import pytest

from tests.helpers.cli import CLI_SMALL, ROOT, assert_one_error, cli
from titanax.checkpoint import disk_full, manager
from titanax.config import apply_overrides, load_config

SETS = {**CLI_SMALL, "train.steps": 4, "checkpoint.every_steps": 1, "train.compilation_cache": ""}


def _sets():
    return [x for k, v in SETS.items() for x in ("--set", f"{k}={v}")]


def _tmpfs(path, options: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("limit", ["bytes", "inodes"])
def test_disk_full_is_one_line_and_the_run_resumes_once_there_is_room(tmp_path, limit):
    disk = tmp_path / "disk"
    if not _tmpfs(disk, "size=20m" if limit == "bytes" else "size=50m,nr_inodes=60"):
        pytest.skip("no tmpfs to fill here (needs root and mount(8)); "
                    "test_disk_full_injected covers the check")
    try:
        work = disk / "run"
        filler = disk / "filler"
        if limit == "bytes":  # room for one checkpoint (1.5 MB) and the run's other files
            free = shutil.disk_usage(disk).free
            with open(filler, "wb") as f:
                f.truncate(0)
                os.posix_fallocate(f.fileno(), 0, free - 2_700_000)
        r = cli("launch.train", "--workdir", work, *_sets())
        want = ("disk full: the checkpoint of step 2 does not fit in", str(work / "checkpoints"),
                "needs 1.7 MB", "the newest complete checkpoint is step 1")
        if limit == "bytes":  # refused before orbax started: nothing else said
            assert_one_error(r, 1, *want)
        else:  # orbax failed mid-save: its threads' asyncio callbacks print on their own
            errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
            assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
            assert all(w in errors[0] for w in want), errors[0]
            assert "ERROR:absl" not in r.stderr  # orbax's own reports of it are dropped
        assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["1"]
        if limit == "inodes":
            return
        # room again: the same command resumes from step 1 and finishes
        filler.unlink()
        r = cli("launch.train", "--workdir", work, *_sets())
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout + r.stderr and "at step 1" in r.stdout + r.stderr
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_disk_full_injected(tmp_path, monkeypatch):
    """Where no small filesystem can be made: the same check, with less space reported."""
    from titanax.train import loop

    if _tmpfs(tmp_path / "probe", "size=1m"):  # the real thing ran above
        subprocess.run(["umount", str(tmp_path / "probe")], check=False)
        pytest.skip("covered on a real full tmpfs by the test above")

    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.py"), SETS)
    real = shutil.disk_usage
    monkeypatch.setattr(manager.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))
    with pytest.raises(disk_full.DiskFull, match=r"step 1 does not fit in .*needs 1.7 MB, "
                                                 r"1.0 kB are free there\); no checkpoint was"):
        loop.train(cfg, tmp_path / "run", log=lambda *_: None, devices=jax.devices()[:1])
    assert not list((tmp_path / "run" / "checkpoints").iterdir())


def test_prepare_data_on_a_full_disk_says_so_and_resumes(tmp_path):
    from titanax.data.tokenizer import train_bpe

    disk = tmp_path / "disk"
    if not _tmpfs(disk, "size=600k"):
        pytest.skip("no tmpfs to fill here (needs root and mount(8))")
    try:
        texts = [f"def f{i}(x):\n    return x * {i} + {i * 7}\n" * 40 for i in range(400)]
        src = tmp_path / "in.jsonl"
        src.write_text("".join(f'{{"text": {t!r}}}\n'.replace("'", '"') for t in texts))
        tok = tmp_path / "tok.json"
        train_bpe(texts[:50], 300, tok)
        args = ["launch.prepare_data", "--tokenizer", tok, "--input", src, "--out",
                disk / "shards", "--shard-tokens", "20000", "--no-progress"]
        r = cli(*args)
        assert_one_error(r, 1, "disk full writing", "MB free there",
                          "it resumes after the last complete shard")
        assert not list((disk / "shards").glob(".*tmp*"))  # the partial shard is gone
        subprocess.run(["mount", "-o", "remount,size=20m", str(disk)], check=True)
        r = cli(*args)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "400 documents" in r.stdout
    finally:
        subprocess.run(["umount", str(disk)], check=False)
