"""Blocks reserved past the journal's end: the file holds only its frames, close frees the rest, a refusal is
harmless."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.journal import rank_file, read_journal, reserve
from tests.journal_workers import RULES, log_step

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fallocate is Linux's")


def _allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@linux_only
def test_reserved_while_open_and_freed_at_close(tmp_path: Path) -> None:
    """While the bus is open the file's size is its frames (readable as they are) and blocks lie reserved past it;
    after close() only the frames' blocks stay."""
    if reserve.reserver() is None:
        pytest.skip("this libc has no fallocate")
    directory = tmp_path / "journal"
    bus = MetricBus(dist=None, rules=RULES, journal=str(directory))
    for step in range(3):
        log_step(bus, step, 0)
        bus.commit(step)
    path = rank_file(directory, 0)
    size = os.stat(path).st_size
    assert [s for s, _ in read_journal(directory).commits] == [0, 1, 2]  # no zeros past the last frame
    reserved = _allocated(path) >= size + reserve.CHUNK_BYTES // 2
    bus.close()
    assert os.stat(path).st_size >= size
    if reserved:  # the file system took the reservation: close gives it back
        assert _allocated(path) < os.stat(path).st_size + 64 * 1024
    assert [s for s, _ in read_journal(directory).commits] == [0, 1, 2]


def test_a_refused_reservation_still_journals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system (or a full disk) that refuses the reservation: every commit is written all the same."""
    calls: list[tuple[int, int]] = []

    def refuse(fd: int, offset: int, length: int) -> bool:
        calls.append((offset, length))
        return False

    monkeypatch.setattr(reserve, "reserver", lambda: refuse)
    directory = tmp_path / "journal"
    with MetricBus(dist=None, rules=RULES, journal=str(directory)) as bus:
        for step in range(4):
            log_step(bus, step, 0)
            bus.commit(step)
    assert calls
    assert calls[0][1] == reserve.CHUNK_BYTES
    assert [s for s, _ in read_journal(directory).commits] == [0, 1, 2, 3]


def test_a_frame_larger_than_a_chunk_reserves_all_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit larger than the chunk asks for its own length; later reservations start at the file's end."""
    calls: list[tuple[int, int]] = []
    real = reserve.reserver()

    def recorded(fd: int, offset: int, length: int) -> bool:
        calls.append((offset, length))
        assert offset == os.fstat(fd).st_size  # from the end of the frames written
        return True if real is None else real(fd, offset, length)

    monkeypatch.setattr(reserve, "reserver", lambda: recorded)
    monkeypatch.setattr(reserve, "CHUNK_BYTES", 4096)
    directory = tmp_path / "journal"
    with MetricBus(dist=None, journal=str(directory)) as bus:
        for step in range(8):
            bus.log({f"m{i}": float(i + step) for i in range(200)})  # the first commit also names 200 metrics
            bus.commit(step)
    assert calls[0][1] > 4096
    assert len(calls) >= 2
    assert [length for _, length in calls[1:]] == [4096] * (len(calls) - 1)
    assert [s for s, _ in read_journal(directory).commits] == list(range(8))


def test_a_python_without_ctypes_still_journals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ctypes (a Python built without libffi): nothing is reserved, and the journal opens and writes as before."""
    monkeypatch.setitem(sys.modules, "ctypes", None)  # import ctypes raises ImportError
    uncached = reserve.reserver.__wrapped__
    assert uncached() is None
    monkeypatch.setattr(reserve, "reserver", uncached)
    directory = tmp_path / "journal"
    with MetricBus(dist=None, rules=RULES, journal=str(directory)) as bus:
        for step in range(2):
            log_step(bus, step, 0)
            bus.commit(step)
    assert [s for s, _ in read_journal(directory).commits] == [0, 1]


# the blocks reserved ahead are those of a writer that writes each commit (a stage's batches allocate their own)
pytestmark = pytest.mark.usefixtures("unstaged")
