"""Review of the adapters against their real backends: names and steps a backend would lose or merge silently.

Each backend is the real one (wandb offline read back from its ``.wandb`` file, TensorBoard read back with
``EventAccumulator``, MLflow on sqlite read back with ``MlflowClient``), driven through a real ``Delivery``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import wandb
from backend_env import isolate_env, read_wandb_history, read_wandb_records_now, wandb_history_of
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl
from metricbus.adapters.mlflow import MlflowAdapter
from metricbus.adapters.tensorboard import RUN_TEXT_TAG, TensorBoardAdapter
from metricbus.adapters.wandb import WandbAdapter
from tb_reader import legacy_accumulator, tensor_points

from metricbus import MetricBus
from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.delivery import Delivery
from metricbus.errors import MetricBusWarning
from metricbus.journal import CursorStore
from metricbus.replay import sync
from metricbus.testing import MemoryAdapter

ROOT = Path(__file__).resolve().parents[1]
MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """HOME, WANDB_DIR, XDG_CONFIG_HOME inside tmp_path, offline, no MLflow settings; wandb torn down around it."""
    for name in MLFLOW_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    wandb.teardown()
    root = isolate_env(monkeypatch, tmp_path)
    yield root
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


def _deliver(adapter: Adapter, steps: list[tuple[int, Mapping[str, float]]]) -> tuple[Delivery, MemoryAdapter]:
    """Deliver ``steps`` to ``adapter`` and a MemoryAdapter next to it through a real Delivery, then close it."""
    mem = MemoryAdapter()
    delivery = Delivery([adapter, mem], strict=False)
    delivery.open(run=RunInfo(project="review", id="20261205-120000-abcdef"))
    for step, metrics in steps:
        delivery.submit(step=step, metrics=metrics)
    assert delivery.flush(timeout_s=120)
    delivery.close(status="finished", timeout_s=120)
    return delivery, mem


def _wandb_rows(adapter: WandbAdapter) -> list[dict[str, Any]]:
    identity = adapter.identity
    assert identity is not None
    return read_wandb_history(Path(identity["dir"]))


# -- wandb ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["_step", "_runtime", "_timestamp"])
def test_wandb_refuses_a_metric_named_like_its_own_history_keys(name: str) -> None:
    """A metric named _step/_runtime/_timestamp would be dropped or overwritten by wandb: refused, naming it; the
    step's other metrics are delivered (no gap)."""
    adapter = WandbAdapter(mode="offline", project="review")
    delivery, _ = _deliver(adapter, [(0, {"loss": 1.0}), (1, {name: 123.0, "loss": 2.0}), (2, {"loss": 3.0})])
    assert delivery.gaps == []
    (refused,) = delivery.refused
    assert (refused.adapter, refused.step, refused.metric) == ("wandb", 1, name)
    assert f"metric name {name!r} maps to wandb name {name!r}, which wandb keeps for" in refused.reason
    assert "rename the metric" in refused.reason
    rows = _wandb_rows(adapter)
    assert [(row["_step"], row["loss"]) for row in rows] == [(0, 1), (1, 2), (2, 3)]


def test_wandb_refuses_a_negative_step() -> None:
    """wandb drops a row at a negative step without an error; the adapter reports it as a gap instead."""
    adapter = WandbAdapter(mode="offline", project="review")
    delivery, mem = _deliver(adapter, [(-2, {"loss": 1.0}), (-1, {"loss": 2.0}), (0, {"loss": 3.0})])
    assert [(gap.adapter, gap.step) for gap in delivery.gaps] == [("wandb", -2), ("wandb", -1)]
    assert "wandb keeps only steps >= 0" in delivery.gaps[0].reason
    assert [(row["_step"], row["loss"]) for row in _wandb_rows(adapter)] == [(0, 3)]
    assert [step for step, _ in mem.rows] == [-2, -1, 0]


