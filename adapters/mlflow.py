"""The MLflow adapter: one ``MlflowClient.log_batch`` per step, params from the run config.

The default store is ``sqlite:///runs/metricbus/mlflow.db`` (the file store is in maintenance mode). Metric and
param keys go through the MLflow name rules of :mod:`metricbus.adapters._names`; two names that would merge raise
``MetricValueError``. Config is flattened with ``.`` (``{"opt": {"lr": 0.1}}`` -> ``opt.lr``); values are cut to
6000 characters and logged at most 100 per call. Run tags become MLflow tags with the value ``"true"``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

from metricbus.adapter import RunInfo, Status
from metricbus.errors import AdapterNotFoundError

from ._names import NameMapper, mlflow_mapper

MAX_PARAM_VALUE_CHARS = 6000
MAX_PARAMS_PER_BATCH = 100
_STATUS = {"finished": "FINISHED", "failed": "FAILED"}


def flatten_config(config: Mapping[str, Any], *, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(dotted.key, text)`` for every leaf of a nested mapping."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten_config(value, prefix=f"{path}.")
        elif isinstance(value, str):
            yield path, value
        else:
            try:
                yield path, json.dumps(value)
            except (TypeError, ValueError):
                yield path, repr(value)


class MlflowAdapter:
    """Logs to an MLflow tracking server or database through ``MlflowClient``."""

    name = "mlflow"

    def __init__(
        self,
        *,
        tracking_uri: str = "sqlite:///runs/metricbus/mlflow.db",
        experiment: str | None = None,
        run_name: str | None = None,
    ) -> None:
        self._tracking_uri = tracking_uri
        self._experiment = experiment
        self._run_name = run_name
        self._names: NameMapper = mlflow_mapper()
        self._client: Any = None
        self._metric: Any = None
        self._run_id: str | None = None

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once open."""
        return self._run_id

    @property
    def tracking_uri(self) -> str:
        """Where the run is logged."""
        return self._tracking_uri

    def open(self, *, run: RunInfo) -> None:
        """Get or create the experiment, create the run with tags, log the config as params."""
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise AdapterNotFoundError(
                f"the mlflow adapter needs mlflow: pip install 'metricbus[mlflow]' ({exc})"
            ) from exc
        self._metric = Metric
        self._ensure_sqlite_folder()
        client = MlflowClient(tracking_uri=self._tracking_uri)
        experiment_name = self._experiment or run.project
        experiment = client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
        tags = dict.fromkeys(run.tags, "true")
        tags["metricbus.project"] = run.project
        created = client.create_run(
            experiment_id,
            start_time=run.start_time_unix_ns // 1_000_000,
            tags=tags,
            run_name=self._run_name or run.name,
        )
        self._client, self._run_id = client, created.info.run_id
        param_names = mlflow_mapper()
        params = [
            Param(param_names(key), value[:MAX_PARAM_VALUE_CHARS]) for key, value in flatten_config(run.config)
        ]
        for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
            client.log_batch(self._run_id, params=params[start : start + MAX_PARAMS_PER_BATCH])

    def _ensure_sqlite_folder(self) -> None:
        prefix = "sqlite:///"
        if self._tracking_uri.startswith(prefix):
            from pathlib import Path

            Path(self._tracking_uri[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Log every metric of ``step`` in one batch (the client splits batches over 1000)."""
        if self._client is None:
            raise RuntimeError("MlflowAdapter.write() before open()")
        now_ms = time.time_ns() // 1_000_000
        metric, names, step = self._metric, self._names, int(step)
        batch = [metric(names(key), float(value), now_ms, step) for key, value in metrics.items()]
        self._client.log_batch(self._run_id, metrics=batch)

    def flush(self) -> None:
        """Nothing to do: every batch is sent synchronously."""

    def close(self, *, status: Status) -> None:
        """Mark the run FINISHED or FAILED."""
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id, status=_STATUS[status])
            self._client = None
