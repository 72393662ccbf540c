"""xla_flags.runs_on_gpu finds the CUDA plugin of either CUDA generation, under both of the
module names its wheel installs (the GPU image we are lent carries the CUDA 13 plugin; without
this, launch.train there would run without the GPU XLA flags)."""

import pytest

from titanax import xla_flags


@pytest.mark.parametrize("module", xla_flags.CUDA_PLUGIN_MODULES)
def test_runs_on_gpu_recognises_each_cuda_plugin_module(module, tmp_path, monkeypatch):
    # A real module of that name on sys.path, found by importlib as jax would find it.
    pkg = tmp_path.joinpath(*module.split("."))
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert xla_flags._installed(module)
    others = set(xla_flags.CUDA_PLUGIN_MODULES) - {module}
    monkeypatch.setattr(xla_flags, "_installed",
                        lambda m, real=xla_flags._installed: m not in others and real(m))
    assert xla_flags.runs_on_gpu(0, {})
    assert not xla_flags.runs_on_gpu(2, {})  # simulated CPU devices win
    assert not xla_flags.runs_on_gpu(0, {"JAX_PLATFORMS": "cpu"})
    env = {}
    assert xla_flags.apply_for_run(0, env) and "--xla_gpu_enable_latency_hiding_scheduler=true" \
        in env["XLA_FLAGS"]


def test_no_plugin_no_gpu(monkeypatch):
    monkeypatch.setattr(xla_flags, "_installed", lambda m: False)
    assert not xla_flags.runs_on_gpu(0, {})
    assert xla_flags.runs_on_gpu(0, {"JAX_PLATFORMS": "cuda"})
    assert {m.split(".")[-1] for m in xla_flags.CUDA_PLUGIN_MODULES} == {
        "xla_cuda12", "jax_cuda12_plugin", "xla_cuda13", "jax_cuda13_plugin"}
