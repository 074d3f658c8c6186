"""Process lifecycle of a bus: a rank that ends with its bus open while another closes, fork, Ctrl-C, close().

The torch.distributed cases run each rank as its own ``python`` process (tests/exit_workers.py), so what is checked
is the real interpreter exit.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.terminal import SIGINT_DEFAULT

pytest.importorskip("torch")

from metricbus.adapters.jsonl import read_jsonl

from metricbus import MetricBus, MetricBusError
from metricbus.adapter import Status
from metricbus.testing import MemoryAdapter
from tests.exit_workers import STEPS
from tests.test_exit import ROOT, check_clean, committed, run_order


def test_close_while_another_rank_ends_with_its_bus_open(tmp_path: Path) -> None:
    """rank 0 close(), rank 1 exits with its bus open: one DistributedError naming why, exit 0, every step kept."""
    ranks = run_order("close-one", tmp_path)
    check_clean(ranks, codes=(0, 0))
    assert "RuntimeError" not in ranks[0].stderr + ranks[1].stderr
    said = ranks[0].stdout
    assert "close: close() on rank 0: a torch.distributed collective failed" in said, said
    assert "ended without calling bus.close()" in said, said
    assert "this rank closes alone" in said, said
    assert "records of 'len', 'loss', 'tokens'" in ranks[1].stderr
    assert "interpreter exit" in ranks[1].stderr
    assert committed(tmp_path) == list(range(STEPS))
    assert [step for step, _ in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(STEPS))


def test_commit_while_another_rank_ends_with_its_bus_open(tmp_path: Path) -> None:
    """rank 0 commits after rank 1 exited: DistributedError keeping the records, then close() warns naming them."""
    ranks = run_order("commit-one", tmp_path)
    check_clean(ranks, codes=(0, 0))
    assert "RuntimeError" not in ranks[0].stderr + ranks[1].stderr
    said = ranks[0].stdout
    assert f"commit: commit(step={STEPS}) on rank 0: a torch.distributed collective failed" in said, said
    assert "The records stay buffered" in said, said
    assert "close:" not in said, said  # closed alone: the group is known broken
    assert "warning: rank 0: records of 'len', 'loss', 'tokens'" in said, said
    assert "were not committed" in said, said
    assert committed(tmp_path) == list(range(STEPS))
    assert [step for step, _ in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(STEPS))


FORK_CHILD = """
import multiprocessing, sys
from metricbus import ClosedError, MetricBus

def child(bus, said):
    for call in (lambda: bus.log("loss", 99.0), lambda: bus.log({{"loss": 1.0, "acc": 2.0}}),
                 lambda: bus.commit(step=3), lambda: bus.end_update()):
        try:
            call()
            said.put("no error")
        except ClosedError as exc:
            said.put(str(exc))
    bus.close()  # does nothing in the child: the parent's records, journal and adapters are the parent's
    said.put(f"closed {{bus.closed}}")

if __name__ == "__main__":
    bus = MetricBus(dist=None, adapters=["jsonl:{path}"], journal="{journal}")
    for step in range(3):
        bus.log({{"loss": float(step), "acc": 0.5}})
        bus.commit(step=step)
    bus.log("loss", 10.0)  # pending at the fork: the parent's to commit
    ctx = multiprocessing.get_context("fork")
    said = ctx.Queue()
    proc = ctx.Process(target=child, args=(bus, said))
    proc.start()
    for _ in range(5):
        print(said.get(timeout=60), flush=True)
    proc.join()
    print(f"exit {{proc.exitcode}}", flush=True)
    bus.commit(step=3)
    bus.close()
