"""Delivery under faults: hung and dying adapters, backends that reject a step for good, SIGTERM, flush().

Real threads, real backends (an MLflow sqlite store, TensorBoard event files) and a real child process for SIGTERM.
No test asserts a duration: a stalled loop is caught by a generous join deadline instead.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from backend_env import isolate_env
from metricbus.adapters.jsonl import read_jsonl

from metricbus import AdapterError, MetricBus
from metricbus.adapter import RunInfo
from metricbus.delivery import Delivery, Gap
from metricbus.errors import MetricValueError
from metricbus.errors_classify import backoff_s, classify
from metricbus.testing import MemoryAdapter

ROOT = Path(__file__).resolve().parents[1]
LOOP_DEADLINE_S = 120.0  # generous: a stalled loop would block for queue_timeout_s (1 hour) per commit


class HungAdapter(MemoryAdapter):
    """A backend whose write() of step ``hang_at`` never returns (until the test releases it)."""

    name = "hung"

    def __init__(self, hang_at: int = 2) -> None:
        super().__init__()
        self.hang_at = hang_at
        self.release = threading.Event()
        self.entered = threading.Event()

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Hang at ``hang_at``."""
        if step == self.hang_at:
            self.entered.set()
            self.release.wait(timeout=LOOP_DEADLINE_S * 2)
        super().write(step=step, metrics=metrics)


class ExitingAdapter(MemoryAdapter):
    """A backend whose write() of step ``exit_at`` raises SystemExit, killing its delivery thread."""

    name = "exiting"

    def __init__(self, exit_at: int) -> None:
        super().__init__()
        self.exit_at = exit_at

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Exit at ``exit_at``."""
        if step == self.exit_at:
            raise SystemExit(3)
        super().write(step=step, metrics=metrics)


@pytest.fixture
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, MLflow telemetry off."""
    return isolate_env(monkeypatch, tmp_path)


def _steps(adapter: MemoryAdapter) -> list[int]:
    return [step for step, _ in adapter.rows]


def _in_thread(fn: Any) -> None:
    """Run ``fn`` in a thread; fail if it has not returned within LOOP_DEADLINE_S (the loop stalled)."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(LOOP_DEADLINE_S)
    assert not thread.is_alive(), f"the training loop stalled (not done after {LOOP_DEADLINE_S} s)"
    if errors:
        raise errors[0]


def _commit(bus: MetricBus, steps: range) -> None:
    for step in steps:
        bus.log("loss", float(step))
        bus.commit(step=step)


# -- a hung backend ------------------------------------------------------------------------------------------------


def test_hung_adapter_does_not_stall_training(caplog: pytest.LogCaptureFixture) -> None:
    """write() never returns: after write_timeout_s the adapter is degraded, commits stop waiting, others get all."""
    hung, mem = HungAdapter(hang_at=2), MemoryAdapter()
    bus = MetricBus(adapters=[hung, mem], dist=None, queue_size=4, queue_policy="block", queue_timeout_s=3600,
                    write_timeout_s=0.5)
    try:
        with caplog.at_level(logging.ERROR, logger="metricbus.delivery"):
            _in_thread(lambda: _commit(bus, range(400)))
            assert hung.entered.is_set()
            assert bus.flush(timeout_s=60)
            assert _steps(mem) == list(range(400))
            assert _steps(hung) == [0, 1]
            bus.close(timeout_s=60)
        assert mem.status == "finished"
        stopped = [r.getMessage() for r in caplog.records if "'hung' degraded" in r.getMessage()]
        assert len(stopped) == 1
        assert "write() ran longer than write_timeout_s=0.5 s" in stopped[0]
    finally:
        hung.release.set()


def test_hung_adapter_is_listed_degraded_and_released() -> None:
    """A Delivery lists the hung adapter as degraded and failed; its queued steps are released, not kept."""
    hung, mem = HungAdapter(hang_at=0), MemoryAdapter()
    delivery = Delivery([hung, mem], strict=False, queue_size=8, queue_timeout_s=3600, write_timeout_s=0.3)
    delivery.open(run=RunInfo())
    try:
        delivery.submit(step=0, metrics={"x": 0.0})
        assert hung.entered.wait(30)
        _in_thread(lambda: [delivery.submit(step=s, metrics={"x": float(s)}) for s in range(1, 200)])
        assert delivery.flush(timeout_s=60)
        assert delivery.degraded == ["hung"]
        assert delivery.failed == ["hung"]
        assert delivery.released["hung"] == 199  # step 0 is the one stuck in write(); none of the rest is held
        assert _steps(mem) == list(range(200))
        delivery.close(status="finished", timeout_s=30)
    finally:
        hung.release.set()
    assert mem.status == "finished"


def test_strict_bus_raises_for_a_hung_adapter() -> None:
    """On a strict bus the hung adapter surfaces as AdapterError at a later commit; the loop still is not stalled."""
    hung = HungAdapter(hang_at=0)
    bus = MetricBus(adapters=[hung], dist=None, strict=True, write_timeout_s=0.3, queue_timeout_s=3600)
    try:
        def loop() -> None:
            with pytest.raises(AdapterError, match="'hung' stopped: write\\(\\) ran longer"):  # noqa: PT012
                for step in range(100_000):
                    bus.log("loss", 1.0)
                    bus.commit(step=step)
                    time.sleep(0.01)

        _in_thread(loop)
    finally:
        hung.release.set()
        bus.close(timeout_s=30)


# -- an adapter thread dying -------------------------------------------------------------------------------------


def test_adapter_thread_dying_of_system_exit(caplog: pytest.LogCaptureFixture) -> None:
    """SystemExit in write() kills that adapter's thread only: it is degraded and closed failed; others get all."""
    dying, mem = ExitingAdapter(exit_at=3), MemoryAdapter()
    delivery = Delivery([dying, mem], strict=False, queue_size=4, queue_timeout_s=3600)
    with caplog.at_level(logging.ERROR, logger="metricbus.delivery"):
        delivery.open(run=RunInfo())
        _in_thread(lambda: [delivery.submit(step=s, metrics={"x": float(s)}) for s in range(100)])
        assert delivery.flush(timeout_s=60)
        delivery.close(status="finished", timeout_s=30)
    assert _steps(mem) == list(range(100))
    assert _steps(dying) == [0, 1, 2]
    assert delivery.degraded == ["exiting"]
    assert dying.status == "failed"
    assert mem.status == "finished"
    assert any("thread died of SystemExit(3)" in r.getMessage() for r in caplog.records)


