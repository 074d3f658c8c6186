"""Journal faults: two writers, disk errors, flipped bytes in the header and the name table, unreadable rank files.

Each test asserts what was logged (the live values), what was journaled, and what ``read_journal`` + ``emitted``
recover, warnings included (JournalWarnings from metricbus are errors unless a test expects them).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalError
from metricbus.journal import MAGIC, Gap, Journal, JournalWarning, lock_file, rank_file, read_journal
from metricbus.replay import emitted
from metricbus.testing import MemoryAdapter
from tests.journal_workers import RULES, fault_values, log_step

ROOT = Path(__file__).resolve().parent.parent
WORKERS = str(ROOT / "tests" / "journal_workers.py")
FRAME = struct.Struct("<II")


def expected(step: int) -> dict[str, float]:
    """What a bus emits for :func:`fault_values` at ``step`` (every name's default: the mean), by hand."""
    by_name: dict[str, list[float]] = {}
    for name, value in fault_values(step):
        by_name.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in by_name.items()}


def commit_steps(bus: MetricBus, steps: range) -> dict[int, dict[str, float]]:
    """Log :func:`fault_values` and commit each step; what each ``commit()`` returned."""
    out = {}
    for step in steps:
        for name, value in fault_values(step):
            bus.log(name, value)
        out[step] = bus.commit(step)
    return out


def recovered(journal: Journal) -> dict[int, dict[str, float]]:
    """What replay recovers from ``journal``."""
    return dict(emitted(journal))


