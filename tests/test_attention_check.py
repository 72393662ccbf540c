"""The first-contact check (titanax/train/attention_check.py): before the first step, the kernel
`auto` would run with no GPU record in pallas_kernels/measured.py is checked against the
reference in a child process; a failing or crashing one is refused (cuDNN or the reference
instead, one log line), and the verdict is cached so a second run does not check again.

On a CPU `auto` always resolves to the XLA reference, so the run tests force the plan
(planned_kernel -> "triton", the grid kernel, which the child runs in interpret mode) and break
the kernel in the child alone, through a sitecustomize.py on its PYTHONPATH. planned_kernel's
own choice is tested with a faked Hopper GPU."""

import json
import re
import subprocess

import jax
import pytest

from pallas_kernels import measured
from pallas_kernels.flash_attention import resolve
from tests.helpers.small import run_small, small_config
from titanax.parallel.mesh import build_mesh
from titanax.train import attention_check

AUTO = {"execution.attention_impl": "auto"}
# What the child imports before anything else: the forward kernel made wrong, or a crash.
BREAK = {
    "wrong": "out, lse = _fwd(*a, **k)\n    return out * 1.5, lse",
    "abort": "import os\n    os.abort()",
}


@pytest.fixture(autouse=True)
def no_refusals():
    resolve.clear_refusals()
    yield
    resolve.clear_refusals()


@pytest.fixture()
def children(monkeypatch):
    """The check's child processes started, counted (their argv)."""
    started = []
    real = subprocess.run

    def counting(args, *a, **k):
        if attention_check._CHILD in args:
            started.append(args)
        return real(args, *a, **k)

    monkeypatch.setattr(attention_check.subprocess, "run", counting)
    return started


@pytest.fixture()
def planned(monkeypatch):
    """auto planned as the portable kernel with no GPU record (as on a new GPU)."""
    monkeypatch.setattr(attention_check, "planned_kernel", lambda cfg, mesh: "triton")


def _break_kernel(tmp_path, monkeypatch, how: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from pallas_kernels.flash_attention import kernel_fwd\n"
        "_fwd = kernel_fwd.flash_fwd\n\n\n"
        f"def flash_fwd(*a, **k):\n    {BREAK[how]}\n\n\n"
        "kernel_fwd.flash_fwd = flash_fwd\n")
    monkeypatch.setenv("PYTHONPATH", str(site))


def _check_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("attention check")]


def _verdicts(workdir):
    return [json.loads(p.read_text())
            for p in sorted((workdir / "xla_cache" / "attention_check").glob("*.json"))]


def test_a_passing_kernel_is_checked_once_and_says_nothing(tmp_path, planned, children):
    result, log = run_small(tmp_path / "run", 2, **AUTO)
    assert result.final_step == 2
    assert _check_lines(log) == []
    assert len(children) == 1
    (verdict,) = _verdicts(tmp_path / "run")
    assert verdict["pass"] and verdict["case"] == {
        "impl": "triton", "head_dim": 32, "gqa": 2, "segments": True, "dtype": "float32"}
    assert max(verdict["errors"].values()) < verdict["tol"]
    assert resolve.refused() == {}


def test_a_wrong_kernel_is_refused_in_one_line_and_the_verdict_is_cached(
        tmp_path, monkeypatch, planned, children):
    _break_kernel(tmp_path, monkeypatch, "wrong")
    result, log = run_small(tmp_path / "run", 2, **AUTO)
    assert result.final_step == 2  # the run goes on (on a CPU: the XLA reference)
    (line,) = _check_lines(log)
    # The worst tensor's error: the output is 1.5x (0.5), and dq, which the backward computes
    # from it, further off.
    error = re.fullmatch(r"attention check: triton \(head_dim 32, GQA 2, documents\) failed on "
                         r"cpu: (dq rel error 0\.\d+ > 0\.02); this run uses xla instead "
                         r"\(execution.attention_check=false skips the check\)", line)
    assert error, line
    assert resolve.refused() == {"triton": error.group(1)}
    assert len(children) == 1 and not _verdicts(tmp_path / "run")[0]["pass"]
    # A second run on the workdir finds the verdict: no child, the same line.
    resolve.clear_refusals()
    result, log = run_small(tmp_path / "run", 4, **AUTO)
    assert result.final_step == 4
    assert _check_lines(log) == [line] and len(children) == 1
    assert "triton" in resolve.refused()