# -- backends that reject a step for good ------------------------------------------------------------------------


def test_permanent_mlflow_rejection_refuses_the_name_alone(
    isolated_env: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 3 holds two names that map to one MLflow key: the second is refused for good and reported once, the
    step's other metrics and the other 9 steps reach MLflow, no step is a gap, the run FAILED."""
    from metricbus.adapters.mlflow import MlflowAdapter
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{isolated_env / 'db' / 'mlflow.db'}"
    adapter, mem = MlflowAdapter(tracking_uri=uri), MemoryAdapter()
    seen: list[tuple[int, str, int, str]] = []
    delivery = Delivery([adapter, mem], strict=False,
                        on_gap=lambda i, a, step, why: seen.append((i, a.name, step, why)))
    with caplog.at_level(logging.ERROR, logger="metricbus.delivery"):
        delivery.open(run=RunInfo(project="faults"))
        for step in range(10):
            metrics = {"loss": float(step), **({"a//b": 1.0, "a/b": 2.0} if step == 3 else {})}
            delivery.submit(step=step, metrics=metrics)
        assert delivery.flush(timeout_s=120)
        delivery.close(status="finished", timeout_s=120)
    client = MlflowClient(tracking_uri=uri)
    assert adapter.run_id is not None
    history = sorted((m.step, m.value) for m in client.get_metric_history(adapter.run_id, "loss"))
    assert history == [(s, float(s)) for s in range(10)]
    assert [(m.step, m.value) for m in client.get_metric_history(adapter.run_id, "a/b")] == [(3, 1.0)]  # 'a//b'
    assert client.get_run(adapter.run_id).info.status == "FAILED"
    assert _steps(mem) == list(range(10))
    assert delivery.gaps == []
    assert seen == []
    (refused,) = delivery.refused
    assert (refused.adapter, refused.step, refused.metric) == ("mlflow", 3, "a/b")
    assert "metric names 'a//b' and 'a/b' both map to MLflow name 'a/b'" in refused.reason
    reports = [r.getMessage() for r in caplog.records if "'mlflow' refuses metric 'a/b'" in r.getMessage()]
    assert len(reports) == 1


def test_tensorboard_out_of_range_step_is_skipped(isolated_env: Path) -> None:
    """TensorBoard rejects step 2**63 ('Value out of range'): that step is skipped, the steps after it written."""
    from metricbus.adapters.tensorboard import TensorBoardAdapter
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = isolated_env / "tb"
    delivery = Delivery([TensorBoardAdapter(log_dir=log_dir)], strict=False)
    delivery.open(run=RunInfo())
    # Delivery passes steps through unchecked (the bus refuses 2**63 with a StepError): this is the backend's check.
    for step in (0, 1, 2**63, 2**63 - 2, 2**63 - 1):
        delivery.submit(step=step, metrics={"x": 0.5})
    assert delivery.flush(timeout_s=60)
    delivery.close(status="finished", timeout_s=60)
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("x")] == [0, 1, 2**63 - 2, 2**63 - 1]
    (gap,) = delivery.gaps
    assert gap.step == 2**63
    assert "Value out of range" in gap.reason


