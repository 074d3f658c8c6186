"""Journal "P" frames of one-record commits (every count 1): only ``wsum`` stored, every field read bit for bit."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.journal import MAGIC, open_journal, rank_file, read_journal, stream_journal
from metricbus.journal.compact import COPY, ZERO
from metricbus.journal.reader import CommitRun
from metricbus.partial import Packed, Partial, from_packed, layout_of, pack
from metricbus.spec import parse_spec
from metricbus.summary import Summary

RUN = RunInfo(project="proj", name="run-1", tags=(), config={}, start_time_unix_ns=123, id="fixed")
MEAN = parse_spec("mean", metric="loss")
NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_1234))[0]  # a NaN whose payload must survive
FINITE = [0.1, 1 / 3, -0.0, 0.0, 5e-324, -2.5, 1e300, -1e-310]
ODD = [*FINITE, float("inf"), -float("inf"), NAN_PAYLOAD]
HEAD = 8 + 1 + 16 + 12 + 1 + 4 + 8  # frame, type, step n rank, codes, consecutive ids, the one count


def frames(path: Path) -> list[tuple[bytes, bytes]]:
    """``(type, payload after the type)`` of each frame of an undamaged file, in order."""
    data, pos, out = path.read_bytes(), len(MAGIC), []
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        out.append((data[pos + 8 : pos + 9], data[pos + 9 : pos + 8 + length]))
        pos += 8 + length
    return out


def commit_frames(path: Path) -> list[tuple[bytes, bytes]]:
    """The frames of the commits ("S", "R" or "P")."""
    return [(kind, body) for kind, body in frames(path) if kind in {b"S", b"R", b"P"}]


def write(directory: Path, commits: list[tuple[int, list[tuple[int, Partial]]]]) -> None:
    """Journal ``commits`` through a writer opened the way a bus opens it."""
    writer = open_journal(path=directory, fsync="never", rank=0, run=RUN, rules=[], log_every=1)
    for step, entries in commits:
        writer.append(step=step, entries=entries)
    writer.close()


def one_each(values: list[float]) -> Partial:
    """One worker's packed partial of one record per metric, ``values[i]`` for metric ``i``."""
    entries = tuple((f"m{i}", MEAN, Summary.of_batch([x], None)) for i, x in enumerate(values))
    return from_packed(pack(entries, frozenset()), frozenset())


def of_fields(fields: Any) -> Partial:
    """A packed partial of raw ``fields`` (N_FIELDS, n), any bits."""
    names = tuple(f"m{i}" for i in range(fields.shape[1]))
    specs = (MEAN,) * len(names)
    return from_packed(Packed(names, specs, fields, (), layout_of(names, specs, frozenset()), True, ()), frozenset())


def bits(partial: Partial) -> list[tuple[str, bytes]]:
    """A partial's entries as names and the exact bytes of their fields."""
    return [(name, struct.pack("<12d", *s.as_tuple())) for name, _, s in partial.entries]


def test_one_record_commits_store_only_wsum(tmp_path: Path) -> None:
    """Finite values (-0.0, a subnormal, 1e300), one record per metric: "P" frames of 8 bytes an entry whose codes
    say m2 is zero and min, max, first and last copy wsum; read back bit for bit."""
    n = 40
    commits = [(step, [(0, one_each([FINITE[(step + i) % len(FINITE)] * (i + 1) for i in range(n)]))])
               for step in range(5)]
    write(tmp_path, commits)
    written = commit_frames(rank_file(tmp_path, 0))
    assert [kind for kind, _ in written] == [b"P"] * 5
    assert {len(body) + 9 for _, body in written} == {HEAD + 8 * n}
    codes = written[0][1][16:28]
    assert list(codes[7:]) == [ZERO, COPY + 3, COPY + 3, COPY + 3, COPY + 3]
    for (_, (got,)), (_, ((_, want),)) in zip(read_journal(tmp_path).commits, commits, strict=True):
        assert bits(got) == bits(want)


