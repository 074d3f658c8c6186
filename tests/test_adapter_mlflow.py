"""The MLflow adapter, read back with MlflowClient from sqlite and from a real ``mlflow server``."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from backend_env import free_port, isolate_env, start_server, stop_server, wait_http
from metricbus.adapters._names import mlflow_key, mlflow_mapper
from metricbus.adapters.mlflow import MAX_PARAM_VALUE_CHARS, MlflowAdapter

from metricbus.adapter import RunInfo
from metricbus.errors import MetricValueError
from metricbus.registry import make_adapter


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, MLflow telemetry off."""
    return isolate_env(monkeypatch, tmp_path)


@pytest.fixture
def sqlite_uri(tmp_path: Path) -> str:
    """A fresh sqlite tracking database in a folder that does not exist yet."""
    return f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}"


def _series(*, steps: int) -> list[dict[str, float]]:
    return [{"train/loss": 1.0 / (i + 1), "train/acc": i / 7.0, "lr": 0.1 * 0.99**i} for i in range(steps)]


def _run(adapter: MlflowAdapter, rows: list[dict[str, float]], *, status: Any = "finished", config: Any = None) -> str:
    adapter.open(run=RunInfo(project="proj", name="run-a", tags=("baseline",), config=config or {"lr": 0.1}))
    for step, metrics in enumerate(rows):
        adapter.write(step=step * 10, metrics=metrics)
    adapter.flush()
    adapter.close(status=status)
    assert adapter.run_id is not None
    return adapter.run_id


def _assert_history(client: Any, run_id: str, rows: list[dict[str, float]]) -> None:
    for key in rows[0]:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(i * 10, row[key]) for i, row in enumerate(rows)]


def test_sqlite_history_matches_every_point(sqlite_uri: str) -> None:
    """Every (step, value) written comes back from get_metric_history, exactly."""
    from mlflow.tracking import MlflowClient

    rows = _series(steps=50)
    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), rows)
    client = MlflowClient(tracking_uri=sqlite_uri)
    _assert_history(client, run_id, rows)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run-a"
    assert run.data.tags["baseline"] == "true"
    assert run.data.params == {"lr": "0.1"}
    assert client.get_experiment(run.info.experiment_id).name == "proj"


def test_failed_close_marks_run_failed(sqlite_uri: str) -> None:
    """close(status="failed") ends the MLflow run as FAILED."""
    from mlflow.tracking import MlflowClient

    adapter = MlflowAdapter(tracking_uri=sqlite_uri, experiment="exp", run_name="x")
    run_id = _run(adapter, _series(steps=2), status="failed")
    run = MlflowClient(tracking_uri=sqlite_uri).get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.info.run_name == "x"


def test_config_flattened_truncated_and_batched(sqlite_uri: str) -> None:
    """250 nested params (more than one 100-param batch) are logged; long values are cut to 6000 chars."""
    from mlflow.tracking import MlflowClient

    config = {"group": {f"k{i}": i for i in range(249)}, "long": "x" * 10_000}
    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), _series(steps=1), config=config)
    params = MlflowClient(tracking_uri=sqlite_uri).get_run(run_id).data.params
    assert len(params) == 250
    assert params["group.k17"] == "17"
    assert params["long"] == "x" * MAX_PARAM_VALUE_CHARS


def test_non_finite_values_are_stored(sqlite_uri: str) -> None:
    """NaN stays NaN; sqlite stores infinities as the largest finite double (MLflow's documented behaviour)."""
    from mlflow.tracking import MlflowClient

    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), [{"a": math.nan, "b": math.inf}])
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert math.isnan(client.get_metric_history(run_id, "a")[0].value)
    assert client.get_metric_history(run_id, "b")[0].value >= sys.float_info.max


def test_names_are_mapped_to_valid_keys(sqlite_uri: str) -> None:
    """Names MLflow rejects are logged under a mapped key instead of failing the batch."""
    from mlflow.tracking import MlflowClient

    rows = [{"loss@val": 1.0, "a//b/": 2.0, "../up": 3.0, "z" * 300: 4.0}]
    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), rows)
    metrics = MlflowClient(tracking_uri=sqlite_uri).get_run(run_id).data.metrics
    assert metrics == {"loss_val": 1.0, "a/b": 2.0, "__/up": 3.0, "z" * 250: 4.0}


def test_mlflow_key_rules() -> None:
    """The mapping keeps valid keys and repairs the invalid ones."""
    assert mlflow_key("train/loss: ep 1.5-x_y") == "train/loss: ep 1.5-x_y"
    assert mlflow_key("/a//b/") == "a/b"
    assert mlflow_key("a/../b") == "a/__/b"
    assert mlflow_key("é") == "_"
    assert len(mlflow_key("a" * 1000)) == 250


def test_colliding_names_raise_naming_both(sqlite_uri: str) -> None:
    """Two names that map to one MLflow key raise MetricValueError the first time they meet."""
    mapper = mlflow_mapper()
    assert mapper("a/b") == "a/b"
    with pytest.raises(MetricValueError, match=r"'a/b' and 'a//b'"):
        mapper("a//b")
    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    adapter.open(run=RunInfo())
    adapter.write(step=0, metrics={"x y": 1.0})
    with pytest.raises(MetricValueError, match=r"'x@y'.*'x_y'|'x_y'.*'x@y'"):
        adapter.write(step=1, metrics={"x_y": 1.0, "x@y": 2.0})
    adapter.close(status="failed")


def test_uri_spec_sets_tracking_uri(sqlite_uri: str) -> None:
    """``mlflow:<tracking uri>`` keeps the whole URI, colons included."""
    adapter = make_adapter(f"mlflow:{sqlite_uri}")
    assert isinstance(adapter, MlflowAdapter)
    assert adapter.tracking_uri == sqlite_uri


@pytest.mark.slow
def test_mlflow_server_round_trip(tmp_path: Path) -> None:
    """A real ``mlflow server`` receives every point; the same client reads them back over HTTP."""
    from mlflow.tracking import MlflowClient

    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    assert exe is not None
    port = free_port()
    store = f"sqlite:///{tmp_path / 'server.db'}"
    args = [exe, "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    args += ["--default-artifact-root", str(tmp_path / "artifacts")]
    proc = start_server(args, log=tmp_path / "mlflow-server.log")
    try:
        uri = f"http://127.0.0.1:{port}"
        wait_http(f"{uri}/health", proc=proc, timeout_s=90)
        rows = _series(steps=30)
        run_id = _run(MlflowAdapter(tracking_uri=uri), rows, status="failed")
        client = MlflowClient(tracking_uri=uri)
        _assert_history(client, run_id, rows)
        assert client.get_run(run_id).info.status == "FAILED"
    finally:
        stop_server(proc)
