"""Journal format 5's "P" frame: one worker's commit of unit-weight summaries, column by column, read bit for bit."""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.journal import (
    FORMAT_VERSION,
    MAGIC,
    JournalWarning,
    open_journal,
    rank_file,
    read_journal,
    stream_journal,
)
from metricbus.journal.compact import CONSECUTIVE, COPY, LISTED, SAME, STORED, ZERO, compact_rows
from metricbus.journal.reader import CommitRun
from metricbus.partial import Packed, Partial, from_packed, layout_of, pack
from metricbus.spec import parse_spec
from metricbus.summary import Summary
from tests.test_journal_fast import without_headers

RUN = RunInfo(project="proj", name="run-1", tags=(), config={}, start_time_unix_ns=123, id="fixed")
MEAN = parse_spec("mean", metric="loss")
NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_1234))[0]  # a NaN whose payload must survive
ODD = [0.1, 1 / 3, -0.0, float("inf"), NAN_PAYLOAD, 5e-324, -2.5, 1e300, -float("inf")]
NAMES = [f"group{i % 3}/metric{i}" for i in range(12)]
HEAD = struct.Struct("<qII")


def frame(kind: bytes, body: bytes) -> bytes:
    """A frame by the documented layout: <I length> <I crc32(payload)> payload."""
    payload = kind + body
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def kinds(path: Path) -> list[bytes]:
    """The type of each frame of an undamaged file, in order."""
    data, pos, out = path.read_bytes(), len(MAGIC), []
    while pos < len(data):
        out.append(data[pos + 8 : pos + 9])
        pos += 8 + struct.unpack_from("<I", data, pos)[0]
    return out


def commit_offsets(path: Path) -> list[tuple[int, int]]:
    """``(offset, size)`` of each commit frame of an undamaged file."""
    data, pos, out = path.read_bytes(), len(MAGIC), []
    while pos < len(data):
        size = 8 + struct.unpack_from("<I", data, pos)[0]
        if data[pos + 8 : pos + 9] in {b"S", b"R", b"P"}:
            out.append((pos, size))
        pos += size
    return out


def write(directory: Path, commits: list[tuple[int, list[tuple[int, Partial]]]]) -> None:
    """Journal ``commits`` through a writer opened the way a bus opens it."""
    writer = open_journal(path=directory, fsync="never", rank=0, run=RUN, rules=[], log_every=1)
    for step, entries in commits:
        writer.append(step=step, entries=entries)
    writer.close()


def unit(step: int, i: int) -> Summary:
    """A unit-weight summary without a rest that differs per step and metric, odd values (-0.0, infinities, a NaN
    payload, a subnormal) among them."""
    odd = ODD[(step + i) % len(ODD)]
    summary = Summary.of_batch([odd, float(step), 1.0 + i], None)
    return Summary.of_batch([odd], None) if summary.rest else summary


def packed(summaries: list[Summary], names: list[str] | None = None) -> Partial:
    """One worker's partial of ``summaries`` (of ``names``, by default the first of NAMES) in its packed form, as a
    commit's own partial is."""
    listed = zip(names or NAMES[: len(summaries)], summaries, strict=True)
    return from_packed(pack(tuple((name, MEAN, s) for name, s in listed), frozenset()), frozenset())


def of_fields(fields: Any, names: list[str]) -> Partial:
    """A packed partial of raw ``fields`` (N_FIELDS, n), any bits."""
    specs = (MEAN,) * len(names)
    layout = layout_of(tuple(names), specs, frozenset())
    return from_packed(Packed(tuple(names), specs, fields, (), layout, True, ()), frozenset())


def bits(partial: Partial) -> list[tuple[str, bytes, bytes]]:
    """A partial's entries as names and the exact bytes of their fields and rests."""
    out = []
    for name, _, s in partial.entries:
        rest = s.rest_flat()
        out.append((name, struct.pack("<12d", *s.as_tuple()), struct.pack(f"<{len(rest)}d", *rest)))
    return out


