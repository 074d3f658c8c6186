"""An adapter's request_timeout_s must be below the bus's write_timeout_s (else its slow requests stop it for good)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import ConfigError

pytest.importorskip("mlflow")


def test_mlflow_request_timeout_not_below_write_timeout_is_refused_before_anything_opens(tmp_path: Path) -> None:
    """request_timeout_s >= write_timeout_s: ConfigError naming both; no journal written, no run created."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    adapter = {"type": "mlflow", "tracking_uri": uri, "request_timeout_s": 30}
    with pytest.raises(ConfigError, match=r"adapters\[0\] \(mlflow\): request_timeout_s=30 s must be below the "
                       r"bus's write_timeout_s=30 s"):
        MetricBus(dist=None, journal=tmp_path / "journal", adapters=[adapter])
    assert not (tmp_path / "journal").exists()
    assert not (tmp_path / "mlflow.db").exists()
    with pytest.raises(ConfigError, match=r"request_timeout_s=10 s must be below the bus's write_timeout_s=2 s"):
        MetricBus(dist=None, adapters=[{**adapter, "request_timeout_s": 10}], write_timeout_s=2)


def test_mlflow_request_timeout_below_write_timeout_builds_and_delivers(sqlite_uri: str) -> None:
    """request_timeout_s below a raised write_timeout_s: the bus builds and the step reaches MLflow."""
    from metricbus.adapters.mlflow import MlflowAdapter
    from mlflow.tracking import MlflowClient

    adapter = MlflowAdapter(tracking_uri=sqlite_uri, request_timeout_s=30)
    assert adapter.request_timeout_s == 30.0
    with MetricBus(dist=None, adapters=[adapter], write_timeout_s=60) as bus:
        bus.log("loss", 0.5)
        bus.commit(step=0)
    assert adapter.run_id is not None
    history = MlflowClient(tracking_uri=sqlite_uri).get_metric_history(adapter.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 0.5)]
