"""Journal format 2: several updates per commit, exact-sum rests in one frame, format-1 files read as written."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus._version import __version__
from metricbus.adapter import RunInfo
from metricbus.errors import JournalError
from metricbus.journal import FORMAT_VERSION, MAGIC, JournalWarning, open_journal, rank_file, read_journal
from metricbus.partial import Partial
from metricbus.spec import Chain, Spec, parse_spec
from metricbus.summary import Summary

RUN = RunInfo(project="proj", name="run-1", tags=("a",), config={"lr": 0.1}, start_time_unix_ns=123)
MEAN = parse_spec("mean", metric="loss")
SUM = parse_spec("sum", metric="tokens")
RULES = [("loss", MEAN), ("tok*", SUM)]
# Batches whose exact sums need more than a hi/lo pair (terms far apart in magnitude), and plain ones.
WIDE = [[1e100, 1.0, 1e-100], [2.0**70, 1.0, 2.0**-70, 3.0], [1e50, -1e-50, 7.0]]
PLAIN = [[0.1, 1 / 3, 2.5], [1e8 + 0.001, -2.0], [float("nan"), 1.0], [5.0]]


def summary_of(values: list[float]) -> Summary:
    """A micro-level summary of ``values`` (unit weights)."""
    return Summary.of_batch(values, None)


def bits(entries: tuple[tuple[str, Spec, Summary], ...]) -> list[tuple[str, Spec, bytes, bytes]]:
    """Entries with each Summary as its exact bytes (NaN-safe): the 12 fields, then the rest."""
    out = []
    for name, spec, summary in entries:
        rest = summary.rest_flat()
        out.append((name, spec, struct.pack("<12d", *summary.as_tuple()), struct.pack(f"<{len(rest)}d", *rest)))
    return out


def write(directory: Path, commits: list[tuple[int, list[tuple[int, Partial]]]], *, rank: int = 0) -> None:
    """Journal ``commits`` through a writer opened the way a bus opens it."""
    writer = open_journal(path=directory, fsync="never", rank=rank, run=RUN, rules=RULES, log_every=2)
    for step, entries in commits:
        writer.append(step=step, entries=entries)
    writer.close()


def frame(kind: bytes, body: bytes) -> bytes:
    """A frame by the documented layout: <I length> <I crc32(payload)> payload."""
    payload = kind + body
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def test_header_holds_the_version_stable_keys(tmp_path: Path) -> None:
    """open_journal's header holds format 5, the version, rank, run, rules and log_every."""
    write(tmp_path, [(0, [(5, Partial((("loss", MEAN, summary_of([1.0])),)))])], rank=5)
    journal = read_journal(tmp_path)
    assert {"format", "metricbus", "rank", "run", "rules", "log_every"} <= set(journal.header)
    assert (journal.header["format"], journal.header["metricbus"], journal.header["rank"]) == (5, __version__, 5)
    assert journal.run == RUN
    assert journal.rules == RULES
    assert journal.log_every == 2
    assert rank_file(tmp_path, 5).exists()


def test_repeated_names_keep_every_entry_in_order(tmp_path: Path) -> None:
    """A partial with one entry per optimizer update of a name reads back exactly, in update order, per rank."""
    worker0 = Partial((
        ("loss", MEAN, summary_of(PLAIN[0])),
        ("tokens", SUM, summary_of([3.0, 4.0])),
        ("loss", MEAN, summary_of(PLAIN[1])),
        ("loss", MEAN, summary_of(PLAIN[2])),
        ("tokens", SUM, summary_of([5.0])),
    ))
    worker1 = Partial((("loss", MEAN, summary_of(PLAIN[3])), ("loss", MEAN, summary_of([-1.0, 2.0]))))
    write(tmp_path, [(7, [(0, worker0), (1, worker1)]), (8, [(0, worker1), (1, worker0)])])
    commits = read_journal(tmp_path).commits
    assert [step for step, _ in commits] == [7, 8]
    for (_, partials), want in zip(commits, [(worker0, worker1), (worker1, worker0)], strict=True):
        assert [bits(p.entries) for p in partials] == [bits(w.entries) for w in want]


def test_a_name_whose_spec_changes_within_a_commit_keeps_both(tmp_path: Path) -> None:
    """Two entries of one name with different specs in one commit each keep their own spec."""
    part = Partial((("x", MEAN, summary_of([1.0])), ("x", SUM, summary_of([2.0])), ("x", MEAN, summary_of([3.0]))))
    write(tmp_path, [(0, [(0, part)]), (1, [(0, part)])])
    for _, (got,) in read_journal(tmp_path).commits:
        assert bits(got.entries) == bits(part.entries)


