"""A steady commit held in columns is journaled from its columns (``Sink.columns``), byte for byte as the general path.

Each test writes the same commits twice, through a bus as it is and through one whose writer never takes a commit in
columns (``JournalWriter.append_columns`` refused: every commit goes through its Partial), and compares the files.
"""

from __future__ import annotations

import errno
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.errors import JournalError
from metricbus.journal import Gap, JournalWriter, rank_file, read_journal
from metricbus.replay import emitted
from tests.test_journal_fast import without_headers

RUN = RunInfo(project="proj", name="hot", start_time_unix_ns=123, id="fixed")
NAMES = [f"group{i % 4}/metric{i}" for i in range(12)]  # enough metrics for an update held in columns


def log_step(bus: MetricBus, step: int) -> None:
    """Log step ``step``'s records: mostly the same metrics with fresh values (a steady commit), and now and then
    a commit that is not (fewer metrics, a new one, one record each, a weight, NaN and -0.0, two updates)."""
    rng = random.Random(step)
    kind = step % 11
    names = NAMES[:9] if kind == 5 else [*NAMES, "late/metric"] if kind == 7 else NAMES
    for name in names:
        if kind == 3:
            bus.log(name, float(step))  # one record each: only wsum is stored
        elif kind == 4:
            for value in (1.0, 2.0, 3.0):  # exact sums: wsum_lo is not stored
                bus.log(name, value)
        elif kind == 8 and name == NAMES[0]:
            bus.log(name, 2.0, weight=3.0)
        elif kind == 9 and name == NAMES[1]:
            bus.log(name, float("nan"))
            bus.log(name, -0.0)
        else:
            for _ in range(8 if step % 2 else 6):  # the count column changes from one commit to the next
                bus.log(name, rng.random() * 10.0 ** rng.randint(-3, 3))
    if kind == 10:
        bus.end_update()
        bus.log(NAMES[0], 1.5)


def general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buses built from now on journal every commit through its Partial."""
    monkeypatch.setattr(JournalWriter, "append_columns", lambda self, **_: False)


def counting(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Buses built from now on record whether each commit offered in columns was written so."""
    real = JournalWriter.append_columns
    offered: list[bool] = []

    def append_columns(self: JournalWriter, **kwargs: Any) -> bool:
        offered.append(real(self, **kwargs))
        return offered[-1]

    monkeypatch.setattr(JournalWriter, "append_columns", append_columns)
    return offered


def run(directory: Path, steps: range, *, fsync: str = "never", before: Callable[[int], None] = lambda _: None
        ) -> tuple[bytes, dict[int, dict[str, float]], dict[int, str]]:
    """Journal ``steps`` (``before(step)`` first): the file's bytes, what each commit returned, and the journal
    errors by step."""
    out, errors = {}, {}
    with MetricBus(dist=None, journal=str(directory), run=RUN, fsync=fsync) as bus:
        bus.define("group3/*", "sum")
        for step in steps:
            before(step)
            log_step(bus, step)
            try:
                out[step] = bus.commit(step)
            except JournalError as exc:
                errors[step] = str(exc).replace(str(directory), "J")
    return rank_file(directory, 0).read_bytes(), out, errors


@pytest.mark.parametrize("fsync", ["never", "commit"])
def test_commits_in_columns_are_the_bytes_of_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str
) -> None:
    """Varied commits, with name table checkpoints: the same file whether steady commits go through columns or not."""
    monkeypatch.setattr("metricbus.journal.writer.CHECKPOINT_BYTES", 4000)
    offered = counting(monkeypatch)
    fast, fast_out, _ = run(tmp_path / "fast", range(60), fsync=fsync)
    assert offered.count(True) > 20  # the columns path wrote most steady commits
    assert False in offered  # and declined some (a count column that changed scheme, names registered again)
    general_path(monkeypatch)
    slow, slow_out, _ = run(tmp_path / "slow", range(60), fsync=fsync)
    assert without_headers(fast) == without_headers(slow)
    assert repr(fast_out) == repr(slow_out)  # repr: NaN equal to NaN
    assert repr(dict(emitted(read_journal(tmp_path / "fast")))) == repr(fast_out)


def test_a_failed_write_of_a_commit_in_columns_is_a_gap_as_on_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torn write, then ENOSPC, on steady commits 13-15: JournalErrors, one gap, and the same file either way."""
    real = os.write
    state: dict[str, Any] = {"inode": None, "failing": False, "torn": False}

    def write(fd: int, data: Any) -> int:
        if state["failing"] and os.fstat(fd).st_ino == state["inode"]:
            if not state["torn"]:
                state["torn"] = True
                return real(fd, bytes(data[:7]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    def before(directory: Path) -> Callable[[int], None]:
        def fail(step: int) -> None:
            if state["inode"] is None:
                state["inode"] = rank_file(directory, 0).stat().st_ino
            state["failing"] = step in {13, 14, 15}

        return fail

    monkeypatch.setattr(os, "write", write)
    offered = counting(monkeypatch)
    fast, fast_out, fast_errors = run(tmp_path / "fast", range(30), before=before(tmp_path / "fast"))
    assert offered.count(True) > 5
    state.update(inode=None, failing=False, torn=False)
    general_path(monkeypatch)
    slow, slow_out, slow_errors = run(tmp_path / "slow", range(30), before=before(tmp_path / "slow"))
    assert sorted(fast_errors) == [13, 14, 15]
    assert all("No space left on device (ENOSPC)" in e for e in fast_errors.values())
    assert fast_errors == slow_errors
    assert without_headers(fast) == without_headers(slow)
    assert repr(fast_out) == repr(slow_out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torn write's 7 bytes were cut: nothing damaged
        journal = read_journal(tmp_path / "fast")
    assert journal.gaps == [Gap(0, 13, 15)]
    assert [s for s, _ in journal.commits] == list(range(30))  # 13-15 empty ("L" frame): windows count them
    assert [partials for s, partials in journal.commits if s in {13, 14, 15}] == [[], [], []]


def test_a_resumed_run_catches_up_before_its_first_commit_in_columns(tmp_path: Path) -> None:
    """A resumed bus whose first commit could go in columns (export() left its layout) journals it after the
    resume's catch-up, and appends to the same file."""
    journal = tmp_path / "j"
    with MetricBus(dist=None, journal=str(journal), run=RUN, rules={"*": "mean"}) as bus:
        for step in range(3):
            log_step(bus, step)
            bus.commit(step)
    with MetricBus(dist=None, journal=str(journal), rules={"*": "mean"}, resume=True) as bus:
        for name in NAMES:
            bus.log(name, 1.0)
        bus.export()  # one update of NAMES, every spec declared: the commit's own partial of the same metrics
        for name in NAMES:
            for value in (1.0, 2.0):
                bus.log(name, value)
        got = bus.commit()
    assert got == dict.fromkeys(NAMES, 1.5)
    assert [s for s, _ in read_journal(journal).commits] == [0, 1, 2, 3]


# these tests make the journal's os.write calls fail: each commit written with its own (conftest.unstaged)
pytestmark = pytest.mark.usefixtures("unstaged")