def quietly_read(path: Path) -> tuple[Journal, list[str]]:
    """``read_journal(path)`` and the JournalWarnings it gave, in order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        journal = read_journal(path)
    assert all(issubclass(w.category, JournalWarning) for w in caught), [str(w.message) for w in caught]
    return journal, [str(w.message) for w in caught]


def frames(data: bytes) -> Iterator[tuple[int, bytes, int]]:
    """``(offset, kind, size)`` of each frame of an undamaged file, by the documented layout."""
    pos = len(MAGIC)
    while pos < len(data):
        length, _ = FRAME.unpack_from(data, pos)
        yield pos, data[pos + FRAME.size : pos + FRAME.size + 1], FRAME.size + length
        pos += FRAME.size + length


def flipped(data: bytes, at: int) -> bytes:
    """``data`` with every bit of byte ``at`` flipped."""
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


# -- one writer per rank file ----------------------------------------------------------------------------------


def torn_then_full(monkeypatch: pytest.MonkeyPatch, path: Path) -> list[bool]:
    """Make ``os.write`` to ``path`` fail while the returned list is not empty (one entry per failing commit: whether
    its partial write was done): its first write writes 7 bytes, the later ones raise ENOSPC."""
    inode = path.stat().st_ino
    real = os.write
    failing: list[bool] = []

    def write(fd: int, data: Any) -> int:
        if failing and os.fstat(fd).st_ino == inode:
            if not failing[-1]:
                failing[-1] = True
                return real(fd, bytes(data[:7]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return failing


def test_a_second_writer_in_the_same_process_is_refused(tmp_path: Path) -> None:
    """A second bus on the same directory and rank gets a JournalError naming the file and this PID; no damage."""
    journal = tmp_path / "j"
    with MetricBus(dist=None, journal=str(journal)) as first:
        live = commit_steps(first, range(3))
        with pytest.raises(JournalError) as refused:
            MetricBus(dist=None, journal=str(journal), resume=True)
        live |= commit_steps(first, range(3, 6))
    message = str(refused.value)
    assert str(rank_file(journal, 0)) in message
    assert f"PID {os.getpid()} " in message
    got, caught = quietly_read(journal)
    assert caught == []
    assert [len(f.headers) for f in got.files] == [1]
    assert live == recovered(got) == {step: expected(step) for step in range(6)}
    assert not lock_file(journal, 0).exists()  # removed at close
    with MetricBus(dist=None, journal=str(journal), resume=True) as again:  # and the lock is released
        commit_steps(again, range(6, 7))


def test_a_second_writer_in_another_process_is_refused_until_it_dies(tmp_path: Path) -> None:
    """A bus in another process holds the file: refused with its PID; once it is SIGKILLed, a new writer appends."""
    journal = tmp_path / "j"
    with subprocess.Popen(
        [sys.executable, WORKERS, "hold", str(journal)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == "ready\n"
            with pytest.raises(JournalError) as refused:
                MetricBus(dist=None, journal=str(journal), resume=True)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
    assert str(rank_file(journal, 0)) in str(refused.value)
    assert f"PID {child.pid} " in str(refused.value)
    assert child.returncode == -signal.SIGKILL
    assert json.loads(lock_file(journal, 0).read_text())["pid"] == child.pid  # stale, and it must not block
    with MetricBus(dist=None, journal=str(journal), resume=True) as bus:
        live = commit_steps(bus, range(3, 6))
    got, caught = quietly_read(journal)
    assert caught == []
    assert [len(f.headers) for f in got.files] == [2]
    assert recovered(got) == {step: expected(step) for step in range(6)}
    assert live == {step: expected(step) for step in range(3, 6)}


# -- disk errors -----------------------------------------------------------------------------------------------


def test_a_full_disk_on_the_commit_of_a_new_metric_orphans_nothing(tmp_path: Path) -> None:
    """EFBIG (RLIMIT_FSIZE) 20 bytes into step 5's write, which introduces "acc": commit() raises JournalError,
    the adapters still get step 5, steps 6-14 (with "acc") are journaled, and replay recovers all but step 5 (the
    20 bytes are cut: nothing to warn about)."""
    journal = tmp_path / "j"
    done = subprocess.run(
        [sys.executable, WORKERS, "efbig", str(journal)], capture_output=True, text=True, cwd=ROOT, timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    (step, error), = report["errors"].items()
    assert step == "5"
    assert str(rank_file(journal, 0)) in error
    assert "File too large (EFBIG)" in error
    assert "step 5 is not journaled" in error
    assert [(s, m) for s, m in report["rows"]] == [(s, expected(s)) for s in range(15)]
    got, caught = quietly_read(journal)
    assert report["size"] > 0
    assert caught == []
    assert [s for s, _ in got.commits] == list(range(15))  # step 5 an empty commit ("L" frame): windows count it
    assert got.commits[5][1] == []
    assert got.gaps == [Gap(0, 5, 5)]
    assert recovered(got) == {s: expected(s) for s in range(15) if s != 5}


def test_consecutive_write_errors_are_one_gap_and_every_later_commit_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC on steps 5-7, each after 7 bytes were written: three JournalErrors, one gap 5..7; the bytes each
    failed write left are cut (the writer holds the file), so the file reads without damage."""
    journal = tmp_path / "j"
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=str(journal), adapters=[memory], strict=True)
    failing = torn_then_full(monkeypatch, rank_file(journal, 0))
    errors = {}
    size = 0
    for step in range(12):
        failing[:] = [False] if step in {5, 6, 7} else []
        if step == 5:
            size = rank_file(journal, 0).stat().st_size
        for name, value in fault_values(step):
            bus.log(name, value)
        try:
            bus.commit(step)
        except JournalError as exc:
            errors[step] = str(exc)
    monkeypatch.undo()
    bus.close()
    assert sorted(errors) == [5, 6, 7]
    assert all("No space left on device (ENOSPC)" in e and str(rank_file(journal, 0)) in e for e in errors.values())
    assert memory.rows == [(s, expected(s)) for s in range(12)]
    got, caught = quietly_read(journal)
    assert caught == []
    assert size > 0
    assert got.gaps == [Gap(0, 5, 7)]
    assert recovered(got) == {s: expected(s) for s in range(12) if s not in {5, 6, 7}}


