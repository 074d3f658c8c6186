"""fsync="interval" runs from a thread of the journal's own: a commit never waits on the disk's fsync, a failed fsync
is raised by the next commit (or close) and marked as a gap, and the thread ends with the journal.

Each test replaces ``os.fsync`` with a function that says from which thread it was called; the interval is made
short so the thread runs within the test.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalError
from metricbus.journal import Gap, rank_file, writer
from tests.journal_workers import fault_values, journal_as_a_forked_child
from tests.test_journal_faults import commit_steps, expected, quietly_read, recovered, torn_then_full

WAIT_S = 30.0  # a bound on waiting for the thread, never reached when the code is right


def steps_named(error: JournalError, journal: Path) -> tuple[int, int]:
    """The first and last step an fsync failure's ``error`` names, after checking its other words."""
    message = str(error)
    assert f"cannot fsync journal file {journal / 'rank-00000.mbj'}: Input/output error (EIO); " in message
    found = re.search(r"; steps? (\d+)(?: to (\d+))? may not survive a power loss", message)
    assert found is not None, message
    return int(found[1]), int(found[2] or found[1])


def journal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("metricbus-journal-")]


@pytest.fixture(autouse=True)
def short_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "FSYNC_INTERVAL_S", 0.01)


def fake_fsync(monkeypatch: pytest.MonkeyPatch, background: Callable[[int], None]) -> list[str]:
    """``os.fsync`` as ``background`` on other threads than this one (the real one here); the names of the threads
    that called it, in order."""
    real, main, callers = os.fsync, threading.current_thread(), []

    def fsync(fd: int) -> None:
        callers.append(threading.current_thread().name)
        if threading.current_thread() is main:
            real(fd)
        else:
            background(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return callers


def test_a_commit_never_waits_for_the_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync that hangs (a busy network file system) holds none of 200 commits made meanwhile; it runs on the
    journal's thread only, and every commit is read back."""
    entered, release = threading.Event(), threading.Event()

    def hanging(fd: int) -> None:
        entered.set()
        assert release.wait(WAIT_S)

    callers = fake_fsync(monkeypatch, hanging)
    journal = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(journal))
    assert journal_threads() == []  # nothing written yet: no thread
    assert callers == ["MainThread"]  # the header, at open
    live = commit_steps(bus, range(1))
    assert entered.wait(WAIT_S)  # the thread's fsync has started, and hangs
    live |= commit_steps(bus, range(1, 201))
    assert callers[1:] == ["metricbus-journal-0"]  # none of the commits called fsync
    release.set()
    bus.close()
    assert journal_threads() == []
    got, caught = quietly_read(journal)
    assert caught == []
    assert got.gaps == []
    assert recovered(got) == live == {s: expected(s) for s in range(201)}


def test_a_failed_fsync_is_raised_by_the_next_commit_and_marked_as_a_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread's fsync fails (EIO) once: a later commit raises JournalError naming the file, EIO and the steps the
    fsync covered, which the journal marks as a gap; every step is still written and read back, later ones too."""
    failures = [OSError(errno.EIO, os.strerror(errno.EIO))]

    def failing_once(fd: int) -> None:
        if failures:
            raise failures.pop()

    fake_fsync(monkeypatch, failing_once)
    journal = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(journal))
    live = commit_steps(bus, range(3))
    raised = None
    step = 3
    while raised is None:  # each commit returns until the thread's failure is taken
        assert step < 3 + int(WAIT_S / 0.001)
        for name, value in fault_values(step):
            bus.log(name, value)
        try:
            live[step] = bus.commit(step)
            threading.Event().wait(0.001)
        except JournalError as exc:
            raised = exc
        step += 1
    first, last = steps_named(raised, journal)
    assert first == 0
    assert last < step - 1  # from the first write to one before the commit that raised
    assert isinstance(raised.__cause__, OSError)
    live |= commit_steps(bus, range(step, step + 3))
    bus.close()
    got, caught = quietly_read(journal)
    assert caught == []
    assert got.gaps == [Gap(0, first, last)]  # written, never known to be on disk
    assert recovered(got) == {s: expected(s) for s in range(step + 3)}
    assert live == {s: expected(s) for s in range(step + 3) if s != step - 1}


def test_a_failed_fsync_not_yet_raised_is_raised_by_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread's fsync fails after the last commit: close() raises it (once the file is closed and unlocked), and
    the gap marker goes into the file with close's tail."""
    called = threading.Event()

    def failing(fd: int) -> None:
        called.set()
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    fake_fsync(monkeypatch, failing)
    journal = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(journal))
    live = commit_steps(bus, range(2))
    assert called.wait(WAIT_S)
    with pytest.raises(JournalError) as raised:
        bus.close()
    first, last = steps_named(raised.value, journal)
    assert first == 0
    assert last <= 1
    assert journal_threads() == []
    MetricBus(dist=None, journal=str(journal), resume=True).close()  # unlocked: a next writer opens it
    got, caught = quietly_read(journal)
    assert caught == []
    assert got.gaps == [Gap(0, first, last)]
    assert recovered(got) == live


