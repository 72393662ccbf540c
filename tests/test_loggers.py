"""train.loggers: the config field, the fan-out (metrics.jsonl, TensorBoard, W&B, MLflow), the
run each service keeps per workdir and continues on resume, and one real run logging to MLflow.
W&B runs offline and MLflow against a local file store: no network, no server."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest

from tests.helpers.small import run_small, small_config
from tests.helpers.wandb_records import offline_run
from titanax.config import ConfigError, TrainConfig, apply_overrides
from titanax.loggers import LOGGERS
from titanax.train.loggers import load_loggers
from titanax.train.metrics import MetricsWriter, read_metrics

CONFIG = {"model": {"d_model": 128, "arch": "llama3"}, "train": {"steps": 3, "loggers": "x"},
          "data": {"source": ["a.jsonl", "b.jsonl"]}}
ROWS = {0: {"val_loss": 6.5},
        1: {"loss": 6.25, "lr": 1e-4, "mem_in_use": None, "skipped_steps": 0},
        2: {"loss": 5.5, "lr": 2e-4, "mem_in_use": None, "skipped_steps": 0}}


def _fake_run(workdir, loggers, steps, config=CONFIG, purge_step=0):
    """What the Trainer does with its writer: start, a row per step, close."""
    writer = MetricsWriter(workdir, loggers=loggers, config=config, purge_step=purge_step)
    try:
        for step in steps:
            writer.write(step, ROWS.get(step, {"loss": 5.0 - step, "lr": 3e-4}))
    finally:
        writer.close()


# --- the config field --------------------------------------------------------------------------

def test_loggers_field_is_normalised_and_checked():
    assert TrainConfig().logger_names == ("jsonl", "tensorboard")
    assert TrainConfig(loggers=" JSONL, mlflow,jsonl ").loggers == "jsonl,mlflow"
    assert TrainConfig(loggers=("jsonl", "wandb")).logger_names == ("jsonl", "wandb")
    cfg = apply_overrides(small_config(), ["train.loggers=jsonl,tensorboard,wandb"])
    assert cfg.train.logger_names == ("jsonl", "tensorboard", "wandb")
    with pytest.raises(ConfigError, match=r"train.loggers: 'wandbb' is not one of \['jsonl', "
                       r"'tensorboard', 'wandb', 'mlflow'\]. Did you mean 'wandb'"):
        TrainConfig(loggers="jsonl,wandbb")
    with pytest.raises(ConfigError, match="train.loggers: 'tensorboard,wandb' lacks 'jsonl': "
                       "metrics.jsonl is what loss.png.*'jsonl,tensorboard,wandb'"):
        TrainConfig(loggers="tensorboard,wandb")


def test_missing_package_is_one_line_naming_the_extra(monkeypatch):
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # `import wandb` fails as if not installed
        monkeypatch.delitem(sys.modules, f"titanax.train.loggers.{name}", raising=False)
        with pytest.raises(ConfigError) as e:
            load_loggers(["jsonl", name])
        assert str(e.value) == (f"train.loggers: '{name}' needs the {name} package: pip install "
                                f"'titanax[{name}]' (or drop {name} from train.loggers)")


def test_every_table_entry_names_a_logger_class():
    for cls in load_loggers(LOGGERS, check=False):
        assert all(callable(getattr(cls, m, None)) for m in ("start", "log", "close")), cls


# --- the fan-out ----------------------------------------------------------------------------

def test_jsonl_and_tensorboard_by_default(tmp_path):
    _fake_run(tmp_path, "jsonl,tensorboard", [0, 1, 2])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {k: v for k, v in rows[1].items() if k not in ("step", "time")} == ROWS[1]
    assert all(list(r)[-1] == "time" for r in rows)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "loggers.json").exists()  # nothing to continue for these two


def test_only_process_0_writes(tmp_path):
    writer = MetricsWriter(tmp_path / "w", enabled=False, loggers="jsonl,mlflow", config={})
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not (tmp_path / "w").exists()


# --- W&B, offline -------------------------------------------------------------------------------

@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline with every folder of its own under tmp_path, and an address nothing listens
    at, so a network call would fail rather than pass unnoticed."""
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                 "WANDB_ARTIFACT_DIR"):
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                        "WANDB_CONSOLE": "off", "WANDB_BASE_URL": "http://127.0.0.1:9",
                        "WANDB_PROJECT": "titanax-test"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path / "wandb_dir"


def _children() -> list[str]:
    """This process's live child processes, by name."""
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            name = stat.read_text().partition("(")[2].rpartition(")")[0]
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(name)
    return out