def test_a_failed_fsync_is_a_journal_error_and_a_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsync="commit" failing (EIO) on step 2: JournalError naming EIO; the step is marked as a gap, later ones read."""
    journal = tmp_path / "j"
    bus = MetricBus(dist=None, journal=str(journal), fsync="commit")
    live = commit_steps(bus, range(2))
    real = os.fsync

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    for name, value in fault_values(2):
        bus.log(name, value)
    with pytest.raises(JournalError, match=r"cannot fsync journal file .*Input/output error \(EIO\); step 2"):
        bus.commit(2)
    monkeypatch.setattr(os, "fsync", real)
    live |= commit_steps(bus, range(3, 6))
    bus.close()
    got, caught = quietly_read(journal)
    assert caught == []
    assert got.gaps == [Gap(0, 2, 2)]  # written, but never known to be on disk
    assert recovered(got) == {s: expected(s) for s in range(6)}
    assert live == {s: expected(s) for s in range(6) if s != 2}


# -- damaged bytes ---------------------------------------------------------------------------------------------


@pytest.fixture
def run_of_20(tmp_path: Path) -> tuple[Path, dict[int, dict[str, float]]]:
    """A 20-step journal (a new metric at step 5) and what its commits returned."""
    journal = tmp_path / "j"
    with MetricBus(dist=None, journal=str(journal)) as bus:
        live = commit_steps(bus, range(20))
    return journal, live


def test_any_flipped_byte_in_the_magic_or_header_loses_nothing(
    run_of_20: tuple[Path, dict[int, dict[str, float]]],
) -> None:
    """Flipping any one byte of the magic or the first header frame: every step replays, one warning says where."""
    journal, live = run_of_20
    path = rank_file(journal, 0)
    data = path.read_bytes()
    (_, kind, size), (_, again, _), *_ = frames(data)
    assert kind == again == b"H"
    for at in range(len(MAGIC) + size):
        path.write_bytes(flipped(data, at))
        got, caught = quietly_read(journal)
        where = "damaged magic (1 bytes); read as a journal" if at < len(MAGIC) else (
            f"damaged record at byte {len(MAGIC)}; skipped {size} bytes"
        )
        assert caught == [f"journal {path}: {where}"], at
        assert recovered(got) == live == {s: expected(s) for s in range(20)}, at
        assert got.header["rank"] == 0


def test_any_flipped_byte_in_a_name_table_frame_loses_no_commit(
    run_of_20: tuple[Path, dict[int, dict[str, float]]],
) -> None:
    """Flipping any one byte of any name table frame (step 0's "loss", step 5's "acc"): every commit replays."""
    journal, live = run_of_20
    path = rank_file(journal, 0)
    data = path.read_bytes()
    names = [(pos, size) for pos, kind, size in frames(data) if kind == b"N"]
    assert len(names) == 4  # two copies each of the rows added at step 0 and at step 5
    for pos, size in names:
        for at in range(pos, pos + size):
            path.write_bytes(flipped(data, at))
            got, caught = quietly_read(journal)
            assert caught == [f"journal {path}: damaged record at byte {pos}; skipped {size} bytes"], at
            assert recovered(got) == live, at


def test_a_flipped_byte_in_a_commit_loses_that_commit_only(
    run_of_20: tuple[Path, dict[int, dict[str, float]]],
) -> None:
    """Flipping a byte inside step 3's commit frame loses step 3 and nothing else; the step is named."""
    journal, live = run_of_20
    path = rank_file(journal, 0)
    data = path.read_bytes()
    commits = [(pos, size) for pos, kind, size in frames(data) if kind in {b"S", b"R", b"P"}]
    pos, size = commits[3]
    path.write_bytes(flipped(data, pos + size // 2))
    got, caught = quietly_read(journal)
    assert caught == [
        f"journal {path}: damaged record at byte {pos}; skipped {size} bytes",
        f"journal {journal}: the file lost its commits at step 3 to damaged bytes (the steps between the commits read "
        "around them; where steps jump, some may never have been committed): their records are not replayed, so "
        "those steps are missing or hold other values than live emitted",
    ]
    assert got.holes == [Gap(0, 3, 3)]
    assert recovered(got) == {s: v for s, v in live.items() if s != 3}


# -- unreadable rank files -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "is empty (not a metricbus journal file)"),
        (b"hello, not a journal\n", "is not a metricbus journal file (bad magic)"),
        (MAGIC, "has no readable journal header"),
    ],
)
def test_an_unreadable_rank_file_is_skipped_with_a_warning(tmp_path: Path, content: bytes, why: str) -> None:
    """An empty, foreign or header-less rank-00001.mbj is reported and skipped; rank 0 replays in full."""
    journal = tmp_path / "j"
    with MetricBus(dist=None, rules=RULES, journal=str(journal)) as bus:
        live = {}
        for step in range(4):
            log_step(bus, step, 0)
            live[step] = bus.commit(step)
    bad = rank_file(journal, 1)
    bad.write_bytes(content)
    got, caught = quietly_read(journal)
    assert caught == [f"journal {bad}: skipped, the other ranks are read ({bad} {why})"]
    assert got.skipped == [(bad, f"{bad} {why}")]
    assert [f.path for f in got.files] == [rank_file(journal, 0)]
    assert recovered(got) == live