def test_rests_round_trip_bit_for_bit(tmp_path: Path) -> None:
    """Summaries whose exact sums need a rest read back with the same fields and rest, bit for bit."""
    wide = [summary_of(v) for v in WIDE]
    merged = wide[0].merge(summary_of(PLAIN[0])).merge(wide[1])
    assert all(s.rest_flat() for s in (*wide, merged))  # the data does exercise the rest
    part = Partial((
        ("loss", MEAN, summary_of(PLAIN[0])),
        ("loss", MEAN, wide[0]),
        ("tokens", SUM, merged),
        ("loss", MEAN, summary_of(PLAIN[2])),
        ("tokens", SUM, wide[2]),
    ))
    write(tmp_path, [(0, [(0, part), (1, Partial((("loss", MEAN, wide[1]),)))])])
    (_, (got0, got1)), = read_journal(tmp_path).commits
    assert bits(got0.entries) == bits(part.entries)
    assert bits(got1.entries) == bits((("loss", MEAN, wide[1]),))


def test_a_torn_commit_with_rests_is_lost_whole(tmp_path: Path) -> None:
    """Cutting a commit that has rests loses the commit, never its rests alone (one frame, one CRC)."""
    plain = Partial((("loss", MEAN, summary_of(PLAIN[0])),))
    wide = Partial((("loss", MEAN, summary_of(WIDE[0])),))
    write(tmp_path, [(0, [(0, plain)]), (1, [(0, wide)])])
    path = rank_file(tmp_path, 0)
    data, at, last = path.read_bytes(), len(MAGIC), 0
    while at < len(data):  # the last commit frame (a "W" frame naming the window's steps follows it)
        length = struct.unpack_from("<I", data, at)[0]
        last = at if data[at + 8 : at + 9] in (b"S", b"R", b"P") else last
        at += 8 + length
    path.write_bytes(data[: last + 12])  # cut inside it
    with pytest.warns(JournalWarning, match="torn"):
        commits = read_journal(tmp_path).commits
    assert [step for step, _ in commits] == [0]


summaries = st.sampled_from([*WIDE, *PLAIN]).map(summary_of)
partials = st.lists(st.tuples(st.sampled_from(["loss", "tokens", "grad/norm"]), summaries), max_size=6).map(
    lambda items: Partial(tuple((name, SUM if name == "tokens" else MEAN, s) for name, s in items))
)


@settings(max_examples=40, deadline=None)
@given(commits=st.lists(st.lists(partials, min_size=1, max_size=3), min_size=1, max_size=4))
def test_any_commits_round_trip(tmp_path_factory: pytest.TempPathFactory, commits: list[list[Partial]]) -> None:
    """Any commits of any partials (names repeated or not, with or without rests) read back entry for entry."""
    directory = tmp_path_factory.mktemp("j")
    write(directory, [(step, list(enumerate(parts))) for step, parts in enumerate(commits)])
    got = read_journal(directory).commits
    assert [step for step, _ in got] == list(range(len(commits)))
    for (_, read), parts in zip(got, commits, strict=True):
        want = [p for p in parts if p.entries]  # a worker with nothing logged writes no entry
        assert [bits(p.entries) for p in read] == [bits(p.entries) for p in want]


# -- format 1 --------------------------------------------------------------------------------------------------


def write_format1(path: Path, commits: list[tuple[int, list[tuple[int, str, Summary]]]]) -> None:
    """A format-1 file, byte for byte as metricbus 0.1 wrote it: four-level chains, "S" frames only."""
    names = {"loss": 0, "tokens": 1}
    header = {"format": 1, "metricbus": "0.1.0", "rank": 0, "run": {"project": "old", "name": None, "tags": [],
              "config": {}, "start_time_unix_ns": 9}, "rules": [["loss", {"chains": [["mean"] * 3 + [""]],
              "nan": None}]], "log_every": 1}
    table = [[0, "loss", {"chains": [["mean", "mean", "mean", ""]], "nan": None}],
             [1, "tokens", {"chains": [["sum", "mean", "max", "x"], ["sum", "sum", "sum", "y"]], "nan": "ignore"}]]
    data = MAGIC + frame(b"H", json.dumps(header).encode()) + frame(b"N", json.dumps(table).encode())
    for step, rows in commits:
        body = struct.pack("<qI", step, len(rows))
        for rank, name, summary in rows:
            body += struct.pack("<II12d", rank, names[name], *summary.as_tuple())
        data += frame(b"S", body)
    path.write_bytes(data)


def test_format1_file_is_read(tmp_path: Path) -> None:
    """A format-1 file reads with its four-level chains as update = micro, and its summaries bit for bit."""
    rows = [(0, "loss", summary_of(PLAIN[0])), (0, "tokens", summary_of([1.0, 2.0])), (1, "loss", summary_of([4.0]))]
    write_format1(rank_file(tmp_path, 0), [(0, rows), (1, rows[:1])])
    journal = read_journal(tmp_path)
    assert journal.header["format"] == 1
    assert journal.run.project == "old"
    assert journal.rules == [("loss", MEAN)]
    assert journal.metrics()["tokens"] == Spec(
        (Chain("sum", "sum", "mean", "max", "x"), Chain("sum", "sum", "sum", "sum", "y")), "ignore"
    )
    (_, (p0, p1)), (_, (only,)) = journal.commits
    specs = {"loss": MEAN, "tokens": journal.metrics()["tokens"]}
    assert bits(p0.entries) == bits(tuple((n, specs[n], s) for _, n, s in rows[:2]))
    assert bits(p1.entries) == bits(((rows[2][1], MEAN, rows[2][2]),))
    assert bits(only.entries) == bits(((rows[0][1], MEAN, rows[0][2]),))


