"""The micro columns: many metrics' plain records summarised together equal ``Summary.of_batch`` of each, and a single
worker's commit read from the columns emits what the Summaries emit, bit for bit."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metricbus import MetricBus
from metricbus.micro_columns import COLUMNS_FROM, MicroUpdate, summarize
from metricbus.reduce import StepReducer
from metricbus.spec import parse_spec
from metricbus.summary import Summary
from metricbus.testing import MemoryAdapter

HOSTILE = [0.0, -0.0, 1.0, -1.0, 1e16, 1e-20, 5e-324, -5e-324, 1.7976931348623157e308, -1.7976931348623157e308,
           math.inf, -math.inf, math.nan, 0.1, 1e300, 3.0, 2.0**-1022, 1e-300]
values = st.one_of(st.sampled_from(HOSTILE), st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(min_value=-1e6, max_value=1e6))
chunks = st.lists(st.lists(values, min_size=1, max_size=40), min_size=1, max_size=12)


PAD = [f"pad{i}" for i in range(COLUMNS_FROM)]  # enough other metrics that an update is summarised in columns


def columns(names: list[str], records: list[list[float]]) -> Mapping[str, Summary]:
    """``summarize`` of ``names``' records next to ``COLUMNS_FROM`` one-record metrics (so in columns)."""
    return summarize([*names, *PAD], [*(list(c) for c in records), *([float(i)] for i in range(len(PAD)))], {})


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


# m2's absolute error in the subnormal range: the squared deviations round to multiples of 2**-1074 there, so each of
# at most 40 records (the chunks' size) adds up to one of those (hypothesis found [0.0, 4.6e-156]: m2 ~1.1e-311, the
# two paths 1 unit of 2**-1074 apart)
M2_SUBNORMAL = 2.0**-1068


def same(a: Summary, b: Summary, *, m2: bool = True) -> bool:
    """Field by field, bit for bit (NaN equals NaN); ``m2`` False: m2 only within a few ulps."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if i == 7 and not m2:
            close = math.isclose(x, y, rel_tol=1e-13, abs_tol=M2_SUBNORMAL)
            if not (math.isnan(x) and math.isnan(y)) and not close and x != y:
                return False
        elif isinstance(x, float):
            if bits(x) != bits(y) and not (math.isnan(x) and math.isnan(y)):
                return False
        elif x != y:
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(chunks)
@example([[0.0, 4.638683760759739e-156]])  # m2 subnormal (M2_SUBNORMAL)
def test_columns_equal_of_batch(records: list[list[float]]) -> None:
    names = [f"m{i}" for i in range(len(records))]
    update = columns(names, records)
    assert sorted(update) == sorted([*names, *PAD])
    for name, chunk in zip(names, records, strict=True):
        assert same(update[name], Summary.of_batch(chunk, None), m2=False), (chunk, update[name])


def test_awkward_metrics_leave_the_columns() -> None:
    records = [[1.0, 2.0], [1e16, 1.0, 1e-20], [math.nan, 1.0], [1.7e308, 1.7e308, -1.7e308], [0.5]]
    names = ["plain", "three", "nan", "huge", "one"]
    update = columns(names, records)
    assert isinstance(update, MicroUpdate)
    assert update.names == ("plain", "one", *PAD)
    assert set(update.others) == {"three", "nan", "huge"}
    for name, chunk in zip(names, records, strict=True):
        assert same(update[name], Summary.of_batch(chunk, None), m2=False)


def test_signed_zero_ties_follow_of_batch() -> None:
    short = [0.0, -0.0, 0.0, -0.0]
    long = [0.0, -0.0] * 20
    update = columns(["short", "long"], [short, long])
    for name, chunk in (("short", short), ("long", long)):
        assert same(update[name], Summary.of_batch(chunk, None))


KINDS = ["mean", "sum", "min", "max", "first", "last", "count", "std"]


@settings(max_examples=200, deadline=None)
@given(chunks, st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True))
def test_emit_from_columns_equals_emit_from_summaries(records: list[list[float]], kinds: list[str]) -> None:
    names = [f"m{i}" for i in range(len(records))]
    spec = parse_spec(kinds, metric="m")
    update = columns(names, records)
    specs = dict.fromkeys(update, spec)
    fast = StepReducer(log_every=1).commit([StepReducer(log_every=1).worker([update], specs)], specs)
    slow = StepReducer(log_every=1).commit([StepReducer(log_every=1).worker([dict(update)], specs)], specs)
    assert fast is not None
    assert slow is not None
    assert list(fast) == list(slow)
    assert [bits(v) for v in fast.values()] == [bits(v) for v in slow.values()]


def test_means_with_a_remainder_are_exact() -> None:
    rng = np.random.default_rng(3)
    records = [rng.standard_normal(n).tolist() for n in range(1, 60)]
    names = [f"m{i}" for i in range(len(records))]
    spec = parse_spec("mean", metric="m")
    update = columns(names, records)
    specs = dict.fromkeys(update, spec)
    out = StepReducer(log_every=1).commit([StepReducer(log_every=1).worker([update], specs)], specs)
    assert out is not None
    for name, chunk in zip(names, records, strict=True):
        assert bits(out[name]) == bits(Summary.of_batch(chunk, None).mean())


def test_a_bus_commit_reads_the_columns() -> None:
    mem = MemoryAdapter()
    bus = MetricBus(adapters=[mem], dist=None)
    bus.define("spread", ["mean", "std", "max"])
    for i in range(5):
        bus.log({"loss": 0.5 * i, "spread": float(i), **dict.fromkeys(PAD, 1.0)})
    bus.log("weighted", 2.0, weight=3.0)
    out = bus.commit()
    bus.close()
    want = {"loss": 1.0, "spread/max": 4.0, "spread/mean": 2.0, "spread/std": math.sqrt(2.0), "weighted": 2.0}
    assert out == {**want, **dict.fromkeys(PAD, 1.0)}


def test_the_journal_of_packed_commits_replays_bit_for_bit(tmp_path: Path) -> None:
    """Commits whose names come and go, with metrics in columns, weighted ones and a NaN, journaled from arrays:
    replay emits what the live bus emitted."""
    from metricbus.replay import replay

    live = MemoryAdapter()
    bus = MetricBus(adapters=[live], dist=None, journal=str(tmp_path / "j"))
    bus.define("spread", ["mean", "std", "min"])
    rng = np.random.default_rng(5)
    for step in range(40):
        for i in range(step % 7 + 1):
            bus.log(f"m{i}", rng.standard_normal(3).tolist())
        bus.log({"spread": float(rng.standard_normal()), "loss": 0.25 * step})
        if step % 3 == 0:
            bus.log("weighted", 1.5, weight=2.0)
        if step % 5 == 0:
            bus.log("odd", math.nan)
        bus.commit()
    bus.close()
    again = MemoryAdapter()
    replay(str(tmp_path / "j"), [again])
    assert [s for s, _ in again.rows] == [s for s, _ in live.rows]
    for (_, want), (_, got) in zip(live.rows, again.rows, strict=True):
        assert list(want) == list(got)
        assert [bits(v) for v in want.values()] == [bits(v) for v in got.values()]
