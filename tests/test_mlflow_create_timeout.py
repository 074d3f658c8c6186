"""A ``create_run`` that request_timeout_s gave up on and that lands later: the next open in the process neither
creates a second run beside it nor leaves it an empty RUNNING run. Real ``mlflow server`` behind a proxy that
holds the create request; read back with MlflowClient."""

from __future__ import annotations

from pathlib import Path

import pytest
from backend_env import MlflowServer, isolate_env

from metricbus.adapter import RunInfo
from tests.test_review_mlflow_sync_2 import HoldingProxy


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, telemetry off, no MLflow settings from the caller's environment."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


class CreateHoldingProxy(HoldingProxy):
    """An HTTP proxy to a real server that holds the first ``runs/create`` request until ``release`` is set."""

    def holds(self, command: str, path: str) -> bool:
        return path.endswith("/runs/create") and self.held == 0


@pytest.mark.slow
def test_an_open_after_a_create_run_that_timed_out_waits_for_it_and_adopts_its_run(mlflow_server: MlflowServer) -> None:
    """Open 1's create_run times out; open 2 refuses while it is still held; once it landed, open 3 logs into it."""
    from metricbus.adapters.mlflow import RUN_ID_TAG, MlflowAdapter
    from mlflow.tracking import MlflowClient

    run = RunInfo(id="late-create")
    MlflowClient(tracking_uri=mlflow_server.uri).create_experiment(run.project)  # open's first POST is then its own
    proxy = CreateHoldingProxy(mlflow_server.uri)
    try:
        with pytest.raises(TimeoutError, match=r"create_run\(\)"):
            MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=10).open(run=run)
        assert proxy.held == 1
        with pytest.raises(TimeoutError, match=r"create_run\(\) that an earlier adapter sent"):
            MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=10).open(run=run)
        proxy.release.set()
        assert proxy.forwarded_held.acquire(timeout=120)  # the server created the run
        adapter = MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=30)
        adapter.open(run=run)
        adapter.write(step=0, metrics={"loss": 1.0})
        adapter.close(status="finished")
    finally:
        proxy.close()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name(run.project)
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run.id}'")
    assert [(r.info.run_id, r.info.status) for r in runs] == [(adapter.run_id, "FINISHED")]
    assert [(m.step, m.value) for m in client.get_metric_history(adapter.run_id, "loss")] == [(0, 1.0)]
