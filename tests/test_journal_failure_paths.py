"""Journal failure paths found by review: a failed write cuts only its own bytes (a forked child's commits stay),
a torn header or close tail is cut too, a write that makes no progress is an error (not a loop), close(2) and
fsync="commit" failures say what they mean, and a resume whose catch-up fails journals the commit and stops the
adapters it could not catch up."""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalError, JournalWarning
from metricbus.journal import cursors, read_journal, writer
from metricbus.testing import MemoryAdapter
from tests.journal_workers import journal_as_a_forked_child

Write = Callable[[int, bytes], int]


def _read(directory: Path) -> tuple[list[int], list[int], list[tuple[int, int]], list[str]]:
    """(steps, steps with entries, gaps, warnings) of the journal in ``directory``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        journal = read_journal(directory)
    steps = [s for s, _ in journal.commits]
    full = [s for s, parts in journal.commits if any(p.entries for p in parts)]
    gaps = [(g.first_step, g.last_step) for g in journal.gaps]
    return steps, full, gaps, [str(w.message) for w in caught]


def _unreadable(self: Path, *args: object, **kwargs: object) -> object:
    """``Path.open`` of a disk that fails reads for a moment."""
    raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))


class _Os:
    """The ``os`` module as :mod:`metricbus.journal.writer` sees it, with ``write`` (or ``close``) replaced."""

    def __init__(self, **replaced: object) -> None:
        self._replaced = replaced

    def __getattr__(self, name: str) -> object:
        return self._replaced.get(name, getattr(os, name))


@pytest.fixture
def torn_then_full(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Calling it makes the journal's next write put 10 bytes in the file, then fail with ENOSPC (a nearly full
    disk), until the fixture's ``heal`` (the returned callable's attribute) is called."""
    state = {"on": False, "torn": False}

    def write(fd: int, data: bytes) -> int:
        if not state["on"]:
            return os.write(fd, data)
        if not state["torn"]:
            state["torn"] = True
            return os.write(fd, bytes(data)[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "os", _Os(write=write))

    def fail() -> None:
        state.update(on=True, torn=False)

    def heal() -> None:
        state["on"] = False

    fail.heal = heal  # type: ignore[attr-defined]
    return fail


def test_a_failed_write_cuts_only_its_own_bytes_a_forked_childs_commit_stays(
    tmp_path: Path, torn_then_full: Callable[[], None]
) -> None:
    """Before, the parent cut the file to the size it last wrote, erasing the child's commit without a trace."""
    directory = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(directory), fsync="never")
    bus.log("x", 0.0)
    bus.commit(0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            journal_as_a_forked_child(bus, 1, [("x", 1.0)])
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    torn_then_full()
    bus.log("x", 2.0)
    with pytest.raises(JournalError, match=r"No space left on device \(ENOSPC\); step 2 is not journaled"):
        bus.commit(2)
    torn_then_full.heal()  # type: ignore[attr-defined]
    bus.log("x", 3.0)
    bus.commit(3)
    bus.close()
    assert _read(directory) == ([0, 1, 2, 3], [0, 1, 3], [(2, 2)], [])


def test_a_torn_close_tail_is_cut(tmp_path: Path, torn_then_full: Callable[[], None]) -> None:
    """The disk is still full at close(): the part of its tail that reached the file is cut, so later reads see
    no damaged record."""
    directory = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(directory), fsync="never")
    for step in range(3):
        bus.log("x", float(step))
        if step == 2:
            torn_then_full()
        with pytest.raises(JournalError) if step == 2 else contextlib.nullcontext():
            bus.commit(step)
    bus.close()
    torn_then_full.heal()  # type: ignore[attr-defined]
    steps, full, _gaps, warned = _read(directory)
    assert (steps[:2], full, warned) == ([0, 1], [0, 1], [])


def test_a_torn_header_is_cut(tmp_path: Path, torn_then_full: Callable[[], None]) -> None:
    directory = tmp_path / "j"
    torn_then_full()
    with pytest.raises(JournalError, match="cannot write journal file"):
        MetricBus(dist=None, journal=str(directory), fsync="never")
    torn_then_full.heal()  # type: ignore[attr-defined]
    bus = MetricBus(dist=None, journal=str(directory), fsync="never")
    bus.log("x", 0.0)
    bus.commit(0)
    bus.close()
    assert _read(directory) == ([0], [0], [], [])


