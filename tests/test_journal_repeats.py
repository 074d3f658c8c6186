"""A commit frame that repeats the one before it (a copy of bytes, never what a writer writes: two commits at one
step hold different names) is damage: skipped with a warning, not replayed twice (review finding: a duplicated frame
was summed again, silently)."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.journal import JournalWarning, stream_journal
from metricbus.replay import emitted

_FRAME = struct.Struct("<II")


def _commit_frames(data: bytes) -> list[tuple[int, int]]:
    """``(start, stop)`` of each commit frame (header included)."""
    out, at = [], 8
    while at + _FRAME.size <= len(data):
        length, _ = _FRAME.unpack_from(data, at)
        stop = at + _FRAME.size + length
        if data[at + _FRAME.size : at + _FRAME.size + 1] in (b"P", b"S", b"R"):
            out.append((at, stop))
        at = stop
    return out


def _replayed(directory: Path) -> tuple[list[tuple[int, dict[str, float]]], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", JournalWarning)
        out = list(emitted(stream_journal(directory)))
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize("which", [1, 20, 39])  # the first commit after the names, one inside a run, the last
def test_a_repeated_commit_frame_is_skipped_with_a_warning(tmp_path: Path, which: int) -> None:
    directory = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(directory), log_every=2)
    for step in range(40):
        bus.log("tokens", 10.0, agg="sum")
        bus.log("loss", float(step))
        bus.commit(step)
    bus.close()
    expected, warned = _replayed(directory)
    assert not warned
    path = directory / "rank-00000.mbj"
    data = path.read_bytes()
    start, stop = _commit_frames(data)[which]
    path.write_bytes(data[:stop] + data[start:stop] + data[stop:])
    got, warned = _replayed(directory)
    assert got == expected
    assert len(warned) == 1
    assert f"repeats the commit before it (step {which})" in warned[0]
