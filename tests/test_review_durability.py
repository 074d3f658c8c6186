"""Review of delivery durability: a retried step lands once, and a step counts as delivered only once durable.

Real backends and real faults: MLflow on sqlite with a trigger in the database that fails one chunk of a step
(``OperationalError``, which MLflow reports as TEMPORARILY_UNAVAILABLE, a transient error that delivery retries),
and a jsonl file on ``/dev/null``, a device that refuses ``fsync`` (EINVAL), so every flush fails for real.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from backend_env import isolate_env
from metricbus.adapters.jsonl import JsonlAdapter
from metricbus.adapters.mlflow import MlflowAdapter

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.delivery import Delivery
from metricbus.journal import CursorStore
from metricbus.testing import MemoryAdapter

MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")
FAST_RETRY = {"retry_base_s": 0.01, "retry_cap_s": 0.05}
WIDE = 2500  # metrics in one step: MLflow takes at most 1000 per batch, so three batches
FAULT_KEY = "m1700"  # in the second batch


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, MLflow telemetry off, no MLflow settings from the caller's environment."""
    for name in MLFLOW_ENV:
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


@pytest.fixture
def db(sqlite_uri: str) -> Path:
    """The fresh sqlite tracking database of conftest's ``sqlite_uri``, as a path."""
    return Path(sqlite_uri.removeprefix("sqlite:///"))


def _sql(db: Path, statement: str) -> None:
    with sqlite3.connect(db, timeout=60) as connection:
        connection.execute(statement)
    connection.close()


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- MLflow --------------------------------------------------------------------------------------------------------


def test_mlflow_step_over_1000_metrics_retried_after_a_failed_batch_logs_each_point_once(db: Path) -> None:
    """A step of 2500 metrics goes to MLflow in three batches; the second fails (the database refuses one of its
    rows) and the step is retried: every metric then has exactly one point, and the step is acknowledged."""
    from mlflow.tracking import MlflowClient

    # A real fault in the store: inserting FAULT_KEY runs json() on text that is not JSON, an OperationalError.
    _sql(db, f"CREATE TRIGGER fault BEFORE INSERT ON metrics WHEN NEW.key = '{FAULT_KEY}' "
             "BEGIN SELECT json('injected fault: not json'); END")
    uri = f"sqlite:///{db}"
    adapter, mem = MlflowAdapter(tracking_uri=uri), MemoryAdapter()
    delivery = Delivery([adapter, mem], strict=False, **FAST_RETRY)
    delivery.open(run=RunInfo(project="durability"))
    metrics = {f"m{i:04d}": float(i) for i in range(WIDE)}
    delivery.submit(step=0, metrics=metrics)
    _wait(lambda: delivery.failures.get("mlflow", 0) >= 2, "two failed tries of step 0")
    assert delivery.acknowledged["mlflow"] is None  # the step is not delivered while a batch of it is missing
    _sql(db, "DROP TRIGGER fault")  # the store recovers
    delivery.submit(step=1, metrics={"m0000": -1.0})
    assert delivery.flush(timeout_s=120)
    delivery.close(status="finished", timeout_s=120)
    assert delivery.acknowledged["mlflow"] == 1
    assert adapter.run_id is not None
    with sqlite3.connect(db) as connection:
        counts = dict(connection.execute(
            "SELECT key, COUNT(*) FROM metrics WHERE run_uuid = ? AND step = 0 GROUP BY key", (adapter.run_id,)
        ).fetchall())
    connection.close()
    assert {key for key, count in counts.items() if count != 1} == set()
    assert set(counts) == set(metrics)
    client = MlflowClient(tracking_uri=uri)
    for key in ("m0000", "m0999", "m1000", FAULT_KEY, "m1999", "m2000", f"m{WIDE - 1:04d}"):
        points = sorted((m.step, m.value) for m in client.get_metric_history(adapter.run_id, key))
        assert points == [(0, metrics[key]), *([(1, -1.0)] if key == "m0000" else [])], key
    assert client.get_run(adapter.run_id).info.status == "FINISHED"