def test_one_record_commits_with_infinities_or_nan_keep_every_column(tmp_path: Path) -> None:
    """An infinity or a NaN payload among one-record summaries (their m2 is NaN): the columns stay stored, and
    every commit, before and after, reads back bit for bit."""
    commits = [(step, [(0, one_each([ODD[(step + i) % len(ODD)] for i in range(6)]))]) for step in range(len(ODD))]
    write(tmp_path, commits)
    written = commit_frames(rank_file(tmp_path, 0))
    assert [kind for kind, _ in written] == [b"P"] * len(ODD)
    assert len({len(body) for _, body in written}) == 2  # with every column stored, and only wsum
    for (_, (got,)), (_, ((_, want),)) in zip(read_journal(tmp_path).commits, commits, strict=True):
        assert bits(got) == bits(want)


def test_a_bus_logging_once_per_step_writes_short_frames_and_replays_live(tmp_path: Path) -> None:
    """A bus whose metrics get one record a step journals short "P" frames; reading the journal gives the live
    commits' summaries bit for bit."""
    names = [f"group{i % 5}/metric{i}" for i in range(50)]
    live = []
    with MetricBus(dist=None, journal=str(tmp_path)) as bus:
        for step in range(6):
            values = [FINITE[(step * 7 + i) % len(FINITE)] + i for i in range(len(names))]
            for name, value in zip(names, values, strict=True):
                bus.log(name, value)
            live.append({name: struct.pack("<12d", *Summary.of_batch([v], None).as_tuple())
                         for name, v in zip(names, values, strict=True)})
            bus.commit()
    written = commit_frames(rank_file(tmp_path, 0))
    assert [kind for kind, _ in written] == [b"P"] * 6
    assert max(len(body) for _, body in written) < 12 * len(names) + 64  # 8 bytes an entry, and the head
    got = [dict(bits(partial)) for _, (partial,) in read_journal(tmp_path).commits]
    assert got == live


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    data=st.data(),
    broken=st.sampled_from([None, 4, 7, 8, 9, 10, 11]),
)
def test_count_one_fields_of_any_bits_round_trip(
    tmp_path_factory: pytest.TempPathFactory, n: int, data: st.DataObject, broken: int | None
) -> None:
    """Counts of 1 with wsum of any bits, m2 +0.0 and min .. last copies of wsum, one of those equalities (or a
    zero wsum_lo) broken in the middle commit: each commit's rows read back as the exact bytes written."""
    floats = st.floats(allow_nan=True, allow_infinity=True)
    commits = []
    for step in range(3):
        fields = np.zeros((12, n))
        fields[0:2] = 1.0
        fields[3] = data.draw(st.lists(floats, min_size=n, max_size=n))
        fields[5] = fields[3]
        fields[8:12] = fields[3]
        if broken is not None and step == 1:  # a value whose bytes differ from what the equality wants
            fields[broken, -1] = 1.5 if struct.pack("<d", fields[broken, -1]) != struct.pack("<d", 1.5) else 2.5
            fields[6] = fields[4]  # total_lo = wsum_lo, as the scheme wants
        commits.append(fields)
    directory = tmp_path_factory.mktemp("j")
    write(directory, [(step, [(0, of_fields(f))]) for step, f in enumerate(commits)])
    sizes = [len(body) + 9 for _, body in commit_frames(rank_file(directory, 0))]
    assert sizes[0] == sizes[2] == HEAD + 8 * n
    assert (sizes[1] > HEAD + 8 * n) == (broken is not None)
    got = [b"".join(p.rows.tobytes() for p in c.parts) for c in stream_journal(directory).commits()]
    assert len(got) == 3
    runs = [c for item in stream_journal(directory).runs()
            for c in (item.commits() if isinstance(item, CommitRun) else [item])]
    assert [b"".join(p.rows.tobytes() for p in c.parts) for c in runs] == got
    for raw, fields in zip(got, commits, strict=True):
        rows = np.frombuffer(raw, dtype=[("rank", "<u4"), ("id", "<u4"), ("fields", "<f8", (12,))])
        assert rows["fields"].T.tobytes() == fields.tobytes()
