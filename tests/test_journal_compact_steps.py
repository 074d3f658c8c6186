"""A reader's first pass takes a run of "P" frames' steps without decoding the rest (``compact_steps``): the steps
of ``compact_run``'s array wherever that array is given and its counts are all finite, and None wherever it is not;
a damaged run is then read frame by frame, as before."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus.journal.compact import CompactFrame, compact_run, compact_steps
from metricbus.journal.frames import run_array, run_steps
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
