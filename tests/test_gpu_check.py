"""`python -m launch.gpu_check`: the dry run exercises every section's code on the CPU (with the
packages the GPU machine lacks made unimportable), and the runner keeps going past a section
that raises or hangs, keeping the rows it had."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

from titanax.perf.gpu_check import NAMES, Section, run

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


def _env_with(path: pathlib.Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    return env


def test_dry_run_every_section_without_grain_gin_tensorboardx(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    env = _env_with(tmp_path / "site")
    probe = subprocess.run([sys.executable, "-c", "import grain"], env=env, capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "blocked by the test" in probe.stderr

    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "launch.gpu_check", "--dry-run", "--out",
                        str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert wall < 180, f"dry run took {wall:.0f} s"

    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["dry_run"] and list(rep["sections"]) == list(NAMES)
    for name, sec in rep["sections"].items():
        if sec["status"] == "skipped":
            assert name == "ptxas" and "dry run" in sec["reason"], (name, sec)
            continue
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
    assert all(r["pass"] for r in kernels if r["status"] == "ok")
    attn = s["attention"]["rows"]
    # The model's own call, with and without packed documents, against cuDNN causal first.
    assert attn[0]["impl"] == "cudnn" and not attn[0]["documents"]
    assert {(r["impl"], r["documents"]) for r in attn} >= {("model:auto", False),
                                                           ("model:auto", True)}
    assert all(r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0 for r in attn)
    assert all(r["vs_cudnn_causal"] > 0 for r in attn if r["impl"] != "cudnn")
    assert {r["impl"] for r in s["fp8"]["rows"]} >= {"bf16", "xla_fp8", "xla_mx"}
    train = s["train"]["rows"]
    assert [r["precision"] for r in train] == ["default", "fp8_tensorwise", "fp8_delayed",
                                               "mxfp8"]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] for r in train)

    md = (out / "gpu_check.md").read_text()
    for i, name in enumerate(NAMES, 1):
        assert f"## {i}. {name}: " in md
    assert "| precision | attention |" in md and "fwd_tflops" in md
    print(f"dry run wall time: {wall:.1f} s")


FAKES = textwrap.dedent("""
    import time

    def boom(ctx):
        ctx.add({"case": "before"})
        raise RuntimeError("section exploded")

    def hang(ctx):
        ctx.add({"case": "done"})
        ctx.run_item({"case": "stuck"}, lambda: time.sleep(120), estimate_s=0)

    def fine(ctx):
        ctx.run_item({"case": "a"}, lambda: {"value": 1}, estimate_s=0)
        ctx.run_item({"case": "b"}, lambda: 1 / 0, estimate_s=0)
        ctx.run_item({"case": "c"}, lambda: {"pass": False}, estimate_s=0)
        ctx.run_item({"case": "d"}, lambda: {}, estimate_s=1e9, group="big")  # over budget
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
    assert hang["current"] == {"case": "stuck"}
    assert fine["status"] == "fail"
    assert [r["status"] for r in fine["rows"]] == ["ok", "error", "fail", "skipped"]
    assert "ZeroDivisionError" in fine["rows"][1]["error"]
    on_disk = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert {n: s["status"] for n, s in on_disk["sections"].items()} == {
        "boom": "error", "hang": "timeout", "fine": "fail"}
    assert "## 2. hang: timeout" in (tmp_path / "out" / "gpu_check.md").read_text()
