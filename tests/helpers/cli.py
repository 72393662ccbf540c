"""The command line as a user runs it: a small config on random tokens, and the one-error-line check."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


# configs/tiny.gin made small, on random tokens (no tokenizer to train, no data caches written).
CLI_SMALL = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
             "model.ffn_dim": 128, "model.vocab_size": 512, "train.batch_size": 2,
             "train.seq_len": 32, "data.source": "synthetic", "mesh.data": 1}


def cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def snapshot(folder: pathlib.Path) -> dict[str, str]:
    """path -> sha256 of every file under folder (empty folders as 'dir')."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def assert_one_error(r: subprocess.CompletedProcess, code: int, *contains: str) -> str:
    return one_error_line(r.stderr, r.returncode, code, *contains)


def one_error_line(stderr: str, returncode, code: int, *contains: str) -> str:
    """The one `error:` line of a command that exited `code` without a traceback (stderr as a
    subprocess or capsys caught it), after checking it holds each of `contains`."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert returncode == code, (returncode, stderr[-3000:])
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    for text in contains:
        assert text in errors[0], errors[0]
    return errors[0]