def rows_read(directory: Path) -> list[tuple[int, bytes]]:
    """Each commit's step and the bytes of its rows, as the stream reads them one commit at a time."""
    return [(c.step, b"".join(p.rows.tobytes() for p in c.parts)) for c in stream_journal(directory).commits()]


def test_one_workers_unit_commits_are_p_frames_read_bit_for_bit(tmp_path: Path) -> None:
    """Unit-weight summaries of one worker (-0.0, infinities, a NaN payload, a subnormal): "P" frames, about half
    an "S" frame's bytes, read back bit for bit."""
    commits = [(step, [(0, packed([unit(step, i) for i in range(len(NAMES))]))]) for step in range(6)]
    write(tmp_path, commits)
    path = rank_file(tmp_path, 0)
    assert [k for k in kinds(path) if k in {b"S", b"R", b"P"}] == [b"P"] * 6
    sizes = {size for _, size in commit_offsets(path)}
    assert max(sizes) < 0.65 * (8 + 1 + 12 + 104 * len(NAMES))  # an "S" frame: 104 bytes an entry
    journal = read_journal(tmp_path)
    assert journal.header["format"] == FORMAT_VERSION == 5
    assert [step for step, _ in journal.commits] == list(range(6))
    for (_, (got,)), (_, ((_, want),)) in zip(journal.commits, commits, strict=True):
        assert bits(got) == bits(want)


def test_packed_and_listed_partials_write_the_same_p_frames(tmp_path: Path) -> None:
    """A partial of entries (the general path) and a packed one (the steady path) give the same file."""
    listed = [[("loss" if i == 0 else NAMES[i], MEAN, unit(step, i)) for i in range(5)] for step in range(4)]
    write(tmp_path / "packed", [(s, [(0, from_packed(pack(tuple(e), frozenset()), frozenset()))])
                                for s, e in enumerate(listed)])
    write(tmp_path / "listed", [(s, [(0, Partial(tuple(e)))]) for s, e in enumerate(listed)])
    data = rank_file(tmp_path / "packed", 0).read_bytes()
    assert without_headers(data) == without_headers(rank_file(tmp_path / "listed", 0).read_bytes())
    assert kinds(rank_file(tmp_path / "packed", 0)).count(b"P") == 4


def test_commits_outside_the_scheme_keep_s_and_r_frames(tmp_path: Path) -> None:
    """A weighted summary, a rest, or two workers in one commit: "S" or "R" frames, read back bit for bit."""
    weighted = Summary.of_batch([1.0, 2.0, -0.0], [0.5, 2.0, 1.0])
    wide = Summary.of_batch([1e100, 1.0, 1e-100], None)
    plain = [unit(0, i) for i in range(4)]
    commits = [
        (0, [(0, packed(plain))]),
        (1, [(0, packed([*plain[:3], weighted]))]),
        (2, [(0, packed([*plain[:3], wide]))]),
        (3, [(0, packed(plain)), (1, packed(plain))]),
        (4, [(0, packed(plain))]),
    ]
    write(tmp_path, commits)
    assert [k for k in kinds(rank_file(tmp_path, 0)) if k in {b"S", b"R", b"P"}] == [b"P", b"S", b"R", b"S", b"P"]
    for (_, got), (_, want) in zip(read_journal(tmp_path).commits, commits, strict=True):
        assert [bits(p) for p in got] == [bits(p) for _, p in want]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    data=st.data(),
    same_count=st.booleans(),
    zero_lo=st.sampled_from(["zero", "negative zero", "values"]),
    broken=st.sampled_from([None, 1, 2, 5, 6]),
)
def test_any_fields_round_trip_bit_for_bit(  # noqa: PLR0917  (hypothesis passes what it draws by name)
    tmp_path_factory: pytest.TempPathFactory, n: int, data: st.DataObject, same_count: bool, zero_lo: str,
    broken: int | None,
) -> None:
    """Fields of any bits, the scheme holding or one of its equalities broken (then an "S" frame): each commit's
    rows read back as the exact bytes written, one commit at a time and as runs."""
    floats = st.floats(allow_nan=True, allow_infinity=True)
    counts = data.draw(st.lists(st.integers(1, 2**40), min_size=n, max_size=n))
    commits = []
    for step in range(3):
        fields = np.array([data.draw(st.lists(floats, min_size=n, max_size=n)) for _ in range(12)])
        fields[0] = counts[0] if same_count else counts
        fields[1] = fields[0]
        fields[2] = 0.0
        fields[4] = {"zero": 0.0, "negative zero": -0.0, "values": fields[4]}[zero_lo]
        fields[5:7] = fields[3:5]
        if broken is not None and step == 1:
            fields[broken, -1] = 1.5 if fields[broken, -1] != 1.5 else 2.5
        commits.append(fields)
    directory = tmp_path_factory.mktemp("j")
    names = [f"m{i}" for i in range(n)]
    write(directory, [(step, [(0, of_fields(f, names))]) for step, f in enumerate(commits)])
    got = rows_read(directory)
    assert [step for step, _ in got] == [0, 1, 2]
    for (_, raw), fields in zip(got, commits, strict=True):
        rows = np.frombuffer(raw, dtype=[("rank", "<u4"), ("id", "<u4"), ("fields", "<f8", (12,))])
        assert rows["fields"].T.tobytes() == fields.tobytes()
        assert rows["rank"].tolist() == [0] * n
    runs = [c for item in stream_journal(directory).runs()
            for c in (item.commits() if isinstance(item, CommitRun) else [item])]
    assert [(c.step, b"".join(p.rows.tobytes() for p in c.parts)) for c in runs] == got


