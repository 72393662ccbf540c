"""`python -m launch.gpu_check`: the dry run exercises every section's code on the CPU (with the
packages the GPU machine lacks made unimportable), and the runner keeps going past a section
that raises or hangs, keeping the rows it had."""

import json
import os
import pathlib
import subprocess
import sys
import tarfile
import textwrap
import time

from titanax.perf.gpu_check import DEFAULT_ORDER, DEFAULT_TIME_LIMIT_S, Section, pack, run
from titanax.perf.gpu_check.choices import CHOICES
from titanax.perf.gpu_check.runner import suspects_after

ROOT = pathlib.Path(__file__).resolve().parent.parent
MISSING_ON_GPU = ("grain", "gin", "tensorboardX")  # not installed on the GPU machine

BLOCKER = f"""
import sys

class _Missing:
    # Every process started with this on PYTHONPATH (the runner's section workers too) fails
    # to import what the GPU machine does not have.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {MISSING_ON_GPU!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None

sys.meta_path.insert(0, _Missing())
"""


# The loan machine has no editable install of titanax: the test removes .venv's, so only the
# working tree (scripts/gpu_loan.sh puts src/ on PYTHONPATH) can provide it.
NO_INSTALL = """
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
"""


def _env_with(path: pathlib.Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    return env


def _loan_machine(tmp_path: pathlib.Path) -> dict:
    """The loan machine's constraints: grain, gin and tensorboardX unimportable, titanax not
    installed, the interpreter `python3` on PATH, nothing on PYTHONPATH but the blocker."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER + NO_INSTALL)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A wrapper, not a symlink: through a symlink elsewhere Python would not find its venv.
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(site), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    return env


def test_loan_command_dry_run_under_the_loan_machines_constraints(tmp_path):
    env = _loan_machine(tmp_path)
    for probe in ("import grain", "import titanax"):
        r = subprocess.run(["python3", "-c", probe], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (probe, r.stderr)

    out, work = tmp_path / "OUT", tmp_path / "work"
    out.mkdir()
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_loan.sh"), "--dry-run"],
                       env={**env, "OUT": str(out), "GPU_LOAN_WORK": str(work)},
                       capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    # About 110 s alone on 2 cores, 181 s beside the rest of the suite in CI: the bound is the
    # runner's own time limit, which every section keeping its budget (status ok) implies.
    assert wall < DEFAULT_TIME_LIMIT_S, f"dry run took {wall:.0f} s"
    # The smoke test printed the versions, and titanax came from the working tree.
    assert "jax 0.11.2" in r.stdout and f"{ROOT}/src/titanax" in r.stdout, r.stdout[:2000]

    # What the loan returns: three files, within the machine's limits.
    assert sorted(p.name for p in out.iterdir()) == sorted((*pack.FILES, pack.ARCHIVE))
    assert pack.check_returnable(out) == []
    with tarfile.open(out / pack.ARCHIVE) as tar:
        names = set(tar.getnames())
    assert {f"logs/{n}.log" for n in DEFAULT_ORDER} <= names
    assert {f"sections/{n}.json" for n in DEFAULT_ORDER} <= names

    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep == json.loads((work / "gpu_check.json").read_text())
    assert rep["dry_run"] and list(rep["sections"]) == list(DEFAULT_ORDER)
    assert rep["suspects"] == {}
    for name, sec in rep["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"), sec.get("rows"))
        assert sec["rows"] or name == "device", name
        assert all(row["status"] in ("ok", "n/a") for row in sec["rows"]), name
    s = rep["sections"]
    assert s["device"]["info"]["jax"] and s["device"]["info"]["platform"] == "cpu"
    kernels = s["kernels"]["rows"]
    ran = {(r["kernel"], r["impl"]) for r in kernels if r["status"] == "ok"}
    assert {("flash_attention", i) for i in ("mosaic_sm90", "mosaic_sm100", "triton",
                                             "cudnn")} <= ran
    assert {("fp8_matmul", i) for i in ("sm90", "pallas_grid", "xla")} <= ran
    assert {r["mode"] for r in kernels if r["kernel"] == "fp8_matmul" and r["impl"] == "sm90"
            and r["status"] == "ok"} == {"tensorwise", "rowwise"}
    assert all(r["pass"] for r in kernels if r["status"] == "ok")
    attn = s["attention"]["rows"]
    # The model's own call, with and without packed documents, against cuDNN causal first.
    assert attn[0]["impl"] == "cudnn" and not attn[0]["documents"]
    assert {(r["impl"], r["documents"]) for r in attn} >= {("model:auto", False),
                                                           ("model:auto", True)}
    assert all(r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0 for r in attn)
    assert all(r["vs_cudnn_causal"] > 0 for r in attn if r["impl"] != "cudnn")
    assert {r["impl"] for r in s["fp8"]["rows"]} >= {"bf16", "xla_fp8", "xla_rowwise", "xla_mx"}
    train = s["train"]["rows"]
    # What the shipped config runs first (on a GPU cuDNN; the dry run's xla stands in).
    assert [r["precision"] for r in train] == ["default", "default", "fp8_tensorwise",
                                               "fp8_delayed", "mxfp8", "fp8_rowwise"]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] for r in train)
    # Every choice made without a GPU, shipped variant first, the alternative against it.
    choices = s["choices"]["rows"]
    assert [r["choice"] for r in choices if r["shipped"]] == [c.name for c in CHOICES]
    assert all(r["vs_shipped"] > 0 for r in choices if not r["shipped"])
    # Attention variants agree with the shipped one (dry run: all run xla, so exactly).
    attention_alts = [r for r in choices if not r["shipped"] and "vs_shipped_rel" in r]
    assert len(attention_alts) >= 5 and all(r["pass"] for r in attention_alts)

    md = (out / "gpu_check.md").read_text()
    for i, name in enumerate(DEFAULT_ORDER, 1):
        assert f"## {i}. {name}: " in md
    assert "| precision | attention |" in md and "fwd_tflops" in md
    print(f"dry run wall time: {wall:.1f} s")


def test_loan_command_names_a_missing_package_in_one_line(tmp_path):
    env = _loan_machine(tmp_path)
    (tmp_path / "site" / "sitecustomize.py").write_text(
        BLOCKER.replace(repr(MISSING_ON_GPU), repr(MISSING_ON_GPU + ("optax",))) + NO_INSTALL)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_loan.sh"), "--dry-run"],
                       env={**env, "OUT": str(tmp_path / "OUT"),
                            "GPU_LOAN_WORK": str(tmp_path / "work")},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: cannot import optax"), r.stderr
    assert "What to carry" in err[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "work" / "gpu_check.json").exists()  # nothing ran


def test_loan_without_a_gpu_stops_at_once_and_says_so(tmp_path):
    """The loan command on a machine whose jax has no GPU (here: no CUDA plugin at all): one
    error line naming what jax said and what CUDA it found, exit 3, within a minute, and a
    report in $OUT saying no GPU was found; no section ran."""
    env = _loan_machine(tmp_path)
    out, work = tmp_path / "OUT", tmp_path / "work"
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_loan.sh")],
                       env={**env, "OUT": str(out), "GPU_LOAN_WORK": str(work),
                            "JAX_PLATFORMS": "cpu"},  # the script must override it
                       capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: no GPU: "), r.stderr
    assert "JAX_PLATFORMS=cuda" in err[0] and "CUDA plugins: " in err[0], err[0]
    assert "Traceback" not in r.stderr
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["error"] == err[0].removeprefix("error: ")
    assert rep["preflight"]["cuda_plugins"] == ["none"]
    assert all(s["status"] == "skipped" and not s["rows"] for s in rep["sections"].values())
    assert "no GPU" in (out / "gpu_check.md").read_text()
    assert not (work / "sections" / "device.json").exists()  # nothing ran
    assert pack.check_returnable(out) == []


def test_preflight_versions():
    """jax other than the pin refuses the loan; flax/optax/orbax off their pins warn."""
    from titanax.perf.gpu_check.preflight import JAX_PIN, pins, version_problems
    pinned = pins()
    assert pinned["jax"] == pinned["jaxlib"] == JAX_PIN
    good = {n: pinned[n] for n in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")}
    assert version_problems(good, pinned) == (None, [
        {"package": n, "version": v, "pinned": v, "status": "ok"} for n, v in good.items()])
    error, rows = version_problems({**good, "jax": "0.12.0", "flax": "0.10.0"}, pinned)
    assert error.startswith("jax 0.12.0 found, titanax pins 0.11.2"), error
    status = {r["package"]: r["status"] for r in rows}
    assert status == {"jax": "error", "jaxlib": "ok", "flax": "warning", "optax": "ok",
                      "orbax-checkpoint": "ok"}


FAKES = textwrap.dedent("""
    import time

    def boom(ctx):
        ctx.add({"case": "before"})
        raise RuntimeError("section exploded")

    def hang(ctx):
        ctx.add({"case": "done"})
        ctx.run_item({"case": "stuck"}, lambda: time.sleep(120), estimate_s=0,
                     uses=("k:hangs",))

    def fine(ctx):
        ctx.run_item({"case": "a"}, lambda: {"value": 1}, estimate_s=0)
        ctx.run_item({"case": "b"}, lambda: 1 / 0, estimate_s=0)
        ctx.run_item({"case": "c"}, lambda: {"pass": False}, estimate_s=0, uses=("k:wrong",))
        ctx.run_item({"case": "d"}, lambda: {}, estimate_s=1e9, group="big")  # over budget
        ctx.run_item({"case": "e"}, lambda: {}, estimate_s=0, uses=("k:hangs",))  # not again

    def spawner(ctx):
        # A section with a child of its own (as ptxas' compile worker), then stuck.
        import os, pathlib, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        pathlib.Path(os.environ["GPU_CHECK_TEST_PIDS"]).write_text(
            f"{os.getpid()} {child.pid} {os.getpgid(0)}")
        time.sleep(120)
""")


def test_a_failing_or_hanging_section_keeps_its_rows_and_the_rest_run(tmp_path, monkeypatch):
    (tmp_path / "gpu_check_fakes.py").write_text(FAKES)
    monkeypatch.setenv("PYTHONPATH", _env_with(tmp_path)["PYTHONPATH"])
    fakes = [Section(n, f"gpu_check_fakes:{n}", 30, b, f"fake {n}") for n, b in
             (("boom", 30), ("hang", 2), ("fine", 30))]
    rep = run(["boom", "hang", "fine"], tmp_path / "out", dry_run=True, sections=fakes)
    boom, hang, fine = (rep["sections"][n] for n in ("boom", "hang", "fine"))
    assert boom["status"] == "error" and "section exploded" in boom["error"]
    assert boom["rows"][0]["case"] == "before"
    assert hang["status"] == "timeout" and hang["rows"][0]["case"] == "done"
    assert hang["current"] == {"case": "stuck", "uses": ["k:hangs"]}
    assert fine["status"] == "fail"
    assert [r["status"] for r in fine["rows"]] == ["ok", "error", "fail", "skipped", "skipped"]
    assert "ZeroDivisionError" in fine["rows"][1]["error"]
    # The kernel that hung in one section is not run by a later one, and the report says why;
    # the one that computed wrong values is marked for any section after.
    assert fine["rows"][4]["reason"] == "k:hangs: timeout in section hang while it ran"
    assert rep["suspects"] == {"k:hangs": "timeout in section hang while it ran",
                               "k:wrong": "fail in section fine"}
    assert suspects_after("x", {"status": "ok", "rows": [
        {"status": "error", "error": "boom", "uses": ["k:e"]}, {"status": "ok", "uses": ["k:o"]}
    ]}) == {"k:e": "error in section x (boom)"}
    on_disk = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert {n: s["status"] for n, s in on_disk["sections"].items()} == {
        "boom": "error", "hang": "timeout", "fine": "fail"}
    assert "## 2. hang: timeout" in (tmp_path / "out" / "gpu_check.md").read_text()


def _gone(pid: int) -> bool:
    """Dead or a zombie (reaped or not, it holds no GPU memory)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_sections_share_the_runners_process_group_and_die_with_it(tmp_path, monkeypatch):
    (tmp_path / "gpu_check_fakes.py").write_text(FAKES)
    pids = tmp_path / "pids"
    monkeypatch.setenv("PYTHONPATH", _env_with(tmp_path)["PYTHONPATH"])
    monkeypatch.setenv("GPU_CHECK_TEST_PIDS", str(pids))
    fake = [Section("spawner", "gpu_check_fakes:spawner", 30, 3, "fake spawner")]
    # At its budget the section is killed with its own child.
    rep = run(["spawner"], tmp_path / "out", dry_run=True, sections=fake)
    assert rep["sections"]["spawner"]["status"] == "timeout"
    section, child, group = map(int, pids.read_text().split())
    assert group == os.getpgid(0)  # the runner's group: a loan's limit kills the sections too
    assert _wait_for(lambda: _gone(section) and _gone(child))

    # A runner killed outright (SIGKILL: no handler runs) takes its running section along.
    pids.unlink()
    script = ("import sys; from titanax.perf.gpu_check import Section, run; "
              "run(['spawner'], sys.argv[1], dry_run=True, sections=[Section('spawner', "
              "'gpu_check_fakes:spawner', 300, 300, 'fake')])")
    runner = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out2")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait_for(pids.exists, 60), "the section never started"
        section, child, group = map(int, pids.read_text().split())
        assert group == os.getpgid(runner.pid)
        runner.kill()
        runner.wait()
        assert _wait_for(lambda: _gone(section)), "the section outlived its runner"
    finally:
        runner.kill()
        for pid in (section, child) if pids.exists() else ():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_default_time_limit_and_budgets():
    """The loan's arithmetic (docs/gpu_check.md): 510 s in all, the sections' budgets leaving
    time for their processes to start, so that the loan command (30 s preflight included)
    ends inside the device tool's timeout_s=570."""
    from titanax.perf.gpu_check.sections import SECTIONS
    assert DEFAULT_TIME_LIMIT_S == 510
    budgets = {s.name: s.budget_s for s in SECTIONS}
    assert sum(budgets[n] for n in DEFAULT_ORDER) <= DEFAULT_TIME_LIMIT_S - 30
