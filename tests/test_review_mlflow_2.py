"""Second review of the MLflow adapter's requests sent from their own threads: read back with MlflowClient."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
from pathlib import Path

import pytest
from backend_env import MlflowServer, isolate_env, poll_until

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.replay import sync
from tests.test_review_backends_2 import _history


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, telemetry off, no MLflow settings from the caller's environment."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


@pytest.mark.slow
def test_mlflow_retry_of_a_request_the_server_committed_after_the_client_gave_up_logs_the_point_once(
    mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log_batch that failed on the client (read timeout) but that the slow server committed later: one point."""
    from metricbus.adapters.mlflow import MlflowAdapter
    from mlflow.exceptions import MlflowException

    adapter = MlflowAdapter(tracking_uri=mlflow_server.uri, request_timeout_s=60)
    adapter.open(run=RunInfo())
    for step in range(3):
        adapter.write(step=step, metrics={"loss": float(step)})
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")  # the client gives up on a slow answer after 1 s ...
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # ... at once
    lock = sqlite3.connect(mlflow_server.root / "server.db", isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")  # the server's insert waits for this lock (its busy timeout is 5 s or more)
        with pytest.raises(MlflowException, match="timed out"):  # the client's read timeout: the request ended
            adapter.write(step=3, metrics={"loss": 3.0})
    finally:
        lock.execute("ROLLBACK")  # the server's insert of that request goes on now, and commits
        lock.close()
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT")
    adapter.write(step=3, metrics={"loss": 3.0})  # the retry, as delivery or sync makes it
    adapter.write(step=4, metrics={"loss": 4.0})
    adapter.close(status="finished")
    assert _history(mlflow_server.uri, "loss") == ("FINISHED", [(s, float(s)) for s in range(5)])


@pytest.mark.slow
def test_sync_against_a_server_that_stops_answering_ends_instead_of_waiting_out_mlflows_retries(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """A server paused mid-sync: sync ends with TimeoutError while it is still paused; a later sync logs all once."""
    from metricbus.adapters.mlflow import MlflowAdapter

    journal = tmp_path / "journal"
    with MetricBus(dist=None, journal=journal, adapters=[]) as bus:
        for step in range(3):
            bus.log("loss", float(step))
            bus.commit(step=step)
    server = mlflow_server.proc
    assert server is not None

    class PausesTheServerOnceOpen(MlflowAdapter):
        def open(self, *, run: RunInfo) -> None:
            super().open(run=run)  # with time to spare on a busy machine; each paused request then waits 1 s
            self._request_timeout_s = 1.0
            os.killpg(server.pid, signal.SIGSTOP)  # each request now waits (MLflow: 120 s, 7 retries)

    # request threads an earlier test left retrying against its own stopped server are not this sync's
    before = {t for t in threading.enumerate() if t.name == "metricbus-mlflow-request"}
    try:
        with pytest.raises(TimeoutError):  # the writes, then the close's set_terminated, each waited 1 s at most
            sync(journal, [PausesTheServerOnceOpen(tracking_uri=mlflow_server.uri, request_timeout_s=30)])
    finally:
        os.killpg(server.pid, signal.SIGCONT)
    # the first sync's requests end now that the server answers: let them, so its FAILED comes before the next FINISHED
    poll_until(
        lambda: not any(t.name == "metricbus-mlflow-request" and t not in before for t in threading.enumerate()),
        timeout_s=120,
        what="the paused requests ended",
    )
    sync(journal, [MlflowAdapter(tracking_uri=mlflow_server.uri)])
    assert _history(mlflow_server.uri, "loss") == ("FINISHED", [(s, float(s)) for s in range(3)])