def test_a_write_that_makes_no_progress_is_an_error_not_a_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(directory), fsync="never")
    bus.log("x", 0.0)
    bus.commit(0)
    calls = []

    def write(fd: int, data: bytes) -> int:
        calls.append(len(data))
        return os.write(fd, bytes(data)[:5]) if len(calls) == 1 else 0

    monkeypatch.setattr(writer, "os", _Os(write=write))
    bus.log("x", 1.0)
    with pytest.raises(JournalError, match=r"write made no progress \(0 bytes\).*step 1 is not journaled"):
        bus.commit(1)
    assert len(calls) == 2
    monkeypatch.undo()
    bus.log("x", 2.0)
    bus.commit(2)
    bus.close()
    assert _read(directory)[1:] == ([0, 2], [(1, 1)], [])


def test_fsync_commit_failure_says_the_step_may_not_survive_a_power_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, it said the step "is not journaled", which it is (it replays)."""
    bus = MetricBus(dist=None, journal=str(tmp_path / "j"), fsync="commit")

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    bus.log("x", 0.0)
    monkeypatch.setattr(writer, "os", _Os(fsync=fsync))
    with pytest.raises(JournalError, match="step 0 may not survive a power loss"):
        bus.commit(0)
    monkeypatch.undo()
    bus.close()


def test_an_error_from_close_is_a_journal_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A network file system reports a failed write-back at close(2); before, a raw OSError."""
    bus = MetricBus(dist=None, journal=str(tmp_path / "j"), fsync="never")
    bus.log("x", 0.0)
    bus.commit(0)

    def close(fd: int) -> None:
        os.close(fd)
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(writer, "os", _Os(close=close))
    with pytest.raises(JournalError, match=r"cannot close journal file .*rank-00000.mbj: Disk quota exceeded"):
        bus.close()


def test_a_resume_whose_catch_up_fails_journals_the_commit_and_stops_the_adapters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a raw OSError escaped commit(), the step's records were lost, and the adapter's cursor passed the
    steps it never got."""
    directory = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(directory))
    for step in range(5):
        bus.log("x", float(step))
        bus.commit(step)
    bus.close()
    for path in (directory / "cursors").glob("*"):
        path.unlink()  # as after a crash before any step was acknowledged
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=str(directory), adapters=[memory], resume=True)

    monkeypatch.setattr(Path, "open", _unreadable)  # (the reader's scan of the old journal, as a failing disk)
    bus.log("x", 5.0)
    with pytest.raises(JournalError, match=r"step 5: could not catch the adapters up .*metricbus sync"):
        bus.commit(5)
    monkeypatch.undo()
    bus.log("x", 6.0)
    bus.commit(6)
    bus.close()
    assert _read(directory)[:3] == ([0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6], [])
    assert memory.rows == []  # stopped for the run ...
    assert cursors.CursorStore(directory).get(memory) is None  # ... and `metricbus sync` sends it every step



@pytest.mark.parametrize("text", ['{"step": 1e400}', '{"step": 2.5}', "garbage", "[1]", '{"step": "3"}'])
def test_a_damaged_cursor_is_warned_about_and_every_step_is_sent_again(tmp_path: Path, text: str) -> None:
    """Before, 1e400 stopped sync with an OverflowError reported as a backend failure, and the others were read
    as absent without a word."""
    from metricbus.replay import sync

    directory = tmp_path / "j"
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=str(directory), adapters=[memory])
    for step in range(3):
        bus.log("x", float(step))
        bus.commit(step)
    bus.close()
    (cursor,) = (directory / "cursors").glob("*.json")
    cursor.write_text(text, encoding="utf-8")
    again = MemoryAdapter()
    with pytest.warns(JournalWarning, match=r"delivery cursor .* is damaged: .*every journaled step is sent"):
        sent = sync(directory, [again])
    assert sent == {"memory": 3}
    assert [step for step, _ in again.rows] == [0, 1, 2]


def test_a_resume_without_adapters_does_not_read_the_old_journal_at_its_first_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """There is no one to catch up: before, an unreadable old journal made that commit raise about adapters."""
    directory = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(directory))
    bus.log("x", 0.0)
    bus.commit(0)
    bus.close()
    bus = MetricBus(dist=None, journal=str(directory), resume=True)

    monkeypatch.setattr(Path, "open", _unreadable)
    bus.log("x", 1.0)
    assert bus.commit(1) == {"x": 1.0}
    monkeypatch.undo()
    bus.close()
    assert _read(directory)[:3] == ([0, 1], [0, 1], [])


# these tests make the journal's os.write calls fail: each commit written with its own (conftest.unstaged)
pytestmark = pytest.mark.usefixtures("unstaged")