"""


def test_a_forked_child_cannot_use_its_copy_of_the_bus(tmp_path: Path) -> None:
    """log()/commit() in a multiprocessing fork worker raise ClosedError saying why; close() there does nothing."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    code = FORK_CHILD.format(path=tmp_path / "m.jsonl", journal=tmp_path / "journal")
    script = tmp_path / "fork_child.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout
    for line, verb in zip(lines, ["log 'loss'", "log {'loss'", "commit", "end_update"], strict=False):
        assert line.startswith(f"cannot {verb}"), line
        assert "is a child of os.fork()" in line, line
        assert "build a MetricBus in the child" in line, line
    assert lines[4:] == ["closed True", "exit 0"]
    got = list(read_jsonl(tmp_path / "m.jsonl"))
    assert [step for step, _ in got] == [0, 1, 2, 3]
    assert got[3][1] == {"loss": 10.0}  # the parent's record, once; none of the child's
    assert [(step, out) for step, out in emitted(read_journal(tmp_path / "journal"))] == got


HELD_AT_FORK = """
import os, sys, threading
from metricbus import ClosedError, MetricBus, shutdown

bus = MetricBus(dist=None, adapters=["jsonl:{path}"], journal="{journal}")
bus.log("loss", 1.0)
bus.commit(step=0)
held, release = threading.Event(), threading.Event()

def hold():  # a parent thread inside the bus (and the exit table) at the fork
    with bus._lock, bus._collector.lock, shutdown._lock:
        held.set()
        release.wait()

thread = threading.Thread(target=hold)
thread.start()
held.wait()
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(60)  # a child that hangs ends itself (the test sees its exit status), not left behind
    for call in (lambda: bus.commit(step=1), lambda: bus.define("x", "sum"), lambda: bus.log("loss", 2.0)):
        try:
            call()
        except ClosedError:
            pass
    bus.close()
    sys.exit(0)  # runs atexit in the child, which reads the exit table
release.set()
thread.join()
_, status = os.waitpid(pid, 0)
print(f"child exit {{os.waitstatus_to_exitcode(status)}}", flush=True)
bus.log("loss", 3.0)
bus.commit(step=1)
bus.close()
"""


def test_a_child_forked_while_a_thread_holds_the_bus_locks_does_not_hang(tmp_path: Path) -> None:
    """A fork while another thread holds the bus's, collector's and exit table's locks: the child's calls and its
    exit return (a lock held at the fork stays held in the child); the parent delivers each step once."""
    code = HELD_AT_FORK.format(path=tmp_path / "m.jsonl", journal=tmp_path / "journal")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["child exit 0"]
    assert list(read_jsonl(tmp_path / "m.jsonl")) == [(0, {"loss": 1.0}), (1, {"loss": 3.0})]


CTRL_C_PLAIN = """
import signal
from metricbus import MetricBus, ranks

bus = MetricBus(dist=None, rules={"c": "sum"}, log_every=2)  # no journal, no adapters
assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
bus.log("c", 1.0)
print("step 0", bus.commit())
real, armed = ranks.Exchange.commit_to, [1]

def commit_to(self, reducer):  # a Ctrl-C after the records were taken, before the step is counted
    if armed[0]:
        armed[0] = 0
        signal.raise_signal(signal.SIGINT)
    return real(self, reducer)

ranks.Exchange.commit_to = commit_to
bus.log("c", 10.0)
try:
    bus.commit()
except KeyboardInterrupt:
    print("interrupted, last step", bus.last_step)
for value in (100.0, 1000.0):
    bus.log("c", value)
    print(f"step {bus.last_step + 1}", bus.commit())
bus.close()
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
"""


