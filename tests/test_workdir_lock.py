"""One run per workdir (train/workdir_lock.py), with real processes: a second trainer gets one
line naming the holder and exit 75; a lock whose holder was killed (-9) is free; a workdir that
is a file or read-only is one error line before anything runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.helpers.cli import CLI_SMALL, ROOT, assert_one_error, cli
from titanax.config import ConfigError
from titanax.train.workdir_lock import LOCK_NAME, WorkdirLocked, workdir_lock

HOLD = ("import sys, time\n"
        "from titanax.train.workdir_lock import workdir_lock\n"
        "with workdir_lock(sys.argv[1]):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n")


def _holder(workdir) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "src")))}
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], env=env,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _sets(**extra):
    out = []
    for k, v in {**CLI_SMALL, "train.steps": 1, **extra}.items():
        out += ["--set", f"{k}={v}"]
    return out


def test_second_trainer_is_refused_naming_the_holder_and_a_killed_holder_frees_it(tmp_path):
    work = tmp_path / "run"
    holder = _holder(work)
    try:
        with pytest.raises(WorkdirLocked, match=f"host {socket.gethostname()} pid {holder.pid} "
                                                "since 20"):
            with workdir_lock(work):
                pass
        # The CLI: one line, exit 75 (a requeued job retries), the workdir untouched.
        before = sorted(p.name for p in work.iterdir())
        r = cli("launch.train", "--workdir", work, *_sets())
        assert_one_error(r, 75, "is in use by", f"pid {holder.pid}", "one run per workdir")
        assert sorted(p.name for p in work.iterdir()) == before == [LOCK_NAME]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # kill -9 leaves the lock file behind; the kernel dropped the lock with the process.
    with workdir_lock(work):
        info = json.loads((work / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()


def test_a_workdir_that_is_a_file_or_read_only_is_one_line(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        with workdir_lock(afile):
            pass
    r = cli("launch.train", "--workdir", afile, *_sets())
    assert_one_error(r, 2, "is a file, not a folder")
    assert afile.read_text() == "mine"

    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes through permissions: a read-only mount instead
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                                 capture_output=True).returncode == 0
        if not mounted:
            pytest.skip("root without mount(8): cannot make a read-only folder")
    else:
        ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="read-only filesystem|is not writable"):
            with workdir_lock(ro / "run"):
                pass
        r = cli("launch.train", "--workdir", ro / "run", *_sets())
        assert_one_error(r, 2, "give a writable folder")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=False)
        else:
            ro.chmod(0o755)


def test_an_import_into_a_workdir_a_trainer_holds_is_refused_untouched(tmp_path):
    """launch.import_hf takes the workdir's lock for the whole import: started beside a live
    run on the same folder it is refused (launch.import_hf exits 75) before it reads or writes
    anything, where it used to finish and leave its config beside the trainer's checkpoints."""
    from titanax.config import load_config
    from titanax.hf.importer import import_hf

    work = tmp_path / "run"
    holder = _holder(work)
    try:
        cfg = load_config(ROOT / "configs" / "tiny.py", {})
        with pytest.raises(WorkdirLocked, match=f"pid {holder.pid}"):
            import_hf(tmp_path / "no-such-hf-folder", cfg, work)
        assert sorted(p.name for p in work.iterdir()) == [LOCK_NAME]
        # The command: one line naming the holder, exit 75 (config.json is all it reads first).
        hf = tmp_path / "hf"
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": 256, "rope_theta": 10000.0,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "torch_dtype": "float32"}))
        r = cli("launch.import_hf", "--hf", hf, "--workdir", work)
        assert_one_error(r, 75, "is in use by", f"pid {holder.pid}", "one run per workdir")
        assert sorted(p.name for p in work.iterdir()) == [LOCK_NAME]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_export_and_eval_writing_into_a_run_a_trainer_holds_are_refused_untouched(tmp_path,
                                                                                   capsys):
    """launch.export_hf with --out inside a run folder, and launch.eval writing its results
    into the run (WORKDIR/eval, the default), hold that run's lock as training does: beside a
    live holder each is refused in one line naming it, exit 75, before anything is read or
    written. An export elsewhere needs no lock."""
    from launch import eval as eval_cmd
    from launch import export_hf
    from tests.helpers.cli import snapshot
    from tests.helpers.verify_runs import make_run

    work = tmp_path / "run"
    make_run(work)
    before = snapshot(work)
    holder = _holder(work)
    try:
        for main, argv in ((export_hf.main, ["--workdir", str(work), "--out", str(work / "hf")]),
                           (eval_cmd.main, ["--workdir", str(work), "--tasks",
                                            "titanax_tiny_mc"])):
            with pytest.raises(SystemExit) as exit_info:
                main(argv)
            err = capsys.readouterr().err
            errors = [line for line in err.splitlines() if line.startswith("error:")]
            assert exit_info.value.code == 75 and len(errors) == 1, err[-2000:]
            assert "is in use by" in errors[0] and f"pid {holder.pid}" in errors[0], errors[0]
        assert "--out DIR" in errors[0]  # eval's way around it
        after = snapshot(work)
        assert after.pop(LOCK_NAME) and before.pop(LOCK_NAME) and after == before
        export_hf.main(["--workdir", str(work), "--out", str(tmp_path / "hf"), "--dtype",
                        "float32"])
        assert (tmp_path / "hf" / "config.json").is_file()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