def test_format1_file_appended_by_a_current_writer(tmp_path: Path) -> None:
    """A run restarted after an upgrade appends a current-format segment to its format-1 file; both are read."""
    write_format1(rank_file(tmp_path, 0), [(0, [(0, "loss", summary_of([1.0]))])])
    write(tmp_path, [(1, [(0, Partial((("loss", MEAN, summary_of(WIDE[0])),)))])])
    journal = read_journal(tmp_path)
    assert [h["format"] for h in journal.files[0].headers] == [1, FORMAT_VERSION]
    assert [step for step, _ in journal.commits] == [0, 1]
    assert journal.commits[1][1][0].entries[0][2].rest_flat() == summary_of(WIDE[0]).rest_flat()


# -- format 2 --------------------------------------------------------------------------------------------------


def test_format2_file_is_read(tmp_path: Path) -> None:
    """A format-2 file (one header, each name table row once, no gap frames) reads bit for bit, rests included."""
    header = {"format": 2, "metricbus": "0.2.0", "rank": 0, "run": {"project": "two", "name": None, "tags": [],
              "config": {}, "start_time_unix_ns": 9}, "rules": [], "log_every": 1}
    table = [[0, "loss", {"chains": [["mean"] * 4 + [""]], "nan": None}],
             [1, "tokens", {"chains": [["sum"] * 4 + [""]], "nan": None}]]
    wide, plain = summary_of(WIDE[0]), summary_of(PLAIN[0])
    rest = wide.rest_flat()
    body = struct.pack("<qI", 0, 2) + struct.pack("<II12d", 0, 0, *plain.as_tuple())
    body += struct.pack("<II12d", 1, 1, *wide.as_tuple()) + struct.pack(f"<III{len(rest)}d", 1, 1, len(rest), *rest)
    one = struct.pack("<qI", 1, 1) + struct.pack("<II12d", 0, 1, *plain.as_tuple())
    data = MAGIC + frame(b"H", json.dumps(header).encode()) + frame(b"N", json.dumps(table).encode())
    rank_file(tmp_path, 0).write_bytes(data + frame(b"R", body) + frame(b"S", one))
    journal = read_journal(tmp_path)
    assert (journal.header["format"], len(journal.files[0].headers), journal.gaps) == (2, 1, [])
    (_, (p0, p1)), (_, (only,)) = journal.commits
    assert bits(p0.entries) == bits((("loss", MEAN, plain),))
    assert bits(p1.entries) == bits((("tokens", SUM, wide),))
    assert bits(only.entries) == bits((("tokens", SUM, plain),))


# -- damaged and future frames -------------------------------------------------------------------------------------


def test_inconsistent_commit_frame_is_skipped_with_a_warning(tmp_path: Path) -> None:
    """A commit frame whose length disagrees with its entry count (valid CRC) is skipped, the rest is read."""
    write(tmp_path, [(0, [(0, Partial((("loss", MEAN, summary_of([1.0])),)))])])
    path = rank_file(tmp_path, 0)
    bad = struct.pack("<qI", 1, 2) + struct.pack("<II12d", 0, 0, *summary_of([2.0]).as_tuple())
    bad_rest = struct.pack("<qI", 2, 0) + struct.pack("<III3d", 1, 0, 2, 1.0, 2.0, 3.0)  # rest of a missing entry
    path.write_bytes(path.read_bytes() + frame(b"S", bad) + frame(b"R", bad_rest))
    with pytest.warns(JournalWarning, match="unreadable"):
        journal = read_journal(tmp_path)
    assert [step for step, _ in journal.commits] == [0]
    assert journal.files[0].damaged == 2


def test_name_table_fields_added_later_are_ignored(tmp_path: Path) -> None:
    """Name table rows with more than [id, name, spec] (a later minor version) still read."""
    write(tmp_path, [])
    path = rank_file(tmp_path, 0)
    table = [[0, "loss", {"chains": [["mean"] * 4 + [""]], "nan": None}, {"future": True}]]
    body = struct.pack("<qI", 0, 1) + struct.pack("<II12d", 0, 0, *summary_of([math.pi]).as_tuple())
    path.write_bytes(path.read_bytes() + frame(b"N", json.dumps(table).encode()) + frame(b"S", body))
    (_, (part,)), = read_journal(tmp_path).commits
    assert bits(part.entries) == bits((("loss", MEAN, summary_of([math.pi])),))


def test_header_that_is_not_an_object_is_skipped(tmp_path: Path) -> None:
    """A header frame holding JSON that is not an object is a damaged record, never a crash."""
    (tmp_path / "rank-00000.mbj").write_bytes(MAGIC + frame(b"H", b"[1, 2]"))
    with pytest.warns(JournalWarning, match="unreadable"), pytest.raises(JournalError, match="no readable"):
        read_journal(tmp_path)