def test_wandb_offline_logs_the_rows_and_config_and_resumes_the_same_run(tmp_path,
                                                                         wandb_offline):
    work = tmp_path / "run"
    _fake_run(work, "jsonl,wandb", [0, 1, 2])
    run_id = json.loads((work / "loggers.json").read_text())["wandb"]["run_id"]
    (first,) = wandb_offline.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    logged = offline_run(first)
    assert logged["run_id"] == run_id
    assert logged["config"]["model"] == CONFIG["model"]
    assert logged["config"]["data"] == CONFIG["data"]
    # Every number of each row at its step; None (mem_in_use on XLA:CPU) and time left out.
    assert logged["history"] == {s: {k: v for k, v in row.items() if v is not None}
                                 for s, row in ROWS.items()}
    assert not [c for c in _children() if "wandb" in c]  # wandb-core ended with the run

    # The resumed run (from a checkpoint at step 2) continues the same W&B run id. W&B names an
    # offline run's folder by its start time to the second: a real restart is never within the
    # same second, but this fake one can be, and would then share the first run's folder.
    time.sleep(1.0)
    _fake_run(work, "jsonl,wandb", [3, 4], purge_step=3)
    resumed = sorted(wandb_offline.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(resumed) == 2  # offline, each start writes its own file; `wandb sync` joins them
    second = offline_run(next(p for p in resumed if p != first))
    assert second["run_id"] == run_id and sorted(second["history"]) == [3, 4]
    assert second["history"][4] == {"loss": 1.0, "lr": 3e-4}


def test_wandb_skips_the_steps_the_run_already_has(tmp_path, monkeypatch):
    """Online, a resumed W&B run starts at the step after its newest; the repeated steps are
    skipped (W&B would drop each with a warning)."""
    import wandb

    logged = []

    class Run:
        starting_step = 3

        def log(self, values, step):
            logged.append(step)

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kw: Run())
    monkeypatch.setattr(wandb, "teardown", lambda: None)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # online: the check wants a key
    _fake_run(tmp_path, "jsonl,wandb", [2, 3, 4], purge_step=2)
    assert logged == [3, 4]
    assert [r["step"] for r in read_metrics(tmp_path)] == [2, 3, 4]


# --- MLflow, a local file store -------------------------------------------------------------

@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    # MLflow 3.7+ refuses a plain folder store unless told: a test needs no database.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "titanax-test")
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def _history(client, run_id: str, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def test_mlflow_logs_metrics_and_params_and_resumes_the_same_run(tmp_path, mlflow_store):
    work = tmp_path / "run"
    _fake_run(work, "jsonl,mlflow", [0, 1, 2])
    run_id = json.loads((work / "loggers.json").read_text())["mlflow"]["run_id"]
    run = mlflow_store.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert mlflow_store.get_experiment(run.info.experiment_id).name == "titanax-test"
    assert _history(mlflow_store, run_id, "loss") == {1: 6.25, 2: 5.5}
    assert _history(mlflow_store, run_id, "val_loss") == {0: 6.5}
    assert "mem_in_use" not in run.data.metrics and "time" not in run.data.metrics
    assert run.data.params["model.d_model"] == "128"
    assert run.data.params["data.source"] == '["a.jsonl", "b.jsonl"]'

    # Resumed from a checkpoint at step 1 with more steps: step 2 again (already logged,
    # skipped), then 3; train.steps cannot change as a parameter, so it is a tag.
    longer = {**CONFIG, "train": {**CONFIG["train"], "steps": 4}}
    _fake_run(work, "jsonl,mlflow", [2, 3], config=longer, purge_step=2)
    run = mlflow_store.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _history(mlflow_store, run_id, "loss") == {1: 6.25, 2: 5.5, 3: 2.0}
    assert sorted(m.step for m in mlflow_store.get_metric_history(run_id, "loss")) == [1, 2, 3]
    assert run.data.params["train.steps"] == "3" and run.data.tags["changed.train.steps"] == "4"
    assert len(mlflow_store.search_runs([run.info.experiment_id])) == 1


def test_mlflow_refused_store_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match="train.loggers: mlflow could not use the tracking "
                       "store 'file://.*Set MLFLOW_TRACKING_URI to a tracking server"):
        _fake_run(tmp_path / "run", "jsonl,mlflow", [1])


def test_a_real_run_logs_to_mlflow(tmp_path, mlflow_store):
    """The Trainer's wiring: train.loggers reaches the writer, the config is the run's."""
    work = tmp_path / "run"
    run_small(work, 2, **{"train.loggers": "jsonl,tensorboard,mlflow"})
    run_id = json.loads((work / "loggers.json").read_text())["mlflow"]["run_id"]
    run = mlflow_store.get_run(run_id)
    rows = read_metrics(work)
    assert _history(mlflow_store, run_id, "loss") == {r["step"]: r["loss"] for r in rows
                                                      if "loss" in r}
    assert set(_history(mlflow_store, run_id, "val_loss")) == {0, 2}
    assert run.data.params["train.loggers"] == "jsonl,tensorboard,mlflow"
    assert run.data.params["model.d_model"] == "128" and run.info.status == "FINISHED"