def test_every_column_code_reads_back() -> None:
    """A hand-built "P" body using every code: stored, zero, one value for all, a copy of an earlier column."""
    n = 3
    codes = [SAME, COPY + 0, ZERO, STORED, STORED, COPY + 3, COPY + 4, STORED, SAME, ZERO, COPY + 7, STORED]
    stored = {3: [1.0, -0.0, NAN_PAYLOAD], 4: [0.5, 0.25, 5e-324], 7: [2.0, 3.0, 4.0], 11: [9.0, -9.0, 1e300]}
    same = {0: 7.0, 8: -float("inf")}
    body = HEAD.pack(11, n, 4) + bytes(codes) + bytes((LISTED,)) + struct.pack("<3I", 5, 9, 2)
    for i, code in enumerate(codes):
        if code == STORED:
            body += struct.pack("<3d", *stored[i])
        elif code == SAME:
            body += struct.pack("<d", same[i])
    step, rows = compact_rows(body)
    want = np.empty((12, n))
    for i, code in enumerate(codes):
        if code in {STORED, SAME}:
            want[i] = stored[i] if code == STORED else same[i]
        else:
            want[i] = 0.0 if code == ZERO else want[code - COPY]
    want[3, 2], want[5, 2] = NAN_PAYLOAD, NAN_PAYLOAD  # numpy keeps the bits of what it copies
    assert step == 11
    assert rows["rank"].tolist() == [4, 4, 4]
    assert rows["id"].tolist() == [5, 9, 2]
    assert rows["fields"].T.tobytes() == want.tobytes()


def test_consecutive_ids_are_written_as_the_first_one(tmp_path: Path) -> None:
    """A layout whose names have consecutive ids (a bus's first commit) stores its first id alone; another layout
    (a name added later) lists its ids; both read back with their names."""
    commits = [
        (0, [(0, packed([unit(0, i) for i in range(4)]))]),
        (1, [(0, packed([unit(1, i) for i in range(5)], [NAMES[0], "new", *NAMES[1:4]]))]),
        (2, [(0, packed([unit(2, i) for i in range(4)]))]),
    ]
    write(tmp_path, commits)
    data = rank_file(tmp_path, 0).read_bytes()
    heads = [data[pos + 9 + 8 : pos + 9 + 8 + 8 + 12 + 1] for pos, _ in commit_offsets(rank_file(tmp_path, 0))]
    assert [head[-1] for head in heads] == [CONSECUTIVE, LISTED, CONSECUTIVE]
    for (_, (got,)), (_, ((_, want),)) in zip(read_journal(tmp_path).commits, commits, strict=True):
        assert bits(got) == bits(want)


