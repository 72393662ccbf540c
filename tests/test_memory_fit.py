"""A run whose train step cannot fit the devices' memory says so before its first step, with
the --set that fits; train.grad_accum=auto takes that value itself (issue 22). On CPU with a
configured limit (train.device_memory_limit) between the step's needs at grad_accum 1 and 2."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from titanax.config import Config, ConfigError, apply_overrides, load_config
from titanax.parallel.mesh import build_mesh
from titanax.plan.fit import FitAnswer, candidates, fit_to_devices, search_fit
from titanax.train import memory_fit
from titanax.train.compilation_cache import compilation_cache
from titanax.train.loop import train

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_dim": 128, "model.vocab_size": 512, "train.batch_size": 8,
         "train.seq_len": 128, "data.source": "synthetic", "mesh.data": 1, "mesh.fsdp": -1,
         "train.steps": 2, "train.log_every": 1, "train.eval_every": 0,
         "train.eval_batches": 1, "train.progress_bar": False, "checkpoint.every_steps": 0}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One persistent compilation cache for the module: the runs compile the steps this
    module's fixture compiled, so they load them (the test stays well under a minute)."""
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="module")
def limit(cache):
    """A memory limit between the step's needs at grad_accum 1 and 2 on 2 devices (4
    sequences each; the tests using it take devices8, so jax has the simulated devices)."""
    cfg = load_config(ROOT / "configs/tiny.py", SMALL)
    mesh = build_mesh(cfg.mesh, jax.devices()[:2])
    with compilation_cache(cache, ROOT):
        need = [memory_fit.step_memory(apply_overrides(cfg, {"train.grad_accum": a}),
                                       mesh)["total"] for a in (1, 2)]
    assert need[1] < need[0], need  # half the activations per microbatch
    return (need[0] + need[1]) // 2, need


