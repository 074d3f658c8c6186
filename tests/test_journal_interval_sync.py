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
from metricbus.journal import Gap, writer
from tests.journal_workers import fault_values
from tests.test_journal_faults import commit_steps, expected, quietly_read, recovered

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
    assert callers[-1] == "MainThread"  # close's own fsync, once the thread ended
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
