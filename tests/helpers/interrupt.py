"""prepare_data killed mid-run, as a user's Ctrl-C or a lost job would kill it, for the tests
that check it resumes."""

from __future__ import annotations

import contextlib
import pathlib

import pytest

from titanax.data import shards


@contextlib.contextmanager
def killed_at_shard(monkeypatch, n: int = 3):
    """The block's prepare_data is killed (KeyboardInterrupt) while writing its n-th shard,
    leaving that shard's partial temp file as a real kill does; the block must end in that
    interrupt. Afterwards shards are written normally again."""
    real_save, calls = shards.save_npy_atomic, {"n": 0}

    def crashing_save(path, array):
        calls["n"] += 1
        if calls["n"] == n:
            shards._tmp_name(pathlib.Path(path)).write_bytes(b"\x93NUMPY partial")
            raise KeyboardInterrupt
        real_save(path, array)

    monkeypatch.setattr(shards, "save_npy_atomic", crashing_save)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        monkeypatch.setattr(shards, "save_npy_atomic", real_save)
