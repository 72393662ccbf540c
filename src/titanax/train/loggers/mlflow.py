"""MLflow (`pip install 'titanax[mlflow]'`, the mlflow-skinny client): one MLflow run per
workdir, in the tracking store $MLFLOW_TRACKING_URI names, experiment $MLFLOW_EXPERIMENT_ID or
$MLFLOW_EXPERIMENT_NAME (default "titanax"). The config is logged as parameters named as --set
names them (train.steps). The run id is stored in WORKDIR/loggers.json on the first start; a
resumed run continues it.

It talks to the store through MlflowClient with the run id in hand, not mlflow.start_run:
the fluent API keeps one active run per process, which a caller's own run would collide with."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

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


class MlflowLogger:
    def start(self, workdir: pathlib.Path, config: dict, resume: Resume) -> None:
        uri, self._failing = mlflow.get_tracking_uri(), False
        try:
            self._client = MlflowClient(uri)
            self._open_run(pathlib.Path(workdir), _params(config), resume, uri)
        except MlflowException as e:  # no store there, or one MLflow refuses (a plain folder)
            raise ConfigError(
                f"train.loggers: mlflow could not use the tracking store {uri!r}: "
                f"{_first_line(e)}. Set MLFLOW_TRACKING_URI to a tracking server "
                "(http://HOST:5000) or a database (sqlite:///PATH, with the full mlflow "
                "package); docs/monitoring.md") from e

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
        self._call(f"step {step}", self._client.log_batch, self._run_id, metrics=[
            Metric(k, float(v), stamp, int(step)) for k, v in scalars(values).items()])

    def close(self) -> None:
        self._call("the run's end", self._client.set_terminated, self._run_id)

    def _call(self, what: str, fn, *args, **kwargs) -> None:
        """A tracking server down for a while must not stop a training run (the client has
        retried by now, and metrics.jsonl holds every row): one line when logging fails, one
        when it works again."""
        try:
            fn(*args, **kwargs)
        except MlflowException as e:
            if not self._failing:
                print(f"titanax: mlflow did not record {what} ({_first_line(e)}); "
                      "metrics.jsonl has it", file=sys.stderr)
            self._failing = True
            return
        if self._failing:
            print(f"titanax: mlflow records again from {what}", file=sys.stderr)
        self._failing = False


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
