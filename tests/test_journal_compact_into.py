"""A steady commit's "P" frame built straight into the journal's stage (the compiled ``compact_into``, called by
``CompactFrame.frame_into``): the bytes of ``CompactFrame.frame``, or nothing written where that code must build it;
a bus's journal is the same file, byte for byte, with and without it."""

from __future__ import annotations

import mmap
import random
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import MetricBus
from metricbus.journal import compact, rank_file, read_journal, stage
from metricbus.journal.compact import CompactFrame
from metricbus.native import speedups
from metricbus.summary import N_FIELDS
from tests.test_journal_compact import NAN_PAYLOAD
from tests.test_journal_fast import without_headers

pytestmark = pytest.mark.skipif(speedups is None, reason="metricbus._speedups not built or turned off")
TARGET = 1 << 16


def _fields(rng: random.Random, *, n: int, counts: list[float], zero_lo: str, single: bool, broken: int | None) -> Any:
    """A (N_FIELDS, n) commit whose columns follow the "P" scheme (``broken``: that column's last entry made to
    break it), with odd values: -0.0, infinities, a NaN payload, a subnormal."""
    odd = [0.1, -0.0, float("inf"), -float("inf"), NAN_PAYLOAD, 5e-324, 1e300, -2.5]
    fields = np.array([[rng.choice(odd) if rng.random() < 0.3 else rng.uniform(-9, 9) for _ in range(n)]
                       for _ in range(N_FIELDS)])
    fields[0] = counts
    fields[1] = fields[0]
    fields[2] = 0.0
    fields[4] = {"zero": 0.0, "negative zero": -0.0, "values": fields[4]}[zero_lo]
    fields[5:7] = fields[3:5]
    if single:  # one record each: m2 +0.0, min = max = first = last = wsum
        fields[7] = 0.0
        fields[8:12] = fields[3]
    if broken is not None:
        fields[broken, -1] = 1.5 if fields[broken, -1] != 1.5 else 2.5
    return fields


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 40),
    same_count=st.booleans(),
    zero_lo=st.sampled_from(["zero", "negative zero", "values"]),
    single=st.booleans(),
    broken=st.sampled_from([None, 1, 2, 5, 6, 7, 8, 11]),
    where=st.integers(0, 100),
)
def test_frame_into_writes_the_frames_bytes(  # noqa: PLR0917  (hypothesis passes what it draws by name)
    seed: int, n: int, same_count: bool, zero_lo: str, single: bool, broken: int | None, where: int
) -> None:
    """Over commits of every scheme (the count the same or not, wsum_lo zero or not, one record each or not, one
    equality broken): where ``frame`` builds the frame with the count it holds, ``frame_into`` writes exactly its
    bytes and nothing else; where ``frame`` returns None or must recount, ``frame_into`` writes nothing."""
    rng = random.Random(seed)
    counts = [1.0] * n if single else [float(rng.choice([2, 8, 2**40])) for _ in range(n)]
    if same_count:
        counts = [counts[0]] * n
    writer = CompactFrame(layout=b"x", rank=3, ids=list(range(7, 7 + n)))
    for step in range(4):
        fields = _fields(rng, n=n, counts=counts, zero_lo=zero_lo, single=single, broken=broken if step == 2 else None)
        target = bytearray(TARGET)
        count = writer._count
        size = writer.frame_into(target, where, step, fields)
        want = writer.frame(step, fields)
        if writer._count is not count or want is None:  # recounted (a new count column), or outside the scheme
            assert size == 0
            assert target == bytearray(TARGET)
            size = writer.frame_into(target, where, step, fields)
        if want is None:
            assert size == 0
            assert target == bytearray(TARGET)
            continue
        assert size == len(want)
        assert bytes(target[where : where + size]) == want
        assert not any(target[:where])
        assert not any(target[where + size :])


def _steady(n: int = 5) -> tuple[CompactFrame, Any]:
    """A CompactFrame that took a commit, and that commit's fields."""
    writer = CompactFrame(layout=b"x", rank=0, ids=list(range(n)))
    fields = _fields(random.Random(0), n=n, counts=[4.0] * n, zero_lo="values", single=False, broken=None)
    assert writer.frame(0, fields) is not None
    return writer, fields


def test_frame_into_writes_nothing_where_the_frame_does_not_fit() -> None:
    writer, fields = _steady()
    size = len(writer.frame(1, fields) or b"")
    for room in (0, 8, size - 1):
        target = bytearray(room + 10)
        assert writer.frame_into(target, 10, 1, fields) == 0
        assert target == bytearray(room + 10)
    target = bytearray(size + 10)
    assert writer.frame_into(target, 10, 1, fields) == size
    for where in (-1, size + 11, sys.maxsize - 50, sys.maxsize):  # (no overflow past the bounds check)
        assert writer.frame_into(target, where, 1, fields) == 0