# --- failures: at start one line, mid-run a warning (issue 54) ---------------------------------

def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_wandb_without_an_api_key_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(ConfigError, match=r"^train.loggers: wandb has no API key "
                       r"\(WANDB_MODE=online\): run `wandb login` or set WANDB_API_KEY"):
        load_loggers(["jsonl", "wandb"])
    with pytest.raises(ConfigError, match="wandb has no API key"):
        _fake_run(tmp_path / "run", "jsonl,tensorboard,wandb", [1])
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("error", [RuntimeError("service died"), OSError(13, "denied"),
                                   ValueError("bad")])
def test_any_start_failure_is_one_line_naming_logger_error_and_fix(tmp_path, monkeypatch,
                                                                   error):
    """Whatever a logger's start raises (wandb.init's UsageError, an OSError from
    TensorBoard's folder) is one ConfigError line; the run id it stored goes with it."""
    import wandb

    def init(**_kw):
        raise error

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setenv("WANDB_MODE", "offline")
    work = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        _fake_run(work, "jsonl,wandb", [1])
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"train.loggers: wandb could not start ({type(error).__name__}: ")
    assert "run `wandb login` or set WANDB_API_KEY" in line
    assert not (work / "loggers.json").exists()  # the id chosen for the failed start is gone
    assert not (work / "metrics.jsonl").exists()

    (work / "tb").rmdir() if (work / "tb").is_dir() else None
    (work / "tb").write_text("a file where the folder goes")
    with pytest.raises(ConfigError, match=r"^train.loggers: tensorboard could not start "
                       r"\(.*\); WORKDIR/tb must be a writable folder"):
        _fake_run(work, "jsonl,tensorboard", [1])


def test_unreachable_mlflow_server_is_refused_in_seconds(tmp_path, monkeypatch):
    """MLflow's client retries 7 times with backoff (252 s at a closed port): the check
    tries the port first, and the client's retries are bounded where the user left them."""
    from titanax.train.loggers import mlflow as mlflow_logger

    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for name in mlflow_logger.HTTP_LIMITS:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")  # the user's own: kept
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        _fake_run(tmp_path / "run", "jsonl,mlflow", [1])
    assert time.monotonic() - t0 < 15
    assert str(e.value).startswith(f"train.loggers: mlflow cannot reach the tracking server "
                                   f"'{uri}' (")
    assert "start it, or set MLFLOW_TRACKING_URI" in str(e.value)
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"

    # Past the port check (a server that went away since), the client's own retries end
    # within seconds too, in one line.
    monkeypatch.setattr(mlflow_logger.MlflowLogger, "check", classmethod(lambda cls: None))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"^train.loggers: mlflow could not use the tracking "
                       "store"):
        _fake_run(tmp_path / "run", "jsonl,mlflow", [1])
    assert time.monotonic() - t0 < 15


def test_a_logger_failing_mid_run_warns_once_and_training_goes_on(tmp_path, mlflow_store,
                                                                    monkeypatch, capsys):
    """The server goes away after the run started: one warning, the rows go on to
    metrics.jsonl, the logger is tried again after RETRY_AFTER_S and says when it records."""
    from mlflow.tracking import MlflowClient

    import titanax.train.loggers as L

    calls = []

    def down(self, *a, **k):
        calls.append(k.get("metrics", [None])[0].step if k.get("metrics") else None)
        raise ConnectionError("Connection refused")

    clock = [1000.0]
    monkeypatch.setattr(L.time, "monotonic", lambda: clock[0])
    writer = MetricsWriter(tmp_path, loggers="jsonl,mlflow", config=CONFIG)
    real = MlflowClient.log_batch
    writer.write(1, {"loss": 3.0})
    monkeypatch.setattr(MlflowClient, "log_batch", down)
    for step in (2, 3, 4):
        writer.write(step, {"loss": 3.0 - step / 10})
    assert calls == [2]  # tried once, then dropped until RETRY_AFTER_S passed
    clock[0] += L.RETRY_AFTER_S
    monkeypatch.setattr(MlflowClient, "log_batch", real)
    writer.write(5, {"loss": 2.0})
    monkeypatch.setattr(MlflowClient, "set_terminated", down)
    writer.close()  # a failing close warns too
    err = capsys.readouterr().err
    assert err.count("mlflow did not record step 2 (ConnectionError: Connection refused); "
                     "training goes on") == 1
    assert "mlflow records again from step 5" in err
    assert "mlflow did not close its run" in err
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    run_id = json.loads((tmp_path / "loggers.json").read_text())["mlflow"]["run_id"]
    assert _history(mlflow_store, run_id, "loss") == {1: 3.0, 5: 2.0}