def test_a_directory_with_no_readable_file_is_an_error(tmp_path: Path) -> None:
    """Every rank file unreadable: a JournalError naming each; a single unreadable file path too."""
    rank_file(tmp_path, 0).write_bytes(b"")
    rank_file(tmp_path, 1).write_bytes(b"junk")
    with pytest.raises(JournalError, match=r"no readable journal file: .*00000.mbj is empty.*00001.mbj is not a"):
        read_journal(tmp_path)
    with pytest.raises(JournalError, match="is empty"):
        read_journal(rank_file(tmp_path, 0))


def test_losing_both_copies_of_a_name_row_costs_only_until_the_next_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both copies of step 0's name rows damaged: "loss" is lost until the next whole-table checkpoint, then back."""
    monkeypatch.setattr("metricbus.journal.writer.CHECKPOINT_BYTES", 1500)
    journal = tmp_path / "j"
    with MetricBus(dist=None, journal=str(journal)) as bus:
        live = commit_steps(bus, range(30))
    path = rank_file(journal, 0)
    data = path.read_bytes()
    table = [(pos, kind, size) for pos, kind, size in frames(data)]
    names = [i for i, (_, kind, _) in enumerate(table) if kind == b"N"]
    assert len(names) > 5  # loss twice, acc twice, then checkpoints
    first, second = (table[i][0] for i in names[:2])
    assert second == first + table[names[0]][2]  # adjacent: one damaged stretch
    damaged = flipped(flipped(data, first + 12), second + 12)
    path.write_bytes(damaged)
    checkpoint_at = table[names[4] + 1][0]
    (checkpoint_step,) = struct.unpack_from("<q", data, checkpoint_at + FRAME.size + 1)
    got, caught = quietly_read(journal)
    lost = checkpoint_step  # one "loss" summary per commit before it
    assert caught == [
        f"journal {path}: damaged record at byte {first}; skipped {second + table[names[1]][2] - first} bytes",
        f"journal {path}: {lost} entries refer to a lost name table record; skipped",
    ]
    assert 5 < checkpoint_step < 29
    want = {s: {"acc": v["acc"]} for s, v in live.items() if 5 <= s < checkpoint_step}
    want |= {s: v for s, v in live.items() if s >= checkpoint_step}
    assert recovered(got) == want


def test_a_torn_magic_is_rewritten_by_the_next_writer(tmp_path: Path) -> None:
    """A rank file holding 3 bytes of magic (its writer died writing it) is started afresh by the next writer."""
    journal = tmp_path / "j"
    journal.mkdir()
    rank_file(journal, 0).write_bytes(MAGIC[:3])
    with MetricBus(dist=None, journal=str(journal)) as bus:
        live = commit_steps(bus, range(3))
    got, caught = quietly_read(journal)
    assert caught == []
    assert recovered(got) == live


# these tests make the journal's os.write calls fail: each commit written with its own (conftest.unstaged)
pytestmark = pytest.mark.usefixtures("unstaged")