def test_strict_bus_raises_for_a_gap_and_goes_on() -> None:
    """A strict Delivery keeps a rejected step as AdapterError; the later steps are still written."""

    class Picky(MemoryAdapter):
        name = "picky"

        def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
            if step == 1:
                raise MetricValueError("metric 'x' rejected")
            super().write(step=step, metrics=metrics)

    picky = Picky()
    delivery = Delivery([picky], strict=True)
    delivery.open(run=RunInfo())
    for step in range(4):
        delivery.submit(step=step, metrics={"x": 1.0})
    with pytest.raises(AdapterError, match="'picky' rejected step 1"):
        delivery.close(status="finished", timeout_s=30)
    assert _steps(picky) == [0, 2, 3]
    assert delivery.gaps == [Gap("picky", 1, "x", "MetricValueError: metric 'x' rejected")]
    assert picky.status == "failed"


class _Declared(MemoryAdapter):
    permanent_errors = (KeyError,)


class _HttpError(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ConnectionError("refused"), "transient"),
        (TimeoutError("slow"), "transient"),
        (OSError("disk"), "transient"),
        (_HttpError(500), "transient"),
        (_HttpError(503), "transient"),
        (_HttpError(429), "transient"),
        (_HttpError(408), "transient"),
        (_HttpError(400), "permanent"),
        (_HttpError(404), "permanent"),
        (urllib.error.HTTPError("http://x", 422, "bad", {}, None), "permanent"),  # type: ignore[arg-type]
        (ValueError("Value out of range: 9223372036854775808"), "permanent"),
        (TypeError("not a float"), "permanent"),
        (RuntimeError("who knows"), "transient"),
    ],
)
def test_classification_table(exc: Exception, kind: str) -> None:
    """Connection errors, timeouts, 5xx, 408 and 429 are retried; other 4xx and conversion errors are not."""
    assert classify(exc) == kind


def test_mlflow_error_codes_are_classified() -> None:
    """MlflowException: INVALID_PARAMETER_VALUE is permanent; INTERNAL_ERROR, REQUEST_LIMIT_EXCEEDED are not."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, INVALID_PARAMETER_VALUE, REQUEST_LIMIT_EXCEEDED

    assert classify(MlflowException("bad name", INVALID_PARAMETER_VALUE)) == "permanent"
    assert classify(MlflowException("db", INTERNAL_ERROR)) == "transient"
    assert classify(MlflowException("slow down", REQUEST_LIMIT_EXCEEDED)) == "transient"


def test_adapter_declares_its_permanent_errors() -> None:
    """An adapter's ``permanent_errors`` types are skipped, not retried."""
    from metricbus.errors_classify import permanent_errors_of

    assert classify(KeyError("k"), permanent=permanent_errors_of(_Declared())) == "permanent"
    assert classify(KeyError("k")) == "transient"


# -- flush() -----------------------------------------------------------------------------------------------------


class SlowAdapter(MemoryAdapter):
    """10 ms per write."""

    name = "slow"

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Sleep, then keep the step."""
        time.sleep(0.01)
        super().write(step=step, metrics=metrics)


def test_flush_makes_memory_adapter_complete() -> None:
    """After bus.flush() returns True every committed step is in MemoryAdapter.rows, flushed; the bus stays open."""
    slow, mem = SlowAdapter(), MemoryAdapter()
    bus = MetricBus(adapters=[slow, mem], dist=None)
    _commit(bus, range(30))
    assert bus.flush(timeout_s=60)
    assert _steps(slow) == _steps(mem) == list(range(30))
    assert slow.flushes >= 1
    _commit(bus, range(30, 35))
    assert bus.flush(timeout_s=60)
    assert _steps(slow) == list(range(35))
    bus.close()


def test_flush_times_out_on_a_busy_adapter() -> None:
    """flush() returns False when an adapter has not caught up within timeout_s (its call is not yet overdue)."""
    hung = HungAdapter(hang_at=0)
    bus = MetricBus(adapters=[hung], dist=None, write_timeout_s=3600)
    try:
        _commit(bus, range(3))
        assert hung.entered.wait(30)
        assert not bus.flush(timeout_s=0.2)
        hung.release.set()
        assert bus.flush(timeout_s=60)
        assert _steps(hung) == [0, 1, 2]
    finally:
        hung.release.set()
        bus.close()


# -- SIGTERM -----------------------------------------------------------------------------------------------------

TRAIN = """
import signal, sys, time
from metricbus import MetricBus
if sys.argv[3] == "chain":
    def previous(signum, frame):
        print("previous handler", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, previous)