def test_inconsistent_p_frames_are_skipped_with_a_warning(tmp_path: Path) -> None:
    """"P" frames with a valid CRC but a bad column or ids code, a wrong length or a count that is not finite are
    unreadable records: skipped with a warning each; the commits around them read."""
    write(tmp_path, [(0, [(0, packed([unit(0, i) for i in range(3)]))])])
    path = rank_file(tmp_path, 0)
    codes = bytes([STORED] * 12)

    def body(step: int, codes: bytes, doubles: list[float], ids_code: int = LISTED) -> bytes:
        head = HEAD.pack(step, 1, 0) + codes + bytes((ids_code,)) + struct.pack("<I", 0)
        return head + struct.pack(f"<{len(doubles)}d", *doubles)

    bad = [
        body(1, codes[:5] + bytes([COPY + 5]) + codes[6:], [1.0] * 11),  # a copy of itself
        body(2, codes, [1.0] * 11),  # one double short
        body(3, codes, [float("nan"), *[1.0] * 11]),  # the count
        body(3, codes, [1.0] * 12, ids_code=7),
    ]
    last = body(4, bytes([SAME, COPY, ZERO, STORED, ZERO, COPY + 3, COPY + 4, *[STORED] * 5]), [2.0] * 7)
    path.write_bytes(path.read_bytes() + b"".join(frame(b"P", b) for b in bad) + frame(b"P", last))
    with pytest.warns(JournalWarning, match="unreadable") as caught:
        journal = read_journal(tmp_path)
    assert len([w for w in caught if "unreadable" in str(w.message)]) == 4
    assert [step for step, _ in journal.commits] == [0, 4]
    assert journal.files[0].damaged == 4
    (_, (part,)) = journal.commits[1]
    assert part.entries[0][2].as_tuple() == (2, 2.0, 0.0, 2.0, 0.0, 2.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0)


def test_a_torn_p_frame_is_skipped_with_a_warning(tmp_path: Path) -> None:
    """The last "P" frame cut short (a write torn by a crash): a warning, every earlier commit read."""
    commits = [(step, [(0, packed([unit(step, i) for i in range(4)]))]) for step in range(5)]
    write(tmp_path, commits)
    path = rank_file(tmp_path, 0)
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.warns(JournalWarning, match="torn"):
        journal = read_journal(tmp_path)
    assert [step for step, _ in journal.commits] == [0, 1, 2, 3]
    for (_, (got,)), (_, ((_, want),)) in zip(journal.commits, commits[:4], strict=True):
        assert bits(got) == bits(want)