def test_frame_into_leaves_other_fields_to_frame() -> None:
    """Fields that are not one C-contiguous buffer of the layout's size: nothing written (``frame`` copies or
    refuses them)."""
    writer, fields = _steady()
    target = bytearray(TARGET)
    wide = np.asfortranarray(np.concatenate([fields, fields], axis=1))
    narrow = np.zeros((N_FIELDS, 5), np.float32)
    for other in (np.asfortranarray(fields), wide[:, ::2], fields[:, :4].copy(), narrow, b""):
        assert writer.frame_into(target, 0, 1, other) == 0
    assert target == bytearray(TARGET)
    assert writer.frame_into(target, 0, 1, np.ascontiguousarray(np.asfortranarray(fields))) > 0


def test_a_failing_crc_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    writer, fields = _steady()
    target = bytearray(TARGET)

    def broken(data: Any) -> int:
        raise RuntimeError("crc broke")

    monkeypatch.setattr(compact, "_crc32", broken)
    with pytest.raises(RuntimeError, match="crc broke"):
        writer.frame_into(target, 0, 1, fields)
    monkeypatch.setattr(compact, "_crc32", lambda data: -1)
    with pytest.raises((ValueError, OverflowError)):
        writer.frame_into(target, 0, 1, fields)
    assert target == bytearray(TARGET)


def test_a_view_the_crc_keeps_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CRC function that keeps its argument cannot read the stage's mapping after the call (it may be unmapped)."""
    writer, fields = _steady()
    kept: list[Any] = []
    crc = compact._crc32

    def keeping(data: Any) -> int:
        kept.append(data)
        return crc(data)

    monkeypatch.setattr(compact, "_crc32", keeping)
    target = mmap.mmap(-1, TARGET)
    assert writer.frame_into(target, 0, 1, fields) > 0
    target.close()  # (nothing exported by then)
    with pytest.raises(ValueError, match="released"):
        bytes(kept[0])


def test_compact_into_refuses_bad_arguments() -> None:
    assert speedups is not None
    writer, fields = _steady()
    into = speedups.compact_into
    count = writer._count
    target = bytearray(TARGET)
    crc = compact._crc32
    with pytest.raises(TypeError, match="6 arguments"):
        into(target, 0, fields, count, 1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="_count"):
        into(target, 0, fields, (b"", b""), 1, crc)
    with pytest.raises(TypeError, match="heads"):
        into(target, 0, fields, (count[0], count[1], (b"", 1), None), 1, crc)
    with pytest.raises(TypeError, match="count\\[3\\]"):
        into(target, 0, fields, (*count[:3], 5), 1, crc)
    with pytest.raises(BufferError):
        into(bytes(TARGET), 0, fields, count, 1, crc)  # read-only
    with pytest.raises(TypeError):
        into(target, "0", fields, count, 1, crc)
    with pytest.raises(OverflowError):
        into(target, 0, fields, count, 2**63, crc)
    assert target == bytearray(TARGET)


def _journal(directory: Path, *, seed: int) -> None:
    """A bus journaling 600 commits (batches among them): steady ones, the count changing, one record each, odd
    values (wsum_lo nonzero), a weighted record, a new metric."""
    rng = random.Random(seed)
    bus = MetricBus(dist=None, journal=str(directory))
    for step in range(600):
        records = 1 if 200 <= step < 260 else 3 + (step // 97) % 3
        for i in range(30):
            for _ in range(records):
                bus.log(f"m{i}", rng.choice([rng.random(), 1e17, -1.0, 3.0]) if step % 50 == 7 else rng.random())
        if step % 131 == 5:
            bus.log("late", 2.0)
        if step == 400:
            bus.log("m0", 1.0, weight=3.0)
        bus.commit()
    bus.close()


@pytest.mark.skipif(not stage.STAGED, reason="the stage needs Linux's posix_fallocate")
def test_a_journal_is_the_same_file_with_and_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same commits journaled with frames built into the stage and with each one built by ``frame``: the same
    bytes (their headers aside), read back alike."""
    built = []
    into = compact._into
    assert into is not None

    def counted(*args: Any) -> int:
        built.append(into(*args))
        return built[-1]

    monkeypatch.setattr(compact, "_into", counted)
    _journal(tmp_path / "into", seed=1)
    assert sum(1 for size in built if size) > 500  # the steady commits were built into the stage
    monkeypatch.setattr(compact, "_into", None)
    _journal(tmp_path / "frame", seed=1)
    into, plain = (rank_file(tmp_path / kind, 0).read_bytes() for kind in ("into", "frame"))
    assert without_headers(into) == without_headers(plain)
    assert b"P" in into
    assert read_journal(tmp_path / "into").commits == read_journal(tmp_path / "frame").commits


def test_the_frame_head_holds_the_length_and_crc() -> None:
    """The first 8 bytes: the payload's length and CRC-32 (the journal's own function)."""
    writer, fields = _steady()
    target = bytearray(TARGET)
    size = writer.frame_into(target, 0, 9, fields)
    length, crc = struct.unpack_from("<II", target, 0)
    assert length == size - 8
    assert crc == compact._crc32(bytes(target[8:size]))