def test_wandb_resume_writes_an_underscore_metric_once(tmp_path: Path) -> None:
    """After a resume, a metric whose name starts with '_' (not one of wandb's own keys) that an earlier folder
    holds with the same value is not logged again, like every other metric."""
    run = RunInfo(id="20261205-120000-abcdef")
    first = WandbAdapter(mode="offline", project="review")
    first.open(run=run)
    for step in range(3):
        first.write(step=step, metrics={"_private": step + 0.5, "loss": step + 0.25})
    first.close(status="failed")
    second = WandbAdapter(mode="offline", project="review")
    second.resume(after_step=0, identity=first.identity)
    second.open(run=run)
    for step in range(1, 4):
        second.write(step=step, metrics={"_private": step + 0.5, "loss": step + 0.25})
    second.close(status="finished")
    assert [(row["_step"], row["_private"], row["loss"]) for row in _wandb_rows(second)] == [(3, 3.5, 3.25)]


# -- TensorBoard ---------------------------------------------------------------------------------------------------


def test_tensorboard_refuses_a_metric_under_the_run_text_tag(tmp_path: Path) -> None:
    """A metric named like the run's text tag would be read as text, not as scalars: refused, naming it; the step's
    other metrics are delivered (no gap)."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    delivery, _ = _deliver(adapter, [(0, {"loss": 1.0}), (1, {RUN_TEXT_TAG: 5.0, "loss": 2.0}), (2, {"loss": 3.0})])
    assert delivery.gaps == []
    (refused,) = delivery.refused
    assert (refused.adapter, refused.step, refused.metric) == ("tensorboard", 1, RUN_TEXT_TAG)
    assert "which TensorBoard keeps for the run's text summary" in refused.reason
    acc = legacy_accumulator(tmp_path / "tb")
    assert tensor_points(acc, "loss") == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert acc.SummaryMetadata(RUN_TEXT_TAG).plugin_data.plugin_name == "text"
    assert len(acc.Tensors(RUN_TEXT_TAG)) == 1  # the run text alone


# -- MLflow --------------------------------------------------------------------------------------------------------


def test_mlflow_histogram_quantile_and_a_metric_of_that_name_do_not_merge(
    sqlite_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hist ``x`` (logged as ``x/p50``, ...) next to a metric ``x/p50``: the metric is refused naming both (the
    hist's parts and the step's other metrics are logged), never one series."""
    from mlflow.tracking import MlflowClient

    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    bus = MetricBus(adapters=[adapter], dist=None)
    with warnings.catch_warnings(), caplog.at_level(logging.ERROR, logger="metricbus.delivery"):
        warnings.simplefilter("ignore", MetricBusWarning)
        bus.log("x", [1.0, 2.0, 3.0], agg="hist")
        bus.log("x/p50", 7.0)
        bus.commit(step=0)
        bus.log("y", 1.0)
        bus.commit(step=1)
        bus.close()
    (report,) = [r.getMessage() for r in caplog.records if "'mlflow' refuses metric 'x/p50'" in r.getMessage()]
    assert "(first at step 0)" in report
    assert "'x/p50' (written for metric 'x')" in report
    assert "both map to MLflow name 'x/p50'" in report
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert adapter.run_id is not None
    (point,) = client.get_metric_history(adapter.run_id, "x/p50")  # the hist's p50 (within its 1% bound)
    assert point.step == 0
    assert point.value == pytest.approx(2.0, rel=0.02)
    assert [(m.step, m.value) for m in client.get_metric_history(adapter.run_id, "y")] == [(1, 1.0)]
    assert client.get_run(adapter.run_id).info.status == "FAILED"


def test_mlflow_histogram_alone_is_still_logged_as_quantiles(sqlite_uri: str) -> None:
    """The part_of mapping keeps a plain histogram's quantiles as they were, step after step."""
    from mlflow.tracking import MlflowClient

    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    bus = MetricBus(adapters=[adapter], dist=None, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MetricBusWarning)
        for step in range(2):
            bus.log("x", [1.0, 2.0, 3.0], agg="hist")
            bus.commit(step=step)
        bus.close()
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert adapter.run_id is not None
    assert [m.step for m in client.get_metric_history(adapter.run_id, "x/p50")] == [0, 1]