def test_refusal_names_the_need_and_the_grad_accum_that_fits(tmp_path, devices8, limit,
                                                             cache):
    bytes_, need = limit
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    sets = [f"--set={k}={v}" for k, v in SMALL.items()]
    r = subprocess.run([sys.executable, "-m", "launch.train", "--host-devices", "2", *sets,
                        f"--set=train.device_memory_limit={bytes_}",
                        f"--set=train.compilation_cache={cache}", "--workdir",
                        str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert re.fullmatch(rf"error: the train step needs {need[0] / 1e6:.1f} MB per device of "
                        rf"{bytes_ / 1e6:.1f} MB \(train.device_memory_limit\); --set "
                        rf"train.grad_accum=2 fits \({need[1] / 1e6:.1f} MB\)", errors[0]), errors
    assert not (tmp_path / "run").exists()  # stopped before any state, data or step


def test_auto_grad_accum_fits_and_trains_as_the_explicit_setting(tmp_path, devices8, limit,
                                                                 cache):
    bytes_, need = limit
    lines = []
    small = {**SMALL, "train.compilation_cache": cache}
    auto = load_config(ROOT / "configs/tiny.py", {**small, "train.grad_accum": "auto",
                                                  "train.device_memory_limit": bytes_})
    got = train(auto, tmp_path / "auto", log=lines.append, devices=devices8[:2],
                fit=fit_to_devices)
    choice = [s for s in lines if s.startswith("train.grad_accum=auto")]
    assert choice == [f"train.grad_accum=auto -> 2 ({need[1] / 1e6:.1f} MB of "
                      f"{bytes_ / 1e6:.1f} MB)"], lines
    explicit = load_config(ROOT / "configs/tiny.py", {**small, "train.grad_accum": 2})
    want = train(explicit, tmp_path / "explicit", log=lambda *_: None, devices=devices8[:2])
    assert got.losses == want.losses and len(got.losses) == 2
    # The run's saved config says what ran; an 'auto' config reads back too (resume).
    saved = (tmp_path / "auto" / "config.json").read_text()
    assert '"grad_accum": 2' in saved
    assert apply_overrides(auto, {}).to_dict()["train"]["grad_accum"] == "auto"


def test_auto_without_a_limit_on_cpu_is_one(devices8):
    cfg = load_config(ROOT / "configs/tiny.py", {**SMALL, "train.grad_accum": "auto"})
    lines = []
    mesh = build_mesh(cfg.mesh, devices8[:2])
    cfg, compiled = fit_to_devices(cfg, mesh, lines.append)
    assert cfg.train.grad_accum == 1 and compiled is None
    assert "no device memory limit" in lines[0]


def test_candidates_grad_accum_first_then_more_frugal_remat():
    cfg = load_config(ROOT / "configs/tiny.py", {**SMALL, "execution.remat": "dots"})
    got = list(candidates(cfg, batch_ways=2))  # 4 sequences per device
    assert got == [{"train.grad_accum": 2}, {"train.grad_accum": 4},
                   *({"execution.remat": r, "train.grad_accum": k}
                     for r in ("full", "full_offload") for k in (1, 2, 4))]
    # With the optimizer in host memory the master weights may follow, summed in place.
    off = apply_overrides(cfg, {"train.offload_optimizer": True, "execution.remat": "full"})
    got = list(candidates(off, batch_ways=2))
    assert got[-6:] == [{"train.offload_params": True, "execution.remat": r, "train.grad_accum": k}
                        for r in ("full", "full_offload") for k in (1, 2, 4)]


def _fake_memory(cfg: Config) -> int:
    """A step's bytes as a function of the settings the search changes: activations shrink
    with grad_accum, more frugal remat and the master weights in host memory save more."""
    saved = {"dots": 0, "full": 10, "full_offload": 30}[cfg.execution.remat]
    return 100 + 640 // cfg.train.grad_accum - saved - (60 if cfg.train.offload_params else 0)


@pytest.mark.parametrize("capacity, want, compiled", [
    # (remat, offload_params, grad_accum) of the answer; what was compiled, in order
    (90, ("full_offload", False, 32), [("dots", False, 32), ("full", False, 32),
                                       ("full_offload", False, 32), ("full_offload", False, 4),
                                       ("full_offload", False, 16)]),
    (45, ("full_offload", True, 32), [("dots", False, 32), ("full", False, 32),
                                      ("full_offload", False, 32), ("full", True, 32),
                                      ("full_offload", True, 32), ("full_offload", True, 4),
                                      ("full_offload", True, 16)]),
    (5, None, [("dots", False, 32), ("full", False, 32), ("full_offload", False, 32),
               ("full", True, 32), ("full_offload", True, 32)]),
])
def test_search_compiles_each_groups_largest_count_then_bisects(capacity, want, compiled):
    """Memory falls as grad_accum grows, so a group (one remat policy, one offload setting)
    whose most microbatches do not fit is skipped after one compile, and the smallest count
    that fits is found by bisection: 5-7 compiles of the 29 candidates here."""
    cfg = load_config(ROOT / "configs/tiny.py", {**SMALL, "train.batch_size": 64,
                                                 "execution.remat": "dots",
                                                 "train.offload_optimizer": True})
    assert len(list(candidates(cfg, batch_ways=2))) == 29  # 32 sequences per device
    seen = []

    def measure(c):
        seen.append((c.execution.remat, c.train.offload_params, c.train.grad_accum))
        return {"memory": {"total": _fake_memory(c)}}

    need = {"arguments": 1, "outputs": 0, "aliased": 0, "total": 1000}
    answer = search_fit(cfg, measure, capacity, "a test", 2, need=need)
    assert seen == compiled
    if want is None:
        assert answer.overrides is None and "no train.grad_accum or execution.remat" in answer.line()
    else:
        remat, offload, k = want
        assert answer.overrides == {**({"train.offload_params": True} if offload else {}),
                                    "execution.remat": remat, "train.grad_accum": k}
        assert answer.fit_bytes == _fake_memory(apply_overrides(cfg, answer.overrides))


def test_auto_takes_a_change_beyond_grad_accum_and_says_so(devices8, monkeypatch):
    """grad_accum=auto runs what the search found even when it needs the master weights in
    host memory and another remat policy (8x H100, 70B, the optimizer offloaded), and its
    line names every setting it changed."""
    cfg = load_config(ROOT / "configs/tiny.py", {
        **SMALL, "train.batch_size": 64, "execution.remat": "full", "train.offload_optimizer": True,
        "train.grad_accum": "auto", "train.device_memory_limit": "45MB"})
    monkeypatch.setattr(memory_fit, "compile_train_step", lambda c, mesh: c)
    monkeypatch.setattr(memory_fit, "compiled_memory", lambda c: {
        "arguments": 1, "outputs": 0, "aliased": 0, "total": _fake_memory(c) * 10**6})
    lines = []
    got, compiled = fit_to_devices(cfg, build_mesh(cfg.mesh, devices8[:2]), lines.append)
    assert (got.execution.remat, got.train.offload_params, got.train.grad_accum) == (
        "full_offload", True, 32) and compiled == got
    assert lines[-1] == ("train.grad_accum=auto -> 32, with train.offload_params=true "
                         "execution.remat=full_offload (30.0 MB of 45.0 MB)"), lines


def test_answer_without_a_fit_says_why():
    need = {"arguments": 90 * 10**9, "outputs": 0, "aliased": 0, "total": 120 * 10**9}
    line = FitAnswer(need, 76 * 10**9, "95% of 80.0 GB").line()
    assert line.startswith("the train step needs 120.0 GB per device of 76.0 GB")
    assert "90.0 GB of it is the train state" in line and "launch.plan --search" in line


def test_auto_and_the_limit_read_from_set_gin_and_saved_configs(tmp_path):
    gin = tmp_path / "auto.gin"
    gin.write_text("train.grad_accum = 'auto'\ntrain.device_memory_limit = '76.5GiB'\n")
    cfg = load_config(gin)
    assert cfg.train.grad_accum == "auto" and cfg.train.known_grad_accum == 1
    assert cfg.train.device_memory_limit_bytes == int(76.5 * 2**30)
    assert Config.from_dict(cfg.to_dict()) == cfg  # config.json / a checkpoint's config
    cfg = load_config(None, ["train.grad_accum=4", "train.device_memory_limit=80GB"])
    assert cfg.train.grad_accum == 4 and cfg.train.device_memory_limit_bytes == 80 * 10**9
    for bad, message in (("train.grad_accum=fast", "a positive integer or 'auto'"),
                         ("train.device_memory_limit=80 parsecs", "is not a size")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [bad])


def test_launch_plan_with_auto_plans_the_change_it_takes(monkeypatch, tmp_path, capsys):
    """launch.plan with train.grad_accum=auto plans what launch.train would run: the answer of
    the compile's fit search, remat and offload included, and prints the one line naming it
    (not the refusal launch.train would give without auto)."""
    from launch import plan as launch_plan
    from titanax.plan import compile as plan_compile

    change = {"train.offload_params": True, "execution.remat": "full", "train.grad_accum": 16}
    memory = lambda total: dict(arguments=1e9, temporaries=total - 1e9, outputs=0, aliased=0,
                                total=total)

    def fake_compile(cfg, cluster, fit=None, **kw):
        assert cfg.train.grad_accum == 1 and fit["capacity"] == 76 * 10**9
        result = {"ok": True, "target": "gpu", "device_kind": "NVIDIA H100",
                  "memory": memory(529.9e9), "lower_s": 1.0, "compile_s": 1.0}
        fit_result = {**result, "memory": memory(70.6e9)}
        return {**result, "fit": {"fits": False, "overrides": change, "bytes": 70.6e9,
                                  "line": "the train step needs 529.9 GB", "tried": [],
                                  "set_flags": "", "result": fit_result}}

    monkeypatch.setattr(plan_compile, "compile_in_subprocess", fake_compile)
    launch_plan.main(["--config", str(ROOT / "configs/llama3_70b.py"), "--gpu", "h100",
                      "--nodes", "1", "--set", "train.offload_optimizer=true", "--set",
                      "train.grad_accum=auto", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert ("=> train.grad_accum=auto -> 16, with train.offload_params=true execution.remat=full "
            "(70.6 GB, where grad_accum 1 needs 529.9 GB)") in out
    assert "the train step needs" not in out and "FITS with 5.4 GB to spare" in out
    assert "host offload costs" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["settings"]["grad_accum"] == 16 and plan["settings"]["offload_params"]
    assert plan["settings"]["remat"] == "full" and plan["host_offload_cost_s"] > 0


def test_single_buffered_loop_is_a_per_compile_option(devices8):
    """execution.loop_double_buffering=false reaches XLA as a compile option of this step
    alone (xla_flags.compiler_options), which XLA:CPU accepts and ignores; the default adds
    none, so a default step compiles exactly as before."""
    from titanax import xla_flags

    cfg = load_config(ROOT / "configs/tiny.py", SMALL)
    off = apply_overrides(cfg, {"execution.loop_double_buffering": False})
    assert xla_flags.compiler_options(cfg) == {}
    assert xla_flags.compiler_options(off) == {
        "xla_gpu_enable_while_loop_double_buffering": False}
    assert any(xla_flags.DOUBLE_BUFFERING in f for f in xla_flags.GPU_FLAGS)
    mesh = build_mesh(off.mesh, jax.devices()[:2])
    assert memory_fit.step_memory(off, mesh)["total"] > 0
