"""A command refused after the state and data are read leaves the run as it was (issue 54,
loss 1): config.json and metrics.jsonl byte for byte, whichever late check refuses it, the
validation batches or a logger's start (an MLflow store that cannot be written, W&B without a
key). They used to be written before those checks, so a refused `--set` replaced the run's
config and the next plain resume failed the same way."""

import shutil

import jax
import pytest

from tests.helpers.small import small_config
from titanax.config import ConfigError
from titanax.train import loop
from titanax.train import metrics as M


def _snapshot(workdir):
    return {name: (workdir / name).read_bytes() for name in ("config.json", "metrics.jsonl")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    cfg = small_config(**{"train.steps": 2, "train.log_every": 1, "train.eval_every": 2,
                          "train.progress_bar": False, "checkpoint.every_steps": 2})
    loop.train(cfg, workdir, log=lambda *_: None, devices=jax.devices()[:1])
    return cfg, workdir


def _refuse(where, monkeypatch):
    def refuse(*_a, **_k):
        raise ConfigError(f"refused at {where}")
    if where == "validation":
        real = loop._build_data_in_turn

        def data(*a, **k):
            built = real(*a, **k)
            monkeypatch.setattr(built, "val_batches", refuse)
            return built
        monkeypatch.setattr(loop, "_build_data_in_turn", data)
    else:  # a logger's start
        monkeypatch.setattr(M, "MetricsWriter", refuse)


@pytest.mark.parametrize("where", ["validation", "loggers"])
def test_a_late_refusal_leaves_config_and_metrics_untouched(trained, where, monkeypatch,
                                                           tmp_path):
    cfg, trained_dir = trained
    workdir = tmp_path / "run"  # a copy each: one case must not see another's writes
    shutil.copytree(trained_dir, workdir)
    before = _snapshot(workdir)
    changed = small_config(**{"train.steps": 4, "train.log_every": 1, "train.eval_every": 2,
                              "train.progress_bar": False, "checkpoint.every_steps": 2,
                              "optim.lr": 1e-4})
    assert changed.to_dict() != cfg.to_dict()
    _refuse(where, monkeypatch)
    with pytest.raises(ConfigError, match=f"refused at {where}"):
        loop.train(changed, workdir, log=lambda *_: None, devices=jax.devices()[:1])
    assert _snapshot(workdir) == before
