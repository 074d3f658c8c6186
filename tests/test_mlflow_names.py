"""Which metric name owns an MLflow key two names map to (``x@y`` and ``x_y``) survives a new process reopening the
run: real MLflow (sqlite), the first process a subprocess of its own, read back with MlflowClient."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from backend_env import isolate_env

from metricbus.adapter import RunInfo
from metricbus.errors import MetricBusWarning, RejectedMetricsError
from metricbus.histogram import Histogram

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "names-run"
# the first process: open the run of RUN_ID, write each step, then die without closing it (a killed trainer)
FIRST = """
import json, os, sys, warnings
from metricbus.adapter import RunInfo
from metricbus.adapters.mlflow import MlflowAdapter
from metricbus.histogram import Histogram
warnings.simplefilter("ignore")
uri, run_id, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
adapter = MlflowAdapter(tracking_uri=uri)
adapter.open(run=RunInfo(id=run_id))
for step, metrics in enumerate(steps):
    adapter.write(step=step, metrics={k: Histogram(**v) if isinstance(v, dict) else v for k, v in metrics.items()})
os._exit(0)
"""
HIST = {"count": 3.0, "edges": (0.0, 1.0), "counts": (3,), "quantiles": (("p50", 0.5), ("p90", 0.9))}


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, telemetry off, no MLflow settings from the caller's environment."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


def first_process(uri: str, steps: list[dict[str, Any]]) -> None:
    """Write ``steps`` into the run of RUN_ID from a process of its own, which dies without closing the run."""
    done = subprocess.run(
        [sys.executable, "-c", FIRST, uri, RUN_ID, json.dumps(steps)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr


def reopened(uri: str) -> Any:
    """The adapter of a second process (a resumed trainer, a sync): it finds the run of RUN_ID by its tag."""
    from metricbus.adapters.mlflow import MlflowAdapter

    adapter = MlflowAdapter(tracking_uri=uri)
    adapter.resume(after_step=None)
    adapter.open(run=RunInfo(id=RUN_ID))
    return adapter


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of MLflow key ``key`` in the run, by step."""
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def test_a_renamed_name_keeps_its_key_when_the_other_name_comes_first_in_the_next_process(sqlite_uri: str) -> None:
    """Process 1 wrote x@y (key x_y); process 2 logs x_y first: x_y is refused, x@y goes on in its series."""
    first_process(sqlite_uri, [{"x@y": 1.0, "loss": 1.0}])
    adapter = reopened(sqlite_uri)
    with pytest.raises(RejectedMetricsError, match=r"'x@y' and 'x_y' both map to MLflow name 'x_y'"):
        adapter.write(step=1, metrics={"x_y": 20.0, "loss": 2.0})
    adapter.write(step=2, metrics={"x@y": 3.0, "loss": 3.0})
    adapter.close(status="finished")
    assert history(sqlite_uri, adapter.run_id, "x_y") == [(0, 1.0), (2, 3.0)]
    assert history(sqlite_uri, adapter.run_id, "loss") == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_a_name_equal_to_its_key_keeps_it_when_a_renamed_one_comes_first_in_the_next_process(sqlite_uri: str) -> None:
    """Process 1 wrote x_y; process 2 logs x@y first: x@y is refused, x_y goes on in its series."""
    first_process(sqlite_uri, [{"x_y": 1.0}])
    adapter = reopened(sqlite_uri)
    with pytest.raises(RejectedMetricsError, match=r"'x_y' and 'x@y' both map to MLflow name 'x_y'"):
        adapter.write(step=1, metrics={"x@y": 20.0, "loss": 2.0})
    adapter.write(step=2, metrics={"x_y": 3.0})
    adapter.close(status="finished")
    assert history(sqlite_uri, adapter.run_id, "x_y") == [(0, 1.0), (2, 3.0)]


def test_a_histograms_quantile_keeps_its_key_in_the_next_process(sqlite_uri: str) -> None:
    """Process 1 wrote histogram x (key x/p50 for its median); process 2's plain metric x/p50 is refused."""
    first_process(sqlite_uri, [{"x": HIST}])
    adapter = reopened(sqlite_uri)
    with pytest.raises(RejectedMetricsError, match=r"'x/p50' \(written for metric 'x'\) and 'x/p50' both map"):
        adapter.write(step=1, metrics={"x/p50": 7.0, "loss": 2.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricBusWarning)
        adapter.write(step=2, metrics={"x": Histogram(**HIST)})  # type: ignore[arg-type]
    adapter.close(status="finished")
    assert history(sqlite_uri, adapter.run_id, "x/p50") == [(0, 0.5), (2, 0.5)]


def test_a_name_too_long_to_record_keeps_its_key_by_its_digest(sqlite_uri: str) -> None:
    """A 9000-character name (recorded by its digest) keeps its key in the next process; the other name is refused."""
    long_name = "@" * 9000
    first_process(sqlite_uri, [{long_name: 1.0}])
    adapter = reopened(sqlite_uri)
    with pytest.raises(RejectedMetricsError, match=r"recorded as sha256:[0-9a-f]{64}\) and '_{250}' both map"):
        adapter.write(step=1, metrics={"_" * 250: 20.0, "loss": 2.0})
    adapter.write(step=2, metrics={long_name: 3.0})
    adapter.close(status="finished")
    assert history(sqlite_uri, adapter.run_id, "_" * 250) == [(0, 1.0), (2, 3.0)]


def test_a_run_without_the_owner_record_leaves_a_held_key_to_the_first_name(sqlite_uri: str) -> None:
    """A run an older metricbus wrote (no metricbus.names tag): a renamed name may still continue its series."""
    from metricbus.adapters.mlflow import RUN_ID_TAG
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_uri)
    run = client.create_run(client.create_experiment("default-old"), tags={RUN_ID_TAG: RUN_ID})
    client.log_metric(run.info.run_id, "x_y", 1.0, step=0)  # written for x@y: the old run cannot say
    from metricbus.adapters.mlflow import MlflowAdapter

    adapter = MlflowAdapter(tracking_uri=sqlite_uri, experiment="default-old")
    adapter.open(run=RunInfo(id=RUN_ID))
    adapter.write(step=1, metrics={"x@y": 2.0})
    adapter.close(status="finished")
    assert history(sqlite_uri, run.info.run_id, "x_y") == [(0, 1.0), (1, 2.0)]


def test_a_histogram_whose_quantile_key_a_metric_holds_leaves_the_steps_others_written(sqlite_uri: str) -> None:
    """Plain x/p50 first, then histogram x: its x/p50 is refused alone (not the whole step, as the warning did)."""
    from metricbus.adapters.mlflow import MlflowAdapter

    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    adapter.open(run=RunInfo())
    adapter.write(step=0, metrics={"x/p50": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricBusWarning)
        with pytest.raises(RejectedMetricsError, match=r"'x/p50' at step 1 \(its other 2 metrics were written\)"):
            adapter.write(step=1, metrics={"x": Histogram(**HIST), "loss": 2.0})  # type: ignore[arg-type]
    adapter.close(status="finished")
    assert history(sqlite_uri, adapter.run_id, "x/p90") == [(1, 0.9)]
    assert history(sqlite_uri, adapter.run_id, "loss") == [(1, 2.0)]