def test_a_crashing_kernel_is_a_failure_that_names_the_crash(tmp_path, monkeypatch, planned,
                                                             children):
    _break_kernel(tmp_path, monkeypatch, "abort")
    cfg = small_config(**AUTO)
    lines = []
    attention_check.first_contact(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), None,
                                  lines.append)
    (line,) = lines
    assert line.startswith("attention check: triton (head_dim 32, GQA 2, documents) failed "
                           "on cpu: crashed (signal SIGABRT)"), line
    assert line.endswith("this run uses xla instead (execution.attention_check=false skips "
                         "the check)")
    assert resolve.refused()["triton"].startswith("crashed")
    assert len(children) == 1
    # No cache folder (train.compilation_cache=""): every run checks again.
    attention_check.first_contact(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), None,
                                  lines.append)
    assert len(children) == 2


@pytest.fixture()
def hopper(monkeypatch):
    """A faked H100 for the planning (the run itself is never traced here), with no kernel
    recorded failing on it (measured.FAILED; the test below puts one back)."""
    for module in (resolve, attention_check):
        monkeypatch.setattr(module, "target_platform", lambda: "gpu")
        monkeypatch.setattr(module, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(measured, "FAILED", {})


def _plan(**overrides):
    cfg = small_config(**{**AUTO, "execution.dtype": "bfloat16", "model.head_dim": 64,
                          **overrides})
    return attention_check.planned_kernel(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))


def test_planned_kernel_is_the_unrecorded_kernel_auto_would_run(hopper, monkeypatch):
    assert _plan() == "mosaic_sm90"  # packed documents: ours, never run on a GPU
    assert _plan(**{"data.document_masking": False}) is None  # cuDNN
    assert _plan(**{"execution.attention_impl": "cudnn"}) is None
    assert _plan(**{"execution.attention_impl": "mosaic_sm90"}) is None  # explicit: as asked
    assert _plan(**{"execution.attention_check": False}) is None
    assert _plan(**{"execution.dtype": "float32"}) == "triton"  # no Hopper kernel for fp32
    monkeypatch.setattr(attention_check, "_in_shard_map", lambda mesh: True)  # pipeline
    assert _plan(**{"data.document_masking": False}) == "mosaic_sm90"
    # A GPU run that checked it (VERIFIED) or timed it as the winner (WINS) is a record.
    monkeypatch.setitem(measured.VERIFIED, ("mosaic_sm90", 9), "H100 run")
    assert _plan() is None
    monkeypatch.delitem(measured.VERIFIED, ("mosaic_sm90", 9))
    monkeypatch.setitem(measured.WINS, ("attention", 9), "mosaic_sm90")
    assert _plan() is None
    monkeypatch.setitem(measured.VERIFIED, ("mosaic_sm90", 10), "B200 run")  # another GPU
    monkeypatch.delitem(measured.WINS, ("attention", 9))
    assert _plan() == "mosaic_sm90"
    # A kernel a GPU run saw fail with documents (FAILED) is not planned there: auto takes
    # cuDNN and nothing is checked; without documents it still is.
    monkeypatch.setitem(measured.FAILED, ("mosaic_sm90:documents", 9), "hung")
    assert _plan() is None
    monkeypatch.setattr(attention_check, "_in_shard_map", lambda mesh: False)
    assert _plan(**{"data.document_masking": False}) is None  # cuDNN anyway


def test_the_switch_skips_the_check(tmp_path, hopper, children):
    cfg = small_config(**AUTO, **{"execution.dtype": "bfloat16", "model.head_dim": 64,
                                  "execution.attention_check": False})
    lines = []
    attention_check.first_contact(cfg, build_mesh(cfg.mesh, jax.devices()[:1]),
                                  str(tmp_path), lines.append)
    assert lines == [] and children == [] and not (tmp_path / "attention_check").exists()


def test_the_cache_key_follows_the_case_and_the_kernel_config():
    case = {"impl": "mosaic_sm90", "head_dim": 128, "gqa": 8, "segments": True,
            "dtype": "bfloat16"}
    key = attention_check.cache_key(case, "NVIDIA H100 80GB HBM3")
    assert key == attention_check.cache_key(dict(case), "NVIDIA H100 80GB HBM3")
    others = [attention_check.cache_key({**case, **change}, "NVIDIA H100 80GB HBM3")
              for change in ({"head_dim": 64}, {"gqa": 4}, {"segments": False},
                             {"dtype": "float16"}, {"impl": "triton"})]
    others.append(attention_check.cache_key(case, "NVIDIA H200"))
    assert len({key, *others}) == len(others) + 1
