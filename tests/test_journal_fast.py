"""The journal writer's steady path: commits of packed partials, written from a frame allocated once per shape.

Every test writes the same commits twice, once as packed partials (the steady path after a layout's first commit)
and once as partials of entries (the general path), and asserts the files are the same bytes: the on-disk format
does not depend on which path wrote a commit.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from metricbus.adapter import RunInfo
from metricbus.errors import JournalError
from metricbus.journal import MAGIC, Gap, open_journal, rank_file, read_journal
from metricbus.partial import Entry, Partial, from_packed, pack
from metricbus.spec import parse_spec
from metricbus.summary import Summary
from tests.test_journal_faults import torn_then_full

RUN = RunInfo(project="proj", name="run-1", tags=(), config={}, start_time_unix_ns=123, id="fixed")
MEAN = parse_spec("mean", metric="loss")
MAX = parse_spec("max", metric="loss")
SUM = parse_spec("sum", metric="tokens")
ODD = [0.1, 1 / 3, -0.0, float("inf"), float("nan"), 5e-324, -2.5e17]  # -0.0, NaN and a subnormal, bit for bit

Commits = list[tuple[int, list[tuple[int, list[Entry]]]]]


def summary(step: int, i: int) -> Summary:
    """A summary that differs per step and metric, some with odd values."""
    return Summary.of_batch([ODD[(step + i) % len(ODD)], float(step), 1.0 + i], None)


def entries(step: int, names: list[str], spec: Any = MEAN) -> list[Entry]:
    """One entry per name at ``step``."""
    return [(name, spec, summary(step, i)) for i, name in enumerate(names)]


def packed(listed: list[Entry]) -> Partial:
    """A partial held in its packed form (what a commit's own partial is)."""
    return from_packed(pack(tuple(listed), frozenset()), frozenset())


def write(directory: Path, commits: Commits, make: Callable[[list[Entry]], Partial], **kwargs: Any) -> bytes:
    """Journal ``commits`` with each partial built by ``make``; the file's bytes."""
    writer = open_journal(path=directory, fsync="never", rank=0, run=RUN, rules=[], log_every=1, **kwargs)
    for step, parts in commits:
        writer.append(step=step, entries=[(rank, make(listed)) for rank, listed in parts])
    writer.close()
    return rank_file(directory, 0).read_bytes()


def same_bytes(tmp_path: Path, commits: Commits) -> bytes:
    """Assert packed partials and partials of entries journal ``commits`` to the same bytes; return them."""
    fast = write(tmp_path / "packed", commits, packed)
    slow = write(tmp_path / "entries", commits, lambda listed: Partial(tuple(listed)))
    assert without_headers(fast) == without_headers(slow)
    return fast


def without_headers(data: bytes) -> bytes:
    """A journal file's bytes without its "H" frames (a writer's header holds the time it opened the file)."""
    out, pos = bytearray(data[: len(MAGIC)]), len(MAGIC)
    while pos + 8 <= len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        if data[pos + 8 : pos + 9] != b"H":
            out += data[pos : pos + 8 + length]
        pos += 8 + length
    return bytes(out + data[pos:])


def bits(partial: Partial) -> list[tuple[str, bytes]]:
    """A partial's entries as names and the exact bytes of their fields."""
    return [(name, struct.pack("<12d", *s.as_tuple())) for name, _, s in partial.entries]


NAMES = [f"group{i % 3}/metric{i}" for i in range(20)]


def test_steady_commits_are_the_bytes_of_the_general_path(tmp_path: Path) -> None:
    """Twenty commits of one packed layout: the same file as entries, and every field read back bit for bit."""
    commits: Commits = [(step, [(0, entries(step, NAMES))]) for step in range(20)]
    same_bytes(tmp_path, commits)
    journal = read_journal(tmp_path / "packed")
    assert [step for step, _ in journal.commits] == list(range(20))
    for (_, partials), (_, parts) in zip(journal.commits, commits, strict=True):
        assert [bits(p) for p in partials] == [bits(Partial(tuple(listed))) for _, listed in parts]


def test_shapes_that_change_are_the_bytes_of_the_general_path(tmp_path: Path) -> None:
    """Several ranks, a layout that comes back, a spec that changes (names registered again), a commit with a
    partial of entries, and one whose sums need a rest: the same file as entries throughout."""
    wide = [("tokens", SUM, Summary.of_batch([1e100, 1.0, 1e-100], None))]
    commits: Commits = [
        (0, [(0, entries(0, NAMES))]),
        (1, [(0, entries(1, NAMES))]),
        (2, [(0, entries(2, NAMES)), (3, entries(2, NAMES[:5]))]),
        (3, [(0, entries(3, NAMES)), (3, entries(3, NAMES[:5]))]),
        (4, [(0, entries(4, NAMES, MAX))]),  # the same names, another spec: registered again, new ids
        (5, [(0, entries(5, NAMES))]),
        (6, [(0, entries(6, NAMES)), (1, wide)]),
        (7, [(1, entries(7, NAMES[5:])), (0, entries(7, NAMES))]),
        (8, [(0, entries(8, NAMES))]),
        (9, []),
    ]
    same_bytes(tmp_path, commits)
    journal = read_journal(tmp_path / "packed")
    assert [step for step, _ in journal.commits] == list(range(10))  # an empty commit too
    (_, partials) = journal.commits[6]
    assert partials[1].entries[0][2].rest == wide[0][2].rest


def test_checkpoints_between_steady_commits_are_the_bytes_of_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole name table written again every ~3 commits: the same file as entries, every commit read back."""
    monkeypatch.setattr("metricbus.journal.writer.CHECKPOINT_BYTES", 2500)
    commits: Commits = [(step, [(0, entries(step, NAMES))]) for step in range(12)]
    data = same_bytes(tmp_path, commits)
    assert data.count(b'"group0/metric0"') > 4  # two copies at first, then at each checkpoint
    assert [step for step, _ in read_journal(tmp_path / "packed").commits] == list(range(12))


def test_a_failed_steady_write_is_a_gap_and_later_commits_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unstaged: None
) -> None:
    """ENOSPC after 7 bytes of step 3's frame: JournalError, a gap 3..3, the torn bytes skipped, the rest read."""
    directory = tmp_path / "j"
    writer = open_journal(path=directory, fsync="never", rank=0, run=RUN, rules=[], log_every=1)
    failing = torn_then_full(monkeypatch, rank_file(directory, 0))
    for step in range(8):
        failing[:] = [False] if step == 3 else []
        partial = packed(entries(step, NAMES))
        if step == 3:
            with pytest.raises(JournalError, match=r"No space left on device \(ENOSPC\); step 3 is not journaled"):
                writer.append(step=step, entries=[(0, partial)])
        else:
            writer.append(step=step, entries=[(0, partial)])
    monkeypatch.undo()
    writer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failed write's 7 bytes were cut: nothing damaged
        journal = read_journal(directory)
    assert journal.gaps == [Gap(0, 3, 3)]
    # step 3 is an empty commit (its "L" frame): counted where it was, so log_every windows stay the live ones
    assert [step for step, _ in journal.commits] == list(range(8))
    for step, partials in journal.commits:
        assert [bits(p) for p in partials] == ([bits(Partial(tuple(entries(step, NAMES))))] if step != 3 else [])


def test_a_partial_of_a_packed_form_is_immutable_and_equal_to_its_entries() -> None:
    """from_packed: the entries it decodes, its undeclared names as a frozenset, and no attribute can be set."""
    listed = entries(0, NAMES[:3])
    partial = from_packed(pack(tuple(listed), frozenset()), frozenset({"group0/metric0"}))
    assert partial == Partial(tuple(listed), frozenset({"group0/metric0"}))
    assert partial.undeclared == frozenset({"group0/metric0"})
    with pytest.raises(AttributeError, match="immutable"):
        partial.undeclared = frozenset()  # type: ignore[misc]
