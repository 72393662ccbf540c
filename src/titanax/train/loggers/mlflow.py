"""MLflow (`pip install 'titanax[mlflow]'`, the mlflow-skinny client): one MLflow run per
workdir, in the tracking store $MLFLOW_TRACKING_URI names, experiment $MLFLOW_EXPERIMENT_ID or
$MLFLOW_EXPERIMENT_NAME (default "titanax"). The config is logged as parameters named as --set
names them (train.steps). The run id is stored in WORKDIR/loggers.json on the first start; a
resumed run continues it.

It talks to the store through MlflowClient with the run id in hand, not mlflow.start_run:
the fluent API keeps one active run per process, which a caller's own run would collide with.

MLflow's HTTP client retries a failed request 7 times with exponential backoff (about 4
minutes before a server nothing listens at is reported); check() bounds that, for the
variables the user has not set (HTTP_LIMITS), and tries a tracking server's port first, so an
unreachable server is refused in seconds. Mid-run failures are the Guarded wrapper's
(titanax/train/loggers/__init__.py): one warning, training goes on."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time
import urllib.parse

from titanax.config.errors import ConfigError
from titanax.train.loggers import Resume, flat_config, missing_extra, scalars

try:
    import mlflow
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
except ModuleNotFoundError:
    raise missing_extra("mlflow", "mlflow") from None

MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value
# MLflow's defaults: 7 retries, backoff factor 2, 120 s per request. These: a request that
# cannot connect is given up after about 3 s (retries after 0 s and 2 s), one that hangs
# after 3 x 10 s. Set only where the user has not set them.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PROBE_TIMEOUT_S = 5.0
_FIX = ("Set MLFLOW_TRACKING_URI to a tracking server (http://HOST:5000) or a database "
        "(sqlite:///PATH, with the full mlflow package), or drop mlflow from train.loggers; "
        "docs/monitoring.md")


class MlflowLogger:
    FIX = _FIX

    @classmethod
    def check(cls) -> None:
        """Bounds the client's retries, and refuses a tracking server nothing listens at."""
        for name, value in HTTP_LIMITS.items():
            os.environ.setdefault(name, value)
        uri = mlflow.get_tracking_uri()
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname, port), timeout=PROBE_TIMEOUT_S).close()
        except OSError as e:
            why = e.strerror or type(e).__name__
            raise ConfigError(f"train.loggers: mlflow cannot reach the tracking server {uri!r} "
                              f"({why}): start it, or {_FIX[0].lower()}{_FIX[1:]}") from None

    def start(self, workdir: pathlib.Path, config: dict, resume: Resume) -> None:
        uri = mlflow.get_tracking_uri()
        try:
            self._client = MlflowClient(uri)
            self._open_run(pathlib.Path(workdir), _params(config), resume, uri)
        except MlflowException as e:  # no store there, or one MLflow refuses (a plain folder)
            raise ConfigError(
                f"train.loggers: mlflow could not use the tracking store {uri!r}: "
                f"{_first_line(e)}. {_FIX}") from e

    def _open_run(self, workdir: pathlib.Path, params: dict[str, str], resume: Resume,
                  uri: str) -> None:
        stored = resume.stored("mlflow")
        if stored.get("run_id") and stored.get("tracking_uri") == uri:
            self._run_id = stored["run_id"]
            self._client.update_run(self._run_id, status="RUNNING")
            self._first_new_step = self._log_params_again(params)
            return
        # First start here, or the store changed (the run id means nothing in another one).
        run = self._client.create_run(_experiment_id(self._client), run_name=workdir.name,
                                      tags={"titanax.workdir": str(workdir.resolve())})
        self._run_id = run.info.run_id
        resume.remember("mlflow", run_id=self._run_id, tracking_uri=uri)
        self._client.log_batch(self._run_id, params=[Param(k, v) for k, v in params.items()])
        self._first_new_step = 0

    def _log_params_again(self, params: dict[str, str]) -> int:
        """A resume's config against the run's parameters, which MLflow never changes: new
        fields are logged, a changed value (train.steps, the execution section) goes to the
        tag changed.<field>. Returns the first step the run has not logged yet."""
        run = self._client.get_run(self._run_id)
        old = run.data.params
        self._client.log_batch(
            self._run_id, params=[Param(k, v) for k, v in params.items() if k not in old],
            tags=[RunTag(f"changed.{k}", v) for k, v in params.items()
                  if k in old and old[k] != v])
        # MLflow keeps every value logged at a step; a resumed run repeats the steps after its
        # checkpoint (the same losses, bitwise), so those already logged are skipped.
        steps = [m.step for name in run.data.metrics
                 for m in self._client.get_metric_history(self._run_id, name)]
        return max(steps) + 1 if steps else 0

    def log(self, step: int, values: dict) -> None:
        if step < self._first_new_step:
            return
        stamp = int(values.get("time", time.time()) * 1000)  # the row's own time, in ms
        self._client.log_batch(self._run_id, metrics=[
            Metric(k, float(v), stamp, int(step)) for k, v in scalars(values).items()])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__


def _experiment_id(client: MlflowClient) -> str:
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "titanax"
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def _params(config: dict) -> dict[str, str]:
    """The config as MLflow parameters: strings, lists and dicts as JSON, cut to MLflow's
    length limit."""
    out = {}
    for k, v in flat_config(config).items():
        text = v if isinstance(v, str) else json.dumps(v)
        out[k] = text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 3] + "..."
    return out
