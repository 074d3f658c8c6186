"""The journal file: format, durability modes, torn and damaged records, foreign and newer files."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalError
from metricbus.journal import FORMAT_VERSION, MAGIC, JournalWarning, rank_file, read_journal
from tests.journal_workers import RULES, log_step


def write_run(directory: Path, *, steps: int = 5, fsync: str = "interval") -> None:
    """A small single-process journaled run."""
    with MetricBus(dist=None, rules=RULES, journal=str(directory), fsync=fsync) as bus:
        for step in range(steps):
            log_step(bus, step, 0)
            bus.commit(step)


@pytest.fixture
def journal_dir(tmp_path: Path) -> Path:
    """A journal of five commits."""
    write_run(tmp_path / "journal")
    return tmp_path / "journal"


def test_header_holds_run_rules_and_version(journal_dir: Path) -> None:
    """The header records the format, metricbus version, rank, rules and log_every."""
    journal = read_journal(journal_dir)
    assert journal.header["format"] == FORMAT_VERSION == 5
    assert journal.header["metricbus"]
    assert journal.log_every == 1
    assert [p for p, _ in journal.rules] == list(RULES)
    assert [s for s, _ in journal.commits] == [0, 1, 2, 3, 4]


def test_summaries_round_trip_bitwise(tmp_path: Path) -> None:
    """The journaled summaries are the exported ones, field for field."""
    worker = MetricBus(dist=None)
    bus = MetricBus(dist=None, journal=str(tmp_path / "j"))
    for value in (0.1, 1 / 3, 1e-300, -2.5e17, float("nan")):
        worker.log("x", value)
    part = worker.export()
    bus.ingest([part])
    bus.commit(0)
    bus.close()
    (step, partials), = read_journal(tmp_path / "j").commits
    assert step == 0
    got = partials[0].entries[0][2].as_tuple()
    want = part.entries[0][2].as_tuple()
    assert struct.pack("<12d", *got) == struct.pack("<12d", *want)


@pytest.mark.parametrize("fsync", ["commit", "interval", "never"])
def test_every_fsync_mode_writes_every_commit(tmp_path: Path, fsync: str) -> None:
    """Each fsync mode journals every commit."""
    write_run(tmp_path / "j", fsync=fsync)
    assert len(read_journal(tmp_path / "j").commits) == 5


def test_invalid_fsync_lists_the_valid_modes(tmp_path: Path) -> None:
    """fsync='always' is rejected with the valid modes."""
    with pytest.raises(ValueError, match="commit, interval, never"):
        MetricBus(dist=None, journal=str(tmp_path / "j"), fsync="always")


def test_torn_last_record_is_skipped_with_a_warning(journal_dir: Path) -> None:
    """Cutting the file inside the last commit loses that commit only, with a warning."""
    path = rank_file(journal_dir, 0)
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.warns(JournalWarning, match="torn"):
        journal = read_journal(journal_dir)
    assert [s for s, _ in journal.commits] == [0, 1, 2, 3]


def test_damaged_middle_record_is_skipped_and_the_rest_recovered(journal_dir: Path) -> None:
    """A flipped byte in one commit loses that commit; later commits are still read."""
    path = rank_file(journal_dir, 0)
    data = bytearray(path.read_bytes())
    starts, pos = [], len(MAGIC)  # the frames, by the documented layout (<I length> <I crc> payload)
    while pos < len(data):
        starts.append(pos)
        pos += 8 + struct.unpack_from("<I", data, pos)[0]
    commits = [at for at in starts if bytes(data[at + 8 : at + 9]) in {b"S", b"R", b"P"}]
    data[(commits[2] + commits[3]) // 2] ^= 0xFF  # in the middle of the third commit (step 2)
    path.write_bytes(bytes(data))
    with pytest.warns(JournalWarning, match="damaged"):
        journal = read_journal(journal_dir)
    steps = [s for s, _ in journal.commits]
    assert steps == [0, 1, 3, 4]


def test_garbage_after_magic_never_crashes(tmp_path: Path) -> None:
    """Random bytes behind a valid magic raise JournalError (no header), never anything else."""
    path = tmp_path / "rank-00000.mbj"
    path.write_bytes(MAGIC + bytes(range(256)) * 8)
    with pytest.warns(JournalWarning), pytest.raises(JournalError, match="no readable journal header"):
        read_journal(tmp_path)


def test_foreign_file_is_a_journal_error(tmp_path: Path) -> None:
    """A file that is not a journal gets a clear JournalError."""
    (tmp_path / "rank-00000.mbj").write_text("hello\n")
    with pytest.raises(JournalError, match="not a metricbus journal"):
        read_journal(tmp_path)


def test_missing_journal_is_a_journal_error(tmp_path: Path) -> None:
    """A path with no journal gets a clear JournalError."""
    with pytest.raises(JournalError, match="no journal"):
        read_journal(tmp_path / "nope")


def test_newer_format_is_refused(tmp_path: Path) -> None:
    """A header with a newer format version is refused, naming the upgrade."""
    payload = b"H" + json.dumps({"format": 99}).encode()
    frame = struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    (tmp_path / "rank-00000.mbj").write_bytes(MAGIC + frame)
    with pytest.raises(JournalError, match="newer"):
        read_journal(tmp_path)


def test_restarted_writer_appends_a_new_segment(tmp_path: Path) -> None:
    """A second bus on the same journal with resume=True appends; both runs' commits are read, one run id."""
    write_run(tmp_path / "j", steps=3)
    first = read_journal(tmp_path / "j").run.id
    with pytest.raises(JournalError, match=r"already holds run .*resume=True"):
        MetricBus(dist=None, rules=RULES, journal=str(tmp_path / "j"))
    with MetricBus(dist=None, rules=RULES, journal=str(tmp_path / "j"), resume=True) as bus:
        assert bus.run.id == first
        for step in range(3, 6):
            log_step(bus, step, 0)
            bus.commit(step)
    journal = read_journal(tmp_path / "j")
    assert [s for s, _ in journal.commits] == [0, 1, 2, 3, 4, 5]
    assert len(journal.files[0].headers) == 2
    assert journal.run.id == first
    assert journal.breaks == {3}
