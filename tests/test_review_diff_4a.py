"""Review of the fixes since 059c06a: MLflow's request tracking across syncs, refused metric names."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from backend_env import MlflowServer, isolate_env

from metricbus.adapter import RunInfo
from metricbus.replay import sync
from tests.test_review_backends_2 import _history
from tests.test_review_mlflow_sync_2 import HoldingProxy, _journal, held_once_open


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, telemetry off, no MLflow settings from the caller's environment."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


def _on_path(proxy: HoldingProxy, method: str, part: str) -> threading.Event:
    """An event set once the proxy has answered a ``method`` request whose path holds ``part``."""
    seen = threading.Event()
    handler: Any = proxy.server.RequestHandlerClass
    forward: Callable[[Any], None] = getattr(handler, f"do_{method}")

    def answered(self: Any) -> None:
        forward(self)
        if part in self.path:
            seen.set()

    setattr(handler, f"do_{method}", answered)
    return seen


@pytest.mark.slow
def test_a_sync_opening_while_the_earlier_syncs_requests_land_logs_each_step_once(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """Sync 1's log_batch lands while sync 2 waits for it after reading the run: sync 2 reads again, logs it once."""
    from metricbus.adapters.mlflow import MlflowAdapter

    journal = _journal(tmp_path)
    proxy = HoldingProxy(mlflow_server.uri)

    holds_once_open = held_once_open(proxy)

    errors: list[BaseException] = []

    def second_sync() -> None:
        try:
            sync(journal, [MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=120)])
        except BaseException as exc:
            errors.append(exc)

    try:
        with pytest.raises(TimeoutError, match="log_batch of step 0"):
            sync(journal, [holds_once_open(tracking_uri=proxy.uri, request_timeout_s=30)])
        assert proxy.held == 2  # the log_batch of step 0 and the set_terminated(FAILED)
        proxy.hold.clear()
        read = _on_path(proxy, "POST", "runs/search")  # sync 2 found the run (and holds what it read)
        thread = threading.Thread(target=second_sync)
        thread.start()
        assert read.wait(120)
        proxy.release.set()  # sync 1's requests land now, while sync 2 waits for them
        thread.join(300)
        assert not thread.is_alive()
    finally:
        proxy.close()
    assert errors == []
    assert _history(mlflow_server.uri, "loss") == ("FINISHED", [(s, float(s)) for s in range(3)])


def _slow_history(proxy: HoldingProxy, delay_s: float) -> list[str]:
    """Each metric history request the proxy forwards waits ``delay_s`` first; returns the paths it saw."""
    seen: list[str] = []
    handler: Any = proxy.server.RequestHandlerClass
    forward: Callable[[Any], None] = handler.do_GET

    def slowly(self: Any) -> None:
        if "metrics/get-history" in self.path:
            seen.append(self.path)
            threading.Event().wait(delay_s)
        forward(self)

    handler.do_GET = slowly
    return seen


@pytest.mark.slow
def test_reopening_a_run_whose_history_takes_several_requests_bounds_each_request_not_their_sum(
    mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A history read in 6 pages of ~1 s each, request_timeout_s=4: the reopen reads it (each page bounded), once."""
    import mlflow.tracking._tracking_service.client as tracking_client
    from metricbus.adapters import mlflow as adapter_module
    from metricbus.adapters.mlflow import MlflowAdapter

    monkeypatch.setattr(tracking_client, "GET_METRIC_HISTORY_MAX_RESULTS", 10)  # MLflow's page, as for 25,000 points
    monkeypatch.setattr(adapter_module, "HISTORY_PAGE", 10)
    run = RunInfo(project="p")
    first = MlflowAdapter(tracking_uri=mlflow_server.uri)
    first.open(run=run)
    for step in range(60):
        first.write(step=step, metrics={"loss": float(step)})
    first.close(status="failed")
    proxy = HoldingProxy(mlflow_server.uri)
    pages = _slow_history(proxy, 1.0)
    try:
        again = MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=4)
        again.resume(after_step=55, identity=dict(first.identity))  # steps 56..59 written, never acknowledged
        again.open(run=run)
        for step in range(56, 60):
            again.write(step=step, metrics={"loss": float(step)})
        again.close(status="finished")
    finally:
        proxy.close()
    assert len(pages) == 6
    assert _history(mlflow_server.uri, "loss") == ("FINISHED", [(s, float(s)) for s in range(60)])


@pytest.mark.slow
def test_an_open_that_times_out_after_marking_the_run_running_leaves_it_failed_after_close(
    mlflow_server: MlflowServer,
) -> None:
    """open() marked the FAILED run RUNNING, then timed out reading its history: close(failed) marks it FAILED."""
    from metricbus.adapters.mlflow import MlflowAdapter

    run = RunInfo(project="p")
    first = MlflowAdapter(tracking_uri=mlflow_server.uri)
    first.open(run=run)
    for step in range(5):
        first.write(step=step, metrics={"loss": float(step)})
    first.close(status="failed")
    proxy = HoldingProxy(mlflow_server.uri)
    _slow_history(proxy, 3.0)
    try:
        again = MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=1)
        again.resume(after_step=2, identity=dict(first.identity))
        with pytest.raises(TimeoutError, match=r"get_metric_history\(\) within request_timeout_s=1 s"):
            again.open(run=run)
        again.close(status="failed")  # as live delivery and sync do after a failed open
    finally:
        proxy.close()
    assert _history(mlflow_server.uri, "loss") == ("FAILED", [(s, float(s)) for s in range(5)])