def test_a_ctrl_c_during_a_commit_of_a_bus_without_journal_or_adapters_waits_for_the_commit() -> None:
    """A SIGINT inside commit() of a plain bus: the step is counted whole (its windows stay aligned), then raised."""
    done = subprocess.run([sys.executable, "-c", SIGINT_DEFAULT + CTRL_C_PLAIN], cwd=ROOT, capture_output=True,
                          text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["step 0 {}", "interrupted, last step 1", "step 2 {}", "step 3 {'c': 1100.0}"]


class _ToBus(logging.Handler):
    """A logging handler that counts a backend's log lines into a bus (``bus`` set after the bus is built)."""

    def __init__(self) -> None:
        super().__init__()
        self.bus: MetricBus | None = None

    def emit(self, record: logging.LogRecord) -> None:
        assert self.bus is not None
        self.bus.log("backend/lines", 1.0)


class _Chatty(MemoryAdapter):
    """A backend that logs a line (through Python logging) in each write() and in close()."""

    name = "chatty"

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.commit_error: BaseException | None = None

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        self.logger.info("wrote step %d", step)
        super().write(step=step, metrics=metrics)

    def close(self, *, status: Status) -> None:
        self.logger.info("closing")
        super().close(status=status)


def test_a_blocking_backend_that_logs_into_the_bus_while_close_drains_it_loses_no_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """queue_policy="block", the backend's write()/close() log into the bus: close() delivers every step and ends the
    run; the records logged after the last commit are dropped and named once (no ClosedError failing the write)."""
    backend = logging.getLogger("tests.chatty_backend")
    handler = _ToBus()
    backend.addHandler(handler)
    backend.setLevel(logging.INFO)
    try:
        adapter = _Chatty(backend)
        bus = MetricBus(dist=None, adapters=[adapter], queue_policy="block", queue_size=2)
        handler.bus = bus
        for step in range(10):
            bus.log("loss", float(step))
            bus.commit(step=step)
        with caplog.at_level(logging.WARNING, logger="metricbus"):
            bus.close(timeout_s=60)
    finally:
        backend.removeHandler(handler)
    assert adapter.status == "finished"
    steps = [step for step, _ in adapter.rows]
    assert steps[:10] == list(range(10))
    assert steps[10:] in ([], [10])  # the lines of the writes before close()'s commit, committed by it
    assert all("loss" in metrics for _, metrics in adapter.rows[:10])
    dropped = [r.getMessage() for r in caplog.records if "after the last commit and were dropped" in r.getMessage()]
    assert len(dropped) == 1, dropped
    assert "adapter 'chatty' logged 'backend/lines'" in dropped[0]


class _Committing(MemoryAdapter):
    """A backend whose close() calls back into the bus's commit()."""

    name = "committing"

    def __init__(self) -> None:
        super().__init__()
        self.bus: MetricBus | None = None
        self.error: BaseException | None = None

    def close(self, *, status: Status) -> None:
        assert self.bus is not None
        try:
            self.bus.commit()
        except MetricBusError as exc:
            self.error = exc
        super().close(status=status)


def test_a_backend_that_commits_from_its_close_is_refused_at_once() -> None:
    """commit() from the adapter's delivery thread while close() waits for it: a MetricBusError saying why (it waited
    for the lock close() holds until close() timed out, then ClosedError), every step delivered, the run ended."""
    adapter = _Committing()
    bus = MetricBus(dist=None, adapters=[adapter], queue_policy="block", queue_size=2)
    adapter.bus = bus
    for step in range(5):
        bus.log("loss", float(step))
        bus.commit(step=step)
    bus.close(timeout_s=60)
    assert type(adapter.error) is MetricBusError, adapter.error
    assert "from adapter 'committing''s delivery thread" in str(adapter.error)
    assert [step for step, _ in adapter.rows] == list(range(5))
    assert adapter.status == "finished"


class _Flushing(MemoryAdapter):
    """A backend whose write() calls back into the bus's flush()."""

    name = "flushing"

    def __init__(self) -> None:
        super().__init__()
        self.bus: MetricBus | None = None
        self.error: BaseException | None = None

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        assert self.bus is not None
        try:
            self.bus.flush(timeout_s=60)
        except MetricBusError as exc:
            self.error = exc
        super().write(step=step, metrics=metrics)


def test_a_backend_that_flushes_from_its_write_is_refused_at_once() -> None:
    """flush() from the adapter's delivery thread would wait for that very thread until its timeout: refused at
    once with a MetricBusError saying why, every step delivered."""
    adapter = _Flushing()
    bus = MetricBus(dist=None, adapters=[adapter])
    adapter.bus = bus
    for step in range(3):
        bus.log("loss", float(step))
        bus.commit(step=step)
    assert bus.flush(timeout_s=60)
    bus.close(timeout_s=60)
    assert type(adapter.error) is MetricBusError, adapter.error
    assert "cannot flush() from adapter 'flushing''s delivery thread" in str(adapter.error)
    assert [step for step, _ in adapter.rows] == list(range(3))