bus = MetricBus(dist=None, adapters=["jsonl:" + sys.argv[1]], journal=sys.argv[2])
step = 0
while True:
    for i in range(200 if sys.argv[3] == "busy" else 1):  # busy: the signal lands inside metricbus calls
        bus.log("loss", float(step))
        bus.log({"a": 1.0, "b": 2.0})
    bus.commit(step=step)
    print(step, flush=True)
    step += 1
    if sys.argv[3] != "busy":
        time.sleep(0.002)
"""


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Any]:
    """Start the training loop in a child and stop it with SIGTERM once it committed 30 steps."""
    procs: list[subprocess.Popen[str]] = []

    def start(mode: str) -> tuple[subprocess.Popen[str], int, str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", TRAIN, str(tmp_path / "m.jsonl"), str(tmp_path / "journal"), mode],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        last = -1
        while last < 30:
            line = proc.stdout.readline()
            assert line, f"child ended early: {proc.wait(60)} {proc.stderr.read() if proc.stderr else ''}"
            last = int(line)
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
        printed = [int(x) for x in rest.split() if x.isdigit()]
        return proc, max([last, *printed]), rest + err

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_delivers_every_committed_step(child: Any, tmp_path: Path) -> None:
    """SIGTERM mid-loop: exit status -SIGTERM, every committed step in the jsonl and the journal."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    proc, last, output = child("default")
    assert proc.returncode == -signal.SIGTERM, output
    lines = [step for step, _ in read_jsonl(tmp_path / "m.jsonl")]
    assert lines == list(range(len(lines)))
    # Every committed step (the journal has each before commit() returns) reached the jsonl. (The count printed
    # by the child is only a lower bound: lines it printed into the pipe's reader buffer before the signal are not
    # seen by communicate(), which reads the file descriptor.)
    assert len(lines) >= last + 1, (last, len(lines))
    assert [step for step, _ in emitted(read_journal(tmp_path / "journal"))] == lines


def test_sigterm_while_the_loop_is_inside_metricbus_delivers_every_committed_step(child: Any, tmp_path: Path) -> None:
    """SIGTERM while log()/commit() hold their locks: the drain runs in its own thread, so no deadlock; all steps."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    proc, last, output = child("busy")
    assert proc.returncode == -signal.SIGTERM, output
    lines = [step for step, _ in read_jsonl(tmp_path / "m.jsonl")]
    assert lines == list(range(len(lines)))
    assert len(lines) >= last + 1, (last, len(lines))
    assert [step for step, _ in emitted(read_journal(tmp_path / "journal"))] == lines


def test_sigterm_chains_a_previous_python_handler(child: Any, tmp_path: Path) -> None:
    """A handler installed before the bus still runs (here it exits 7), after the buses were flushed."""
    proc, last, output = child("chain")
    assert proc.returncode == 7, output
    assert "previous handler" in output
    lines = [step for step, _ in read_jsonl(tmp_path / "m.jsonl")]
    assert lines == list(range(len(lines)))
    assert len(lines) >= last + 1


def test_import_installs_no_sigterm_handler() -> None:
    """Importing metricbus leaves SIGTERM alone; building a bus with an adapter installs the handler."""
    code = (
        "import signal\nimport metricbus\nassert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
        "from metricbus.testing import MemoryAdapter\n"
        "bus = metricbus.MetricBus(dist=None, adapters=[MemoryAdapter()])\n"
        "assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL\nbus.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_the_backoff_stays_at_its_cap_however_many_tries_failed() -> None:
    """A backend down for hours: the delay doubles to the cap and stays there (2 ** 1024 as a float raised
    OverflowError, which ended the live worker after ~1,025 tries, ~35 minutes at the default 2 s cap)."""
    delays = [backoff_s(tries=tries, base_s=0.05, cap_s=2.0) for tries in (1, 2, 6, 7, 1024, 1025, 10**6)]
    assert delays == [0.05, 0.1, 1.6, 2.0, 2.0, 2.0, 2.0]
    assert backoff_s(tries=1100, base_s=1e-300, cap_s=5.0) == 5.0
    assert backoff_s(tries=1024, base_s=1e-300, cap_s=5.0) == 5.0  # 1e-300 * 2 ** 1023 = 9e7