@pytest.mark.parametrize("fsync", ["commit", "never"])
def test_only_the_interval_policy_has_a_thread(tmp_path: Path, fsync: str) -> None:
    with MetricBus(dist=None, journal=str(tmp_path / "j"), fsync=fsync) as bus:
        commit_steps(bus, range(3))
        assert journal_threads() == []


def test_close_after_the_thread_synced_everything_does_not_fsync_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() waits for the thread's fsync under way, and fsyncs again only what was written after it began: here
    nothing, so a slow fsync is waited for once, not twice."""
    entered, release = threading.Event(), threading.Event()

    def slow(fd: int) -> None:
        entered.set()
        assert release.wait(WAIT_S)

    callers = fake_fsync(monkeypatch, slow)
    journal = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(journal))
    live = commit_steps(bus, range(3))
    assert entered.wait(WAIT_S)  # began after the last write
    release.set()
    bus.close()
    # the header's at open, the thread's (the file, then its stage), then the stage's last batch at close
    assert callers == ["MainThread", "metricbus-journal-0", "metricbus-journal-0", "MainThread"]
    got, _ = quietly_read(journal)
    assert recovered(got) == live


def test_a_failed_fsync_is_not_lost_to_a_failed_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unstaged: None
) -> None:
    """The thread's fsync fails, then the next commit's write fails too (ENOSPC): that commit raises the write's
    error, and the commit after it (whose write succeeds) the fsync's, naming its steps; each is marked as a gap."""
    called = threading.Event()
    failures = [OSError(errno.EIO, os.strerror(errno.EIO))]

    def failing_once(fd: int) -> None:
        if failures:
            called.set()
            raise failures.pop()

    fake_fsync(monkeypatch, failing_once)
    journal = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(journal))
    commit_steps(bus, range(2))
    assert called.wait(WAIT_S)
    failing = torn_then_full(monkeypatch, rank_file(journal, 0))
    failing[:] = [False]
    with pytest.raises(JournalError, match=r"No space left on device \(ENOSPC\); step 2 is not journaled"):
        commit_steps(bus, range(2, 3))
    failing.clear()
    with pytest.raises(JournalError) as raised:
        commit_steps(bus, range(3, 4))
    first, last = steps_named(raised.value, journal)
    assert first == 0
    assert last <= 1
    commit_steps(bus, range(4, 6))
    bus.close()
    got, caught = quietly_read(journal)
    assert caught == []
    assert got.gaps == [Gap(0, 0, last), Gap(0, 2, 2)]  # not known to be on disk; not journaled
    assert recovered(got) == {s: expected(s) for s in range(6) if s != 2}


def test_where_no_thread_can_start_the_fsync_runs_inline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that cannot be started (Python 3.12+ at interpreter exit: RuntimeError) leaves the fsync inline,
    at most once per interval as before: commits and close() work, and nothing is lost."""
    callers = fake_fsync(monkeypatch, lambda fd: None)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    journal = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(journal))
    live = commit_steps(bus, range(3))
    threading.Event().wait(0.05)  # past the interval: the next commit fsyncs
    live |= commit_steps(bus, range(3, 5))
    bus.close()
    assert set(callers) == {"MainThread"}
    assert len(callers) >= 3  # at open, inline, at close
    got, caught = quietly_read(journal)
    assert caught == []
    assert got.gaps == []
    assert recovered(got) == live == {s: expected(s) for s in range(5)}


def test_a_forked_child_syncs_from_a_thread_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked while the journal's thread runs has none; its first write starts its own, which fsyncs."""
    callers = fake_fsync(monkeypatch, lambda fd: None)
    journal = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(journal))
    commit_steps(bus, range(1))
    assert journal_threads() != []
    pid = os.fork()
    if pid == 0:  # the child: exits with 0 only if its own thread fsynced its commit
        ok = False
        try:
            callers.clear()
            journal_as_a_forked_child(bus, 1, fault_values(1))
            for _ in range(int(WAIT_S / 0.01)):
                if "metricbus-journal-0" in callers:
                    ok = True
                    break
                threading.Event().wait(0.01)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    commit_steps(bus, range(2, 3))
    bus.close()
    got, _ = quietly_read(journal)
    assert [s for s, _ in got.commits] == [0, 1, 2]


def test_a_child_forked_after_close_keeps_its_descriptors(tmp_path: Path) -> None:
    """Once the bus is closed, a child forked later (a DataLoader worker) closes none of its descriptors: the fsync
    thread's descriptor number, free again, is likely the next one opened (here a pipe)."""
    with MetricBus(dist=None, journal=str(tmp_path / "j")) as bus:
        commit_steps(bus, range(3))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.write(write, b"ok")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.read(read, 2) == b"ok"
    os.close(read)
