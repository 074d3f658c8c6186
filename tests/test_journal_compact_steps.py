"""A reader's first pass takes a run of "P" frames' steps without decoding the rest (``compact_steps``): the steps
of ``compact_run``'s array wherever that array is given and its counts are all finite, and None wherever it is not;
a damaged run is then read frame by frame, as before. Frames a CRC does not catch (too short for their head, or
saying more entries than they hold) are damage, read without a crash or an allocation for what they say."""

from __future__ import annotations

import random
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import MetricBus
from metricbus.errors import JournalWarning
from metricbus.journal import read_journal, stream_journal
from metricbus.journal.checksum import crc32
from metricbus.journal.compact import CompactFrame, compact_run, compact_steps
from metricbus.journal.format import FRAME
from metricbus.journal.frames import run_array, run_steps
from metricbus.journal.reader import timeline
from metricbus.replay import emitted
from metricbus.summary import N_FIELDS
from tests.test_journal_compact import NAN_PAYLOAD


def _fields(rng: random.Random, *, n: int, counts: list[float], single: bool, zero_lo: bool = False) -> Any:
    fields = np.array([[rng.uniform(-9, 9) for _ in range(n)] for _ in range(N_FIELDS)])
    fields[0] = counts
    fields[1] = fields[0]
    fields[2] = 0.0
    if zero_lo:
        fields[4] = 0.0
    fields[5:7] = fields[3:5]
    if single:
        fields[7] = 0.0
        fields[8:12] = fields[3]
    return fields


def _expected(span: bytes, k: int) -> Any:
    """What the first pass took before: the steps of the decoded run, where its counts are all finite."""
    run = compact_run(span, k)
    if run is None or not np.isfinite(run["rows"]["fields"][..., 0]).all():
        return None
    return run["step"]


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 12),
    k=st.integers(2, 9),
    count=st.sampled_from(["same", "each", "one", "inf", "nan", "zero", "huge"]),
    change=st.sampled_from([None, "count", "byte", "ids"]),
)
def test_the_steps_of_a_run_are_those_of_its_decoded_array(
    seed: int, n: int, k: int, count: str, change: str | None
) -> None:
    rng = random.Random(seed)
    counts = {
        "same": [4.0] * n,
        "each": [float(rng.randint(1, 9)) for _ in range(n)],
        "one": [1.0] * n,
        "inf": [4.0] * (n - 1) + [float("inf")] if n else [],
        "nan": [NAN_PAYLOAD] + [4.0] * (n - 1) if n else [],
        "zero": [0.0] * n,
        "huge": [1.7e308] * n,  # finite, whose sum is not: each count is checked
    }[count]
    writer = CompactFrame(layout=b"x", rank=2, ids=list(range(5, 5 + n)) if rng.random() < 0.5 else
                          rng.sample(range(1000), n))
    steps = sorted(rng.sample(range(-50, 50), k)) if rng.random() < 0.8 else [rng.randint(-3, 3) for _ in range(k)]
    frames = []
    zero_lo = rng.random() < 0.5
    for i, step in enumerate(steps):
        fields = _fields(rng, n=n, counts=counts, single=count == "one", zero_lo=zero_lo)
        if change == "count" and i == k - 1 and n:  # the last frame's count column differs: another head
            fields[0, 0] = fields[1, 0] = fields[0, 0] + 1.0
        frame = writer.frame(step, fields)
        if frame is None:
            return
        frames.append(frame)
    if len({len(f) for f in frames}) != 1:  # a run is frames of one length
        return
    data = bytearray(b"".join(frames))
    length = len(frames[0])
    if change == "byte":  # one byte of a head or the doubles of a frame changed (its CRC is not checked here)
        at = length * rng.randrange(k) + rng.randrange(17, length)
        data[at] ^= 1 << rng.randrange(8)
    if change == "ids" and n:
        data[length * (k - 1) + 8 + 1 + 16 + N_FIELDS] ^= 1  # the ids code of the last frame
    span = bytes(data[8:])  # from the first payload to the end of the last, as FrameSource yields a run
    want = _expected(span, k)
    got = compact_steps(span, k)
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert got.dtype == np.int64
        assert got.tolist() == want.tolist()
    again = run_steps(memoryview(span), k)
    assert (again is None) == (got is None)
    assert run_array(span, k) is None or _expected(span, k) is None or again is not None


def test_the_steps_are_copied_from_the_span() -> None:
    """The first pass reads through a reused buffer: the steps must not change when it does."""
    writer = CompactFrame(layout=b"x", rank=0, ids=[0, 1])
    fields = _fields(random.Random(1), n=2, counts=[3.0, 3.0], single=False)
    data = bytearray(b"".join(writer.frame(step, fields) or b"" for step in (7, 8, 9)))
    span = memoryview(data)[8:]
    steps = compact_steps(span, 3)
    assert steps is not None
    data[:] = bytes(len(data))
    assert steps.tolist() == [7, 8, 9]


def _journal_with(directory: Path, *payloads: bytes) -> None:
    """A journal of three good commits (steps 0-2), then ``payloads`` as frames with valid CRCs (damage a CRC does
    not catch: a writer's bug, or a hostile file)."""
    with MetricBus(dist=None, journal=str(directory), fsync="never") as bus:
        for step in range(3):
            bus.log("loss", step + 0.5)
            bus.commit(step)
    path = next(directory.glob("rank-*.mbj"))
    with path.open("ab") as file:
        for payload in payloads:
            file.write(FRAME.pack(len(payload), crc32(payload)) + payload)


@pytest.mark.parametrize("kind", [b"P", b"S"])
@pytest.mark.parametrize(("length", "frames"), [(1, 2), (3, 3), (5, 2), (16, 2)])
def test_a_run_of_frames_too_short_for_their_head_is_damage(tmp_path: Path, kind: bytes, length: int,
                                                            frames: int) -> None:
    """Frames of one length shorter than a commit's head, back to back (a run): each is read on its own, as damage
    (a warning), not a struct.error out of the reader; the commits before them are kept."""
    _journal_with(tmp_path / "j", *[kind + bytes(length - 1)] * frames)
    for read in (stream_journal, read_journal):
        with pytest.warns(JournalWarning, match="unreadable record"):
            journal = read(tmp_path / "j")
        assert [commit.step for commit in timeline(journal)] == [0, 1, 2]


def test_a_p_frame_that_says_more_entries_than_it_holds_is_damage(tmp_path: Path) -> None:
    """A 34-byte "P" frame (no stored column, consecutive ids) saying 2**32 - 1 entries: damage, read before anything
    is allocated for them (every "P" frame stores each entry's wsum), alone or in a run."""
    head = struct.pack("<qII", 3, 2**32 - 1, 0) + bytes([1] * N_FIELDS) + b"\x01" + struct.pack("<I", 0)
    for frames in (1, 3):
        directory = tmp_path / f"j{frames}"
        _journal_with(directory, *[b"P" + head] * frames)
        tracemalloc.start()
        try:
            with pytest.warns(JournalWarning, match="entries cannot be"):
                steps = [step for step, _ in emitted(stream_journal(directory))]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert steps == [0, 1, 2]
        assert peak < 50 * 2**20