# -- metricbus sync ------------------------------------------------------------------------------------------------


def test_sync_acknowledges_a_wandb_row_only_once_it_is_in_the_run_file(tmp_path: Path) -> None:
    """wandb keeps the last step's row open until a later step: sync's cursor never covers a row not in the file.

    At every acknowledgement (the progress callback runs right after it), a sync killed there must leave every step
    up to the cursor in the ``.wandb`` file; the rows wandb-core had to write are given time to land first.
    """
    journal = tmp_path / "journal"
    bus = MetricBus(dist=None, journal=str(journal))
    for step in range(3):
        bus.log("loss", float(step))
        bus.commit(step=step)
    bus.close()
    adapter = WandbAdapter(mode="offline", project="review")
    store = CursorStore(journal)
    seen: list[tuple[int | None, list[int]]] = []

    def at_acknowledgement(_done: int, _total: int, _sent: int) -> None:
        identity = adapter.identity
        assert identity is not None
        cursor = store.get(adapter)
        in_file: list[int] = []
        deadline = time.monotonic() + 1.0  # wandb-core writes its file every 0.1 s
        while time.monotonic() < deadline:
            in_file = [int(row["_step"]) for row in wandb_history_of(read_wandb_records_now(Path(identity["dir"])))]
            if cursor is None or cursor in in_file:
                break
            time.sleep(0.05)
        seen.append((cursor, in_file))

    assert sync(str(journal), [adapter], flush_every=1, progress=at_acknowledgement) == {"wandb": 3}
    assert seen, "the progress callback never ran"
    for cursor, in_file in seen:
        assert cursor is None or cursor in in_file, f"cursor {cursor} acknowledges a row the file lacks: {in_file}"
    assert store.get(adapter) == 2  # close wrote the last row: every step acknowledged
    assert [row["_step"] for row in _wandb_rows(adapter)] == [0, 1, 2]


@pytest.mark.parametrize("resumed_adapters", [[], ["console"]], ids=["no adapters", "another adapter"])
def test_sync_after_a_rewind_without_the_adapter_sends_the_new_timeline(
    tmp_path: Path, resumed_adapters: list[str]
) -> None:
    """A run resumed from a checkpoint without the jsonl adapter: a later sync gives jsonl the resumed timeline
    (old steps before the checkpoint, the new values from it on), not the stale steps of the abandoned one."""
    journal, out = tmp_path / "journal", tmp_path / "out.jsonl"
    bus = MetricBus(dist=None, journal=str(journal), adapters=[f"jsonl:{out}"])
    for step in range(10):
        bus.log("loss", float(step))
        bus.commit(step=step)
    bus.close()
    assert [step for step, _ in read_jsonl(out)] == list(range(10))
    resumed = MetricBus(dist=None, journal=str(journal), resume=True, adapters=resumed_adapters)
    for step in range(5, 8):
        resumed.log("loss", 100.0 + step)
        resumed.commit(step=step)
    resumed.close()
    sync(str(journal), [JsonlAdapter(path=out)])
    assert [(step, metrics["loss"]) for step, metrics in read_jsonl(out)] == [
        *((step, float(step)) for step in range(5)),
        *((step, 100.0 + step) for step in range(5, 8)),
    ]


# -- delivery ------------------------------------------------------------------------------------------------------