def test_a_flipped_byte_in_a_p_frame_loses_that_commit_only(tmp_path: Path) -> None:
    """A flipped byte inside step 2's "P" frame: that commit is skipped with a warning, the others read."""
    commits = [(step, [(0, packed([unit(step, i) for i in range(4)]))]) for step in range(5)]
    write(tmp_path, commits)
    path = rank_file(tmp_path, 0)
    data = bytearray(path.read_bytes())
    pos, size = commit_offsets(path)[2]
    data[pos + size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(JournalWarning) as caught:
        journal = read_journal(tmp_path)
    assert "damaged record" in str(caught[0].message)
    assert "the file lost its commits at step 2 to damaged bytes" in str(caught[1].message)
    assert [step for step, _ in journal.commits] == [0, 1, 3, 4]


def test_runs_of_p_frames_read_as_their_commits(tmp_path: Path) -> None:
    """A live bus's commits of one shape come as runs; two layouts of one length alternating (their heads differ)
    are read one at a time; both as the commits read one by one."""
    with MetricBus(dist=None, journal=str(tmp_path / "one")) as bus:
        for step in range(40):
            for i, name in enumerate(NAMES):
                bus.log(name, float(step * i) / 7)
            bus.commit(step)
    items = list(stream_journal(tmp_path / "one").runs())
    assert any(isinstance(item, CommitRun) and len(item.steps) > 10 for item in items)
    expanded = [c for item in items for c in (item.commits() if isinstance(item, CommitRun) else [item])]
    assert [(c.step, b"".join(p.rows.tobytes() for p in c.parts)) for c in expanded] == rows_read(tmp_path / "one")
    other = [f"eval/{name}" for name in NAMES]
    write(tmp_path / "two", [(step, [(0, packed([unit(step, i) for i in range(12)], NAMES if step % 2 else other))])
                             for step in range(12)])
    items = list(stream_journal(tmp_path / "two").runs())
    assert not any(isinstance(item, CommitRun) for item in items[2:])  # after the names: alternating heads
    expanded = [c for item in items for c in (item.commits() if isinstance(item, CommitRun) else [item])]
    assert [(c.step, b"".join(p.rows.tobytes() for p in c.parts)) for c in expanded] == rows_read(tmp_path / "two")


def test_a_format4_file_is_read_and_appended_in_format5(tmp_path: Path) -> None:
    """A format-4 file ("S" frames only) reads bit for bit; a current writer appends a format-5 segment of "P"
    frames to it, and both segments read."""
    header = {"format": 4, "metricbus": "0.4.0", "rank": 0, "run": {"project": "four", "name": None, "tags": [],
              "config": {}, "start_time_unix_ns": 9, "id": "r4"}, "rules": [], "log_every": 1}
    table = [[0, "loss", {"chains": [["mean"] * 4 + [""]], "nan": None}]]
    old = [unit(0, 0), unit(1, 0)]
    data = MAGIC + frame(b"H", json.dumps(header).encode()) * 2 + frame(b"N", json.dumps(table).encode()) * 2
    for step, summary in enumerate(old):
        data += frame(b"S", struct.pack("<qI", step, 1) + struct.pack("<II12d", 0, 0, *summary.as_tuple()))
    rank_file(tmp_path, 0).write_bytes(data)
    new = [(step, [(0, packed([unit(step, 0)], ["loss"]))]) for step in (2, 3)]
    write(tmp_path, new)
    assert kinds(rank_file(tmp_path, 0))[-2:] == [b"P", b"P"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        journal = read_journal(tmp_path)
    assert [h["format"] for h in journal.files[0].headers] == [4, FORMAT_VERSION]
    assert [step for step, _ in journal.commits] == [0, 1, 2, 3]
    want = [*(Partial((("loss", MEAN, s),)) for s in old), *(p for _, ((_, p),) in new)]
    assert [bits(p) for _, (p,) in journal.commits] == [bits(p) for p in want]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cut=st.booleans(), flips=st.integers(0, 3))
def test_damaged_p_runs_read_as_their_commits_one_at_a_time(
    tmp_path_factory: pytest.TempPathFactory, seed: int, cut: bool, flips: int
) -> None:
    """Runs of "P" frames with flipped bytes and a torn end, read 1 KiB at a time: runs() holds what commits()
    holds, and read_journal the same steps."""
    rng = np.random.default_rng(seed)
    directory = tmp_path_factory.mktemp("j")
    names = [f"m{i}" for i in range(int(rng.integers(1, 9)))]
    write(directory, [(step, [(0, packed([unit(step, i) for i in range(len(names))], names))]) for step in range(30)])
    path = rank_file(directory, 0)
    data = bytearray(path.read_bytes())
    start = commit_offsets(path)[0][0]
    for at in rng.integers(start, len(data), size=flips).tolist():
        data[at] ^= 0xFF
    path.write_bytes(bytes(data[: -int(rng.integers(1, 20))] if cut else data))
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr("metricbus.journal.frames.CHUNK", 1 << 10)
        warnings.simplefilter("ignore", JournalWarning)
        one = rows_read(directory)
        items = list(stream_journal(directory).runs())
        steps = [step for step, _ in read_journal(directory).commits]
    expanded = [c for item in items for c in (item.commits() if isinstance(item, CommitRun) else [item])]
    assert [(c.step, b"".join(p.rows.tobytes() for p in c.parts)) for c in expanded] == one
    assert steps == [step for step, _ in one]
