"""``log_every`` windows in replay are the live ones after commits whose journal write failed: the "L" frame
written with the next write counts each as an empty commit where it was (review finding: every later window of the
replay was shifted by one commit, at other steps and with other values than live)."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalError
from metricbus.journal import Gap, JournalWarning, read_journal
from metricbus.replay import emitted
from metricbus.testing import MemoryAdapter


@pytest.mark.parametrize(("failing", "log_every"), [({1}, 2), ({4, 5, 6}, 3), ({0}, 2), ({9}, 4), ({2, 3}, 1)])
def test_failed_commits_keep_the_live_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: set[int], log_every: int
) -> None:
    directory = tmp_path / "j"
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=str(directory), adapters=[memory], log_every=log_every, fsync="never")
    real = os.write

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for step in range(10):
        bus.log("loss", float(step))
        bus.log("tokens", 1.0, agg="sum")
        monkeypatch.setattr(os, "write", full if step in failing else real)
        if step in failing:
            with pytest.raises(JournalError, match=f"step {step} is not journaled"):
                bus.commit(step)
        else:
            bus.commit(step)
    monkeypatch.setattr(os, "write", real)
    bus.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)
        journal = read_journal(directory)
    assert [(g.first_step, g.last_step) for g in journal.gaps] == [(min(failing), max(failing))]
    assert all(isinstance(g, Gap) for g in journal.gaps)
    replayed = dict(emitted(journal))
    # every window emits at its live step (one whose commits all failed emits nothing), and a window without a
    # failed commit emits the live values, bit for bit
    windows = {step: set(range(step - log_every + 1, step + 1)) for step, _ in memory.rows}
    assert set(replayed) == {step for step, window in windows.items() if not window <= failing}
    for step, live in memory.rows:
        if not failing & windows[step]:
            assert replayed[step] == live


def _commit_frames(data: bytes) -> list[tuple[int, int]]:
    """``(start, stop)`` of each commit frame of a rank file (its 8-byte frame head included)."""
    out, at = [], 8
    while at + 8 <= len(data):
        length = int.from_bytes(data[at : at + 4], "little")
        stop = at + 8 + length
        if data[at + 8 : at + 9] in (b"P", b"S", b"R"):
            out.append((at, stop))
        at = stop
    return out


@pytest.mark.parametrize("log_every", [2, 3, 5])
def test_a_commit_lost_to_damage_keeps_the_live_windows(tmp_path: Path, log_every: int) -> None:
    """Each commit frame in turn (one, then two in one window) damaged: every window emits at its live step, and
    each window without a damaged commit emits the live values (the "W" frame after each window names its steps,
    so the reader counts a lost commit as an empty one there; review finding: every later window was shifted)."""
    directory = tmp_path / "j"
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=str(directory), adapters=[memory], log_every=log_every)
    steps = [0, 1, 2, 4, 5, 6, 9, 10, 11, 12, 13, 15, 16, 17, 18, 20, 21, 22]  # steps with holes
    for step in steps:
        bus.log("loss", float(step))
        bus.log("tokens", 1.0, agg="sum")
        bus.log({f"group/m{i}": float(step + i) for i in range(8)})  # a commit in columns ("P" frames)
        bus.commit(step)
    bus.close()
    path = directory / "rank-00000.mbj"
    clean = path.read_bytes()
    frames = _commit_frames(clean)
    assert len(frames) == len(steps)
    windows = [steps[i : i + log_every] for i in range(0, len(steps), log_every)]
    live = dict(memory.rows)
    assert sorted(live) == [w[-1] for w in windows]
    cases = [[i] for i in range(len(steps))] + [[i, i + 1] for i in range(0, len(steps) - 1, log_every)]
    for damaged in cases:
        data = bytearray(clean)
        for i in damaged:
            data[frames[i][0] + 12] ^= 0x10  # inside the frame's step: its CRC fails
        path.write_bytes(bytes(data))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", JournalWarning)
            replayed = dict(emitted(read_journal(directory)))
        lost = {steps[i] for i in damaged}
        assert sorted(replayed) == [w[-1] for w in windows if not set(w) <= lost], damaged
        for window in windows:
            if not lost & set(window):
                assert replayed[window[-1]] == live[window[-1]], (damaged, window)


def _damage_steps(path: Path, steps: set[int]) -> None:
    """Flip a byte inside the commit frame of each of ``steps``."""
    data = bytearray(path.read_bytes())
    for start, _ in _commit_frames(bytes(data)):
        if int.from_bytes(data[start + 9 : start + 17], "little", signed=True) in steps:
            data[start + 12] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("plan", "damaged", "log_every"),
    [
        ({1: -3}, set(), 2),  # a short write (all of the commit, not all of its "W"), then ENOSPC
        ({2: None, 3: 30}, set(), 2),  # a failed commit, then the next write cut after its "L" frame
        ({2: None, 3: 55}, set(), 3),
        ({3: None}, {2}, 2),  # a window's last commit failed (its "W" goes with the next write), another damaged
        ({4: None, 5: None, 6: None}, {8}, 3),
        ({5: -1, 6: None}, {1, 9}, 2),
    ],
)
def test_failed_and_damaged_commits_keep_the_live_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: dict[int, int | None], damaged: set[int], log_every: int
) -> None:
    """Short writes, failed writes and damage together (second review): each window emits at its live step, with
    the live values where none of its commits was lost; a short write's bytes are cut, so nothing counts twice."""
    directory = tmp_path / "j"
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=str(directory), adapters=[memory], log_every=log_every, fsync="never")
    real = os.write
    for step in range(12):
        bus.log("loss", float(step))
        bus.log("tokens", 1.0, agg="sum")
        if step not in plan:
            bus.commit(step)
            continue
        cut = plan[step]
        calls = [0]

        def failing(fd: int, data: bytes, cut: int | None = cut, calls: list[int] = calls) -> int:
            calls[0] += 1
            if cut is not None and calls[0] == 1:
                return real(fd, bytes(data)[:cut])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", failing)
        with pytest.raises(JournalError, match=f"step {step} is not journaled"):
            bus.commit(step)
        monkeypatch.setattr(os, "write", real)
    bus.close()
    _damage_steps(directory / "rank-00000.mbj", damaged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)
        replayed = dict(emitted(read_journal(directory)))
    lost = set(plan) | damaged
    windows = {step: set(range(step - log_every + 1, step + 1)) & set(range(12)) for step, _ in memory.rows}
    assert set(replayed) == {step for step, window in windows.items() if not window <= lost}
    for step, live in memory.rows:
        if not lost & windows[step]:
            assert replayed[step] == live


# these tests make the journal's os.write calls fail: each commit written with its own (conftest.unstaged)
pytestmark = pytest.mark.usefixtures("unstaged")