class DownFrom(MemoryAdapter):
    """A backend that is down (connection refused) from step ``down_from`` on; it records its final status."""

    name = "down"

    def __init__(self, down_from: int) -> None:
        super().__init__()
        self.down_from = down_from
        self.closed = threading.Event()

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Refuse the steps from ``down_from`` on."""
        if step >= self.down_from:
            raise ConnectionError(f"backend down at step {step}")
        super().write(step=step, metrics=metrics)

    def close(self, *, status: Status) -> None:
        """Remember the status and tell the test."""
        super().close(status=status)
        self.closed.set()


def test_an_adapter_abandoned_at_close_is_closed_as_failed() -> None:
    """close() ran out of time while the backend was down: its run lacks steps, so it is closed failed."""
    down, mem = DownFrom(3), MemoryAdapter()
    bus = MetricBus(adapters=[down, mem], dist=None)
    for step in range(6):
        bus.log("loss", float(step))
        bus.commit(step=step)
    bus.close(timeout_s=0.5)
    assert down.closed.wait(60), "the abandoned adapter was never closed"
    assert [step for step, _ in down.rows] == [0, 1, 2]
    assert down.status == "failed"
    assert [step for step, _ in mem.rows] == list(range(6))
    assert mem.status == "finished"


def _append_only(path: Path, on: bool) -> bool:
    """Set or clear the file's append-only attribute (root and ext4-like file systems); False where it cannot."""
    chattr = shutil.which("chattr")
    if chattr is None:
        return False
    done = subprocess.run([chattr, "+a" if on else "-a", str(path)], capture_output=True, check=False)
    return done.returncode == 0


def test_a_failed_rewind_writes_nothing_over_the_old_timeline(tmp_path: Path) -> None:
    """A resume from a checkpoint whose rewind fails (the jsonl file cannot be cut): the adapter writes none of the
    new steps after the abandoned ones, is closed failed, and a sync after the fix gives the resumed timeline."""
    journal, out = tmp_path / "journal", tmp_path / "out.jsonl"
    bus = MetricBus(dist=None, journal=str(journal), adapters=[f"jsonl:{out}"])
    for step in range(10):
        bus.log("loss", float(step))
        bus.commit(step=step)
    bus.close()
    if not _append_only(out, True):
        pytest.skip("needs chattr +a (root, a file system with the append-only attribute)")
    try:
        resumed = MetricBus(dist=None, journal=str(journal), resume=True, adapters=[f"jsonl:{out}"])
        for step in range(5, 8):
            resumed.log("loss", 100.0 + step)
            resumed.commit(step=step)
        resumed.close()
        assert [(step, metrics["loss"]) for step, metrics in read_jsonl(out)] == [(s, float(s)) for s in range(10)]
    finally:
        _append_only(out, False)
    sync(str(journal), [JsonlAdapter(path=out)])
    assert [(step, metrics["loss"]) for step, metrics in read_jsonl(out)] == [
        *((step, float(step)) for step in range(5)),
        *((step, 100.0 + step) for step in range(5, 8)),
    ]


# -- jsonl ---------------------------------------------------------------------------------------------------------

FULL_DISK_CHILD = """
import os, resource, signal, sys, time
from metricbus.adapter import RunInfo
from metricbus.adapters.jsonl import JsonlAdapter
from metricbus.delivery import Delivery

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails with EFBIG, as on a full disk
out = sys.argv[1]
delivery = Delivery([JsonlAdapter(path=out)], strict=False, retry_base_s=0.01, retry_cap_s=0.02)
delivery.open(run=RunInfo())
delivery.submit(step=0, metrics={"x": 1.0})
assert delivery.flush(timeout_s=30)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(out) + 30, resource.RLIM_INFINITY))
delivery.submit(step=1, metrics={"x": 2.0, "y" * 50: 3.0})  # its line does not fit: retried while the disk is full
deadline = time.monotonic() + 30
while delivery.failures.get("jsonl", 0) < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
delivery.submit(step=2, metrics={"x": 4.0})
assert delivery.flush(timeout_s=30)
delivery.close(status="finished", timeout_s=30)
print(delivery.failures.get("jsonl", 0))
"""


def test_jsonl_writes_a_step_once_after_the_disk_was_full(tmp_path: Path) -> None:
    """Writes that fail on a full disk and are retried leave each step's line in the file once, whole."""
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(out)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) >= 3  # the line of step 1 failed at least three times
    assert [(step, metrics["x"]) for step, metrics in read_jsonl(out)] == [(0, 1.0), (1, 2.0), (2, 4.0)]
