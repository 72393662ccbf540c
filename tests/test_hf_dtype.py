"""An imported model computes in the dtype its config.json names (transformers 5 'dtype', 4.x
'torch_dtype'), as transformers runs it; --set and launch.generate --dtype override it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.hf_runs import HF_CONFIG
from titanax.hf.run_config import import_config

pytestmark = pytest.mark.usefixtures("devices8")


@pytest.mark.parametrize("keys, overrides, want", [
    ({"torch_dtype": "float32"}, [], "float32"),
    ({"dtype": "bfloat16", "torch_dtype": "float32"}, [], "bfloat16"),  # 5.x's key first
    ({"dtype": "float16"}, [], "float16"),
    ({"torch_dtype": "float32"}, ["execution.dtype=bfloat16"], "bfloat16"),  # --set wins
    ({}, [], "bfloat16"),  # none named: titanax's default
])
def test_import_computes_in_the_published_dtype(tmp_path, keys, overrides, want):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **HF_CONFIG,
                                                      **keys}))
    assert import_config(tmp_path, None, overrides).execution.dtype == want


def test_import_without_a_config_is_a_fine_tuning_recipe_that_asks_for_data(tmp_path):
    """lr 2e-5, cosine to zero after 3% warmup, FSDP over all devices, full remat, sequences
    up to the model's context (at most 8192), and no data: launch.train refuses in one line,
    writing nothing, and names the --set."""
    from tests.helpers.cli import assert_one_error, cli
    from titanax.config import SOURCE_UNSET
    from titanax.train.optim import lr_schedule

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **HF_CONFIG}))
    cfg = import_config(tmp_path, None, ["train.steps=200"])
    assert (cfg.optim.lr, cfg.optim.schedule, cfg.optim.min_lr_ratio) == (2e-5, "cosine", 0.0)
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.execution.remat) == (1, -1, "full")
    assert cfg.train.seq_len == 64 and cfg.data.source == SOURCE_UNSET  # the model's 64
    lr = lr_schedule(cfg)
    assert float(lr(5)) < 2e-5 and float(lr(6)) == pytest.approx(2e-5)  # 3% of 200: 6
    assert float(lr(200)) == pytest.approx(0.0, abs=1e-12)
    r = cli("launch.train", "--workdir", tmp_path / "run", "--set", f"data.source={SOURCE_UNSET}",
            "--set", "model.d_model=64")
    assert_one_error(r, 2, "data.source is not set", "--set data.source=DIR")
    assert not (tmp_path / "run").exists()
