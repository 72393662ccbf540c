"""launch.plan refuses mxfp8 on a GPU without block-scaled MMA (Hopper) before compiling, in
one line naming the fix; Blackwell takes it. (The trace-time refusal, and what the FP8 GEMMs
compile to, are in pallas_kernels/fp8/test_accumulation.py.)"""

import pytest

import launch.plan
from pallas_kernels import aot
from titanax.config import load_config
from titanax.plan import Cluster, PlanError
from titanax.plan.cluster import plan_config

CONFIG = aot.REPO / "configs" / "tiny.py"


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_mxfp8_is_refused_on_hopper(gpu, capsys):
    cfg = load_config(CONFIG, ["execution.matmul_precision=mxfp8"])
    with pytest.raises(PlanError, match="Blackwell.*fp8_tensorwise, fp8_delayed or fp8_rowwise"):
        plan_config(cfg, Cluster(gpu, 1))
    with pytest.raises(SystemExit) as exit_:  # --no-compile: refused before any compile
        launch.plan.main(["--config", str(CONFIG), "--gpu", gpu, "--nodes", "1", "--no-compile",
                          "--set", "execution.matmul_precision=mxfp8"])
    assert exit_.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --gpu {gpu}: mxfp8") and "\n" not in err


def test_blackwell_takes_mxfp8_and_hopper_the_tensorwise_and_rowwise_recipes():
    mx = load_config(CONFIG, ["execution.matmul_precision=mxfp8"])
    assert plan_config(mx, Cluster("b200", 1)).execution.matmul_precision == "mxfp8"
    for recipe in ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise"):
        cfg = load_config(CONFIG, [f"execution.matmul_precision={recipe}"])
        assert plan_config(cfg, Cluster("h100", 1)).execution.matmul_precision == recipe


def test_launch_train_refuses_mxfp8_on_hopper_in_one_line(monkeypatch, tmp_path):
    # What the Trainer checks before building anything, on the GPU the process runs on.
    import importlib

    from titanax.config import ConfigError
    from titanax.train.loop import Trainer
    linear = importlib.import_module("titanax.ops.linear")  # (titanax.ops.linear: a function)

    monkeypatch.setattr(linear, "compute_capability", lambda: (9, 0))
    assert linear.precision_refusal("fp8_tensorwise") is None
    with pytest.raises(ConfigError, match=r"execution.matmul_precision=mxfp8: .*Blackwell"):
        Trainer(load_config(CONFIG, ["execution.matmul_precision=mxfp8"]), tmp_path)
    assert not any(tmp_path.iterdir())  # refused before the workdir was touched
    monkeypatch.setattr(linear, "compute_capability", lambda: (10, 0))
    assert linear.precision_refusal("mxfp8") is None
