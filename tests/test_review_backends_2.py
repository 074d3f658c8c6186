"""Second review of the backends and delivery: each behaviour read back through the backend's own reader."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from backend_env import MlflowServer, isolate_env, poll_until
from review_backends_workers import Flaky, Hung, Picky, picky_rows

from metricbus import MetricBus
from metricbus.errors import AdapterError
from metricbus.journal import CursorStore, read_journal
from metricbus.replay import sync
from tests.identity_trainer import records

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, telemetry off, no MLflow settings from the caller's environment."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


def _history(uri: str, key: str) -> tuple[str, list[tuple[int, float]]]:
    """(status, [(step, value), ...] in MLflow's order) of the one run the server holds."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs: list[Any] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    (run,) = runs
    points = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
    return run.info.status, [(m.step, m.value) for m in points]


@pytest.mark.slow
def test_mlflow_server_down_longer_than_write_timeout_gets_every_step_when_back(
    mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A server down for longer than write_timeout_s is retried, not stopped: every step once, in order, FINISHED."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=mlflow_server.uri).create_experiment("metricbus")  # a warm server: open() is quick
    # MLflow's own retries of a refused connection (here 4, ~14 s; 7, ~4 min by default) outlast write_timeout_s
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "4")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    adapter = {"type": "mlflow", "tracking_uri": mlflow_server.uri, "request_timeout_s": 1}
    bus = MetricBus(dist=None, journal=tmp_path / "journal", adapters=[adapter], write_timeout_s=5.0)
    delivery = bus._sink.delivery
    for step in range(5):
        bus.log("loss", float(step))
        bus.commit(step=step)
    assert bus.flush(timeout_s=60)
    mlflow_server.stop()
    for step in range(5, 10):
        bus.log("loss", float(step))
        bus.commit(step=step)
    # more failed tries of 1 s each than fit in write_timeout_s: a call that long would have been taken for hung
    poll_until(lambda: delivery.failures.get("mlflow", 0) >= 6, timeout_s=180, what="six failed tries")
    mlflow_server.start()
    for step in range(10, 15):
        bus.log("loss", float(step))
        bus.commit(step=step)
    assert bus.flush(timeout_s=300)
    assert delivery.failed == []
    assert delivery.released == {}
    bus.close(timeout_s=60)
    assert _history(mlflow_server.uri, "loss") == ("FINISHED", [(s, float(s)) for s in range(15)])


def test_sync_sends_the_steps_after_one_the_backend_rejects_for_good(tmp_path: Path) -> None:
    """A step the backend rejects in sync is a gap; the steps after it are sent, the run closed failed, sync raises."""
    journal = tmp_path / "journal"
    with MetricBus(dist=None, journal=journal) as bus:
        for step in range(8):
            bus.log("x", float(step))
            bus.commit(step=step)
    picky = Picky(str(tmp_path / "picky.jsonl"))
    with pytest.raises(AdapterError, match=r"adapter 'picky' rejected step 3 for good \(ValueError: picky rejects"):
        sync(journal, [picky])
    rows = picky_rows(tmp_path / "picky.jsonl")
    assert rows == [*([s, {"x": float(s)}] for s in (0, 1, 2, 4, 5, 6, 7)), ["closed", "failed"]]
    store = CursorStore(journal)
    assert (store.get(picky), store.gaps(picky)) == (7, {3})
    picky.bad = -1  # the cause fixed: the next sync sends the gap, and only it
    assert sync(journal, [picky]) == {"picky": 1}
    assert picky_rows(tmp_path / "picky.jsonl")[len(rows) :] == [[3, {"x": 3.0}], ["closed", "finished"]]
    assert store.gaps(picky) == set()


def test_sync_after_a_crash_is_not_stopped_by_a_step_rejected_live(tmp_path: Path) -> None:
    """A trainer killed after a live rejection: sync retries the gap and still sends every step the cursor lacks."""
    workers = Path(__file__).with_name("review_backends_workers.py")
    args = [sys.executable, str(workers), "picky", str(tmp_path)]
    done = subprocess.run(args, check=False, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    picky = Picky(str(tmp_path / "picky.jsonl"))
    store = CursorStore(tmp_path / "journal")
    assert (store.get(picky), store.gaps(picky)) == (5, {3})
    live = len(picky_rows(tmp_path / "picky.jsonl"))
    with pytest.raises(AdapterError, match="rejected step 3 for good"):
        sync(tmp_path / "journal", [picky])
    rows = picky_rows(tmp_path / "picky.jsonl")
    steps = [row[0] for row in rows if row[0] != "closed"]
    assert sorted(steps) == [0, 1, 2, 4, 5, 6, 7, 8, 9], steps  # each once
    assert rows[-1] == ["closed", "failed"]
    assert live <= 6
    assert (store.get(picky), store.gaps(picky)) == (9, {3})


def test_sync_tries_a_transiently_failing_write_again(tmp_path: Path) -> None:
    """A write that fails with a transient error is tried again by sync (as live), not the end of that backend."""
    journal = tmp_path / "journal"
    with MetricBus(dist=None, journal=journal) as bus:
        for step in range(5):
            bus.log("x", float(step))
            bus.commit(step=step)
    flaky = Flaky()
    assert sync(journal, [flaky]) == {"flaky": 5}
    assert (flaky.steps, flaky.closed) == ([0, 1, 2, 3, 4], "finished")


def test_mlflow_write_that_outlived_its_wait_is_retried_once_per_point(tmp_path: Path) -> None:
    """A wide step whose requests outlive request_timeout_s, retried until write returns: each point logged once."""
    from metricbus.adapters.mlflow import MlflowAdapter
    from mlflow.tracking import MlflowClient

    from metricbus.adapter import RunInfo

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    adapter = MlflowAdapter(tracking_uri=uri)
    adapter.open(run=RunInfo())  # its requests, too, wait at most request_timeout_s
    adapter._request_timeout_s = 1e-9  # every write's request outlives its wait
    timeouts = 0
    for step in range(2):
        metrics = {f"m{i:04d}": float(i + step) for i in range(2500)}
        while True:
            try:
                adapter.write(step=step, metrics=metrics)
                break
            except TimeoutError:
                timeouts += 1
    with pytest.raises(TimeoutError, match="did not answer the request to mark run"):
        adapter.close(status="finished")  # its request, too, outlives the wait: it goes on
    assert timeouts > 0
    client = MlflowClient(tracking_uri=uri)
    poll_until(lambda: client.get_run(adapter.run_id).info.status == "FINISHED", what="the run marked FINISHED")
    for key in ("m0000", "m0999", "m1000", "m2499"):
        points = [(m.step, m.value) for m in client.get_metric_history(adapter.run_id, key)]
        assert sorted(points) == [(0, float(key[1:])), (1, float(key[1:]) + 1)]


def test_a_hung_adapter_returning_after_close_and_sync_leaves_their_cursor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """close() gives up on a hung write and says so; sync delivers; the write returning later moves no cursor back."""
    journal = tmp_path / "journal"
    hung = Hung(hang_at=2)
    bus = MetricBus(dist=None, journal=journal, adapters=[hung])
    for step in range(10):
        bus.log("x", float(step))
        bus.commit(step=step)
    with caplog.at_level(logging.ERROR, logger="metricbus.delivery"):
        bus.close(timeout_s=0.5)
    assert any("'hung' did not drain" in r.getMessage() and "metricbus sync" in r.getMessage() for r in caplog.records)
    again = Hung(hang_at=2)
    again.release.set()
    assert sync(journal, [again]) == {"hung": 10}
    hung.release.set()  # the stuck write returns: its thread flushes, closes the adapter and acknowledges step 2
    poll_until(lambda: not any(t.name == "metricbus-hung" for t in threading.enumerate()), what="the thread ended")
    assert hung.closed == "failed"
    assert CursorStore(journal).get(again) == 9
    last = Hung(hang_at=2)
    last.release.set()
    assert sync(journal, [last]) == {"hung": 0}


@pytest.mark.slow
def test_a_sync_sigkilled_midway_then_synced_again_holds_each_step_once_everywhere(tmp_path: Path) -> None:
    """SIGKILL `metricbus sync` after its first acknowledgement, sync again: TensorBoard, jsonl, MLflow and wandb,
    read back with their own readers, hold every step once, bit for bit, in one run; a third sync sends nothing."""
    from test_run_identity import _check_backends, _expected, _settled, _sync

    steps = 1500
    config = {
        "adapters": ["tensorboard", "jsonl", {"type": "mlflow", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
                     {"type": "wandb", "mode": "offline", "dir": str(tmp_path)}],
        "journal": str(tmp_path / "journal"),
    }
    (tmp_path / "c.json").write_text(json.dumps(config))
    with MetricBus(dist=None, journal=tmp_path / "journal", run={"project": "ident", "config": {"lr": 0.5}}) as bus:
        for step in range(steps):
            for name, values in records(step, 1.0).items():
                for value in values:
                    bus.log(name, value)
            bus.commit(step)
    args = [sys.executable, "-m", "metricbus", "sync", str(tmp_path / "journal"), "--config", str(tmp_path / "c.json")]
    child = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    store = CursorStore(tmp_path / "journal")
    cursors = tmp_path / "journal" / "cursors"
    poll_until(lambda: any(store._record_at(p).get("step") is not None for p in cursors.glob("*.json")),
               timeout_s=120, what="a first acknowledgement")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL  # killed before the end of the 1500 steps
    _settled(tmp_path / "wandb")  # the killed sync's wandb-core writes out what it had, then stops
    _sync(tmp_path)
    journal = read_journal(tmp_path / "journal")
    expected = _expected([(range(steps), 1.0)])
    _check_backends(tmp_path, expected, run_id=journal.run.id)
    assert "sent 0 steps" in _sync(tmp_path)


def test_mlflow_opens_with_config_keys_that_give_one_param(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A nested and a dotted config key (or 'a?b' and 'a_b') give one param: the first value, a warning, no failure."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = {"optim": {"lr": 0.1}, "optim.lr": 0.2, "a?b": 1, "a_b": 2, "seed": 7}
    with caplog.at_level(logging.WARNING, logger="metricbus.adapters.mlflow"):
        bus = MetricBus(dist=None, adapters=[{"type": "mlflow", "tracking_uri": uri}], run={"config": config})
        bus.log("x", 1.0)
        bus.commit(step=0)
        bus.close()
    (run,) = MlflowClient(tracking_uri=uri).search_runs(["1"])
    assert run.data.params == {"optim.lr": "0.1", "a_b": "1", "seed": "7"}
    assert run.info.status == "FINISHED"
    assert "'optim.lr' twice; 'a?b' and 'a_b' (both 'a_b')" in caplog.text
