"""A resumed writer's segment starts where its first commit is, even when that commit is lost: the "K" frame written
with it says so (review finding: a damaged first commit let the replaced steps of the run before come back)."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.journal import JournalWarning, read_journal, stream_journal
from metricbus.journal.format import MAX_LOST, frame
from metricbus.replay import emitted

_FRAME = struct.Struct("<II")


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    """``(offset of the payload, its type)`` of every frame after the magic."""
    out, at = [], 8
    while at + _FRAME.size <= len(data):
        length, _ = _FRAME.unpack_from(data, at)
        out.append((at + _FRAME.size, data[at + _FRAME.size : at + _FRAME.size + 1]))
        at += _FRAME.size + length
    return out


def _run(directory: Path) -> Path:
    """Steps 0..9 (value = step), then a resumed writer from step 5 (value = 100 + step)."""
    bus = MetricBus(dist=None, journal=str(directory))
    for step in range(10):
        bus.log("loss", float(step))
        bus.commit(step)
    bus.close()
    bus = MetricBus(dist=None, journal=str(directory), resume=True)
    for step in range(5, 10):
        bus.log("loss", 100.0 + step)
        bus.commit(step)
    bus.close()
    return directory / "rank-00000.mbj"


def _replayed(directory: Path) -> list[tuple[int, float]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", JournalWarning)
        out = [(step, metrics["loss"]) for step, metrics in emitted(stream_journal(directory))]
    assert all(issubclass(w.category, JournalWarning) for w in caught)
    return out


def test_each_writer_marks_where_its_segment_starts(tmp_path: Path) -> None:
    path = _run(tmp_path / "j")
    kinds = [kind for _, kind in _frames(path.read_bytes())]
    assert kinds.count(b"K") == 2  # one per writer, before its first commit
    assert _replayed(tmp_path / "j") == [(s, float(s)) for s in range(5)] + [(s, 100.0 + s) for s in range(5, 10)]


def test_a_lost_first_commit_of_a_resumed_segment_does_not_bring_back_the_replaced_step(tmp_path: Path) -> None:
    path = _run(tmp_path / "j")
    data = bytearray(path.read_bytes())
    frames = _frames(bytes(data))
    second_k = [i for i, (_, kind) in enumerate(frames) if kind == b"K"][1]
    first_commit = next(at for at, kind in frames[second_k + 1 :] if kind in (b"P", b"S", b"R"))
    data[first_commit + 3] ^= 0x40  # inside its step: the CRC fails
    path.write_bytes(bytes(data))
    # step 5 is lost (the damaged commit); the run before's 5.0 must not come back in its place
    assert _replayed(tmp_path / "j") == [(s, float(s)) for s in range(5)] + [(s, 100.0 + s) for s in range(6, 10)]


@pytest.mark.parametrize("resume_at", [2, 3])
def test_a_lost_last_commit_of_a_replaced_segment_stays_replaced(tmp_path: Path, resume_at: int) -> None:
    """log_every 2: the run before's last commit (its window named by a "W" frame) is damaged, and the resumed
    segment replaces that step anyway: replay equals the undamaged file's (second review: the lost commit came back
    as an empty commit at a replaced step, the steps going back)."""
    directory = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(directory), log_every=2)
    for step in range(4):
        bus.log("loss", float(step))
        bus.commit(step)
    bus.close()
    bus = MetricBus(dist=None, journal=str(directory), log_every=2, resume=True)
    for step in range(resume_at, 6):
        bus.log("loss", 100.0 + step)
        bus.commit(step)
    bus.close()
    path = directory / "rank-00000.mbj"
    clean = _replayed(directory)
    data = bytearray(path.read_bytes())
    frames = _frames(bytes(data))
    last_old = max(at for at, kind in frames[: [k for _, k in frames].index(b"H", 3)] if kind == b"P")
    data[last_old + 3] ^= 0x40
    path.write_bytes(bytes(data))
    assert _replayed(directory) == clean
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)
        steps = [step for step, _ in read_journal(directory).commits]
    assert steps == sorted(steps)


def test_crafted_markers_are_damage_not_a_crash(tmp_path: Path) -> None:
    """An "L" frame naming 2**62 commits, or a "W" frame of more steps than a reader builds, with valid CRCs: skipped
    as unreadable records, with a warning, at once (second review: MemoryError, or a list of 10**9 steps)."""
    directory = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(directory))
    for step in range(4):
        bus.log("loss", float(step))
        bus.commit(step)
    bus.close()
    path = directory / "rank-00000.mbj"
    clean = _replayed(directory)
    crafted = frame(b"L", struct.pack("<qq", 0, 2**62)) + frame(b"W", bytes(8 * (MAX_LOST + 1)))
    path.write_bytes(path.read_bytes() + crafted)
    with pytest.warns(JournalWarning, match="unreadable record"):
        assert [(s, m["loss"]) for s, m in emitted(stream_journal(directory))] == clean
