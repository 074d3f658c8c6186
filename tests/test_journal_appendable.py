"""A bus never appends to a rank file no reader would read back: a foreign file, a magic damaged beyond what the
reader forgives, a journal of a newer format. It refuses at build, naming the file, and leaves its bytes as they
were (review finding: it appended and every commit that returned was unreadable)."""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalError, JournalWarning
from metricbus.journal import read_journal


def _journal(directory: Path) -> Path:
    bus = MetricBus(dist=None, journal=str(directory))
    bus.log("loss", 1.0)
    bus.commit(0)
    bus.close()
    return directory / "rank-00000.mbj"


def _newer(data: bytes) -> bytes:
    """``data`` with every header frame's format raised to 99."""
    out, at = bytearray(data[:8]), 8
    while at < len(data):
        length, _ = struct.unpack_from("<II", data, at)
        payload = data[at + 8 : at + 8 + length]
        at += 8 + length
        if payload[:1] == b"H":
            header = json.loads(payload[1:])
            header["format"] = 99
            payload = b"H" + json.dumps(header).encode()
        out += struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    return bytes(out)


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("kind", ["foreign", "magic", "newer"])
def test_a_file_no_reader_reads_is_refused_and_left_alone(tmp_path: Path, kind: str, resume: bool) -> None:
    directory = tmp_path / "journal"
    path = _journal(directory)
    if kind == "foreign":
        path.write_bytes(b"not a journal at all\n" * 8)
    elif kind == "magic":
        path.write_bytes(b"XYZ" + path.read_bytes()[3:])
    else:
        path.write_bytes(_newer(path.read_bytes()))
    before = path.read_bytes()
    expected = "newer than this metricbus reads" if kind == "newer" else "bad magic"
    with pytest.raises(JournalError, match=expected) as raised:
        MetricBus(dist=None, journal=str(directory), resume=resume)
    assert str(path) in str(raised.value)
    assert path.read_bytes() == before


def test_a_slightly_damaged_magic_is_still_appended_to(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    path = _journal(directory)
    path.write_bytes(b"X" + path.read_bytes()[1:])  # one byte: the reader reads it, with a warning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)
        bus = MetricBus(dist=None, journal=str(directory), resume=True)
        bus.log("loss", 2.0)
        bus.commit(1)
        bus.close()
        assert [step for step, _ in read_journal(directory).commits] == [0, 1]


def test_an_empty_or_torn_file_starts_fresh(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    directory.mkdir()
    (directory / "rank-00000.mbj").write_bytes(b"MBJ")  # a torn magic: only its writer could have cut it
    bus = MetricBus(dist=None, journal=str(directory))
    bus.log("loss", 2.0)
    bus.commit(0)
    bus.close()
    assert [step for step, _ in read_journal(directory).commits] == [0]