def test_mlflow_step_rejected_for_good_after_a_batch_landed_is_completed_once_by_sync(db: Path) -> None:
    """The same step, but the trainer dies while a batch is refused: a later adapter (``metricbus sync``) resumed
    from the cursor sends the step again, and each metric still has one point."""
    from mlflow.tracking import MlflowClient

    _sql(db, f"CREATE TRIGGER fault BEFORE INSERT ON metrics WHEN NEW.key = '{FAULT_KEY}' "
             "BEGIN SELECT json('injected fault: not json'); END")
    uri, info = f"sqlite:///{db}", RunInfo(project="durability")
    metrics = {f"m{i:04d}": float(i) for i in range(WIDE)}
    killed = MlflowAdapter(tracking_uri=uri)
    killed.open(run=info)
    killed.write(step=0, metrics={"m0000": 0.5})
    with pytest.raises(Exception, match="malformed JSON"):
        killed.write(step=1, metrics=metrics)
    _sql(db, "DROP TRIGGER fault")
    synced = MlflowAdapter(tracking_uri=uri)
    synced.resume(after_step=0, identity=killed.identity)
    synced.open(run=info)
    synced.write(step=1, metrics=metrics)
    synced.close(status="finished")
    assert synced.run_id == killed.run_id is not None
    client = MlflowClient(tracking_uri=uri)
    for key in ("m0000", "m0999", FAULT_KEY, f"m{WIDE - 1:04d}"):
        points = sorted((m.step, m.value) for m in client.get_metric_history(synced.run_id, key))
        assert points == [*([(0, 0.5)] if key == "m0000" else []), (1, metrics[key])], key


# -- jsonl ---------------------------------------------------------------------------------------------------------


def test_jsonl_whose_flush_fails_to_the_end_acknowledges_nothing() -> None:
    """Every fsync fails (the file is a device that cannot be synced): no step is durable, so none is acknowledged,
    not even at close (which used to count the last step as delivered after closing the file)."""
    null, mem = JsonlAdapter(path="/dev/null"), MemoryAdapter()
    delivery = Delivery([null, mem], strict=False, **FAST_RETRY)
    delivery.open(run=RunInfo())
    for step in range(5):
        delivery.submit(step=step, metrics={"x": float(step)})
    delivery.close(status="finished", timeout_s=60)
    assert delivery.acknowledged == {"jsonl": None, "memory": 4}
    assert delivery.failures.get("jsonl", 0) >= 1


def test_jsonl_cursor_stays_below_steps_never_fsynced_so_sync_sends_them(tmp_path: Path) -> None:
    """Through a bus with a journal: the jsonl cursor stays below every step whose fsync failed, so ``metricbus
    sync`` still owes those steps; the other adapter's cursor reaches the last step."""
    journal = tmp_path / "journal"
    bus = MetricBus(dist=None, journal=str(journal), adapters=["jsonl:/dev/null", f"jsonl:{tmp_path / 'ok.jsonl'}"])
    for step in range(5):
        bus.log("loss", float(step))
        bus.commit(step=step)
    bus.close()
    store = CursorStore(journal)
    assert store.get(JsonlAdapter(path="/dev/null")) is None
    assert store.get(JsonlAdapter(path=tmp_path / "ok.jsonl")) == 4


def test_jsonl_refuses_flush_and_close_after_a_failed_fsync() -> None:
    """After an fsync failed, a later flush or close raises too (the kernel may have dropped those lines while
    reporting the failure once), naming the file and saying that ``metricbus sync`` sends the steps again."""
    adapter = JsonlAdapter(path="/dev/null")
    adapter.open(run=RunInfo())
    adapter.write(step=0, metrics={"x": 1.0})
    with pytest.raises(OSError, match="Invalid argument"):
        adapter.flush()
    with pytest.raises(OSError, match=r"/dev/null.*not known to be on disk.*metricbus sync"):
        adapter.flush()
    with pytest.raises(OSError, match=r"/dev/null.*not known to be on disk.*metricbus sync"):
        adapter.close(status="finished")
