"""``merge_columns`` gives, field by field and bit for bit, what ``Summary.merge`` gives for each column."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metricbus.summary import EMPTY, N_FIELDS, Summary
from metricbus.update_columns import merge_columns

EDGES = [0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1e-300, 1e-20, 0.1, 1.0, 1e16, 2.0**900, 1e308, 1.7e308]
# NaNs of both signs and with a payload: an addition keeps one operand's, so the columns must keep the same one
ODD = [math.nan, -math.nan, struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0], math.inf, -math.inf]


def bits(summary_fields: Any) -> list[bytes]:
    """The fields as their bytes (NaN payloads and the sign of zero count)."""
    return [struct.pack("<d", float(f)) for f in summary_fields]


def value() -> st.SearchStrategy[float]:
    """Ordinary floats of many magnitudes, their edges, and now and then a non-finite one."""
    scaled = st.builds(lambda m, e: m * 10.0**e, st.floats(-1.0, 1.0), st.integers(-300, 300))
    edge = st.sampled_from(EDGES).flatmap(lambda v: st.sampled_from([v, -v]))
    return st.one_of(scaled, scaled, scaled, edge, st.sampled_from(ODD))


@st.composite
def summaries(draw: st.DrawFn) -> Summary:
    """A micro summary of 0..6 records, weighted or not (as the collector folds them: Summary.of_batch)."""
    n = draw(st.integers(0, 6))
    if n == 0:
        return EMPTY
    mean = draw(st.sampled_from([0.0, 1.0, 1e6, -3e12, 1e-9]))
    values = [mean + draw(value()) if draw(st.booleans()) else draw(value()) for _ in range(n)]
    weights = None
    if draw(st.booleans()):
        weights = [draw(st.sampled_from([0.0, 1.0, 0.5, 3.0, 1e-300, 1e300, 7.25])) for _ in range(n)]
    return Summary.of_batch(values, weights)


def _columns(rows: list[Summary]) -> Any:
    return np.array([s.as_tuple() for s in rows], dtype=np.float64).T.copy()


@settings(max_examples=400, deadline=None)
@given(pairs=st.lists(st.tuples(summaries(), summaries()), min_size=1, max_size=12))
@example(pairs=[(Summary.of_batch([1e16, 1.0], None), Summary.of_batch([1e-20, -1e16], None))])
@example(pairs=[(Summary.of_batch([1.7e308], None), Summary.of_batch([1.7e308], None))])
@example(pairs=[(EMPTY, Summary.of_batch([2.0], None)), (Summary.of_batch([3.0], None), EMPTY), (EMPTY, EMPTY)])
# two NaNs of opposite signs (0 * inf gives the negative one): Python's addition kept the second's, numpy's the first's
@example(pairs=[(Summary.of_batch([math.inf], [0.0]), Summary.of_batch([math.nan, 2.0], [1.0, 3.0]))])
def test_merge_columns_is_summary_merge_bit_for_bit(pairs: list[tuple[Summary, Summary]]) -> None:
    """Every field of every column, where the merges need no rest; else None."""
    rows = [(a, b) for a, b in pairs if not a.rest and not b.rest]
    if not rows:
        return
    merged = [a.merge(b) for a, b in rows]
    got = merge_columns(_columns([a for a, _ in rows]), _columns([b for _, b in rows]))
    if any(m.rest for m in merged):
        assert got is None
        return
    assert got is not None
    assert got.shape == (N_FIELDS, len(rows))
    for i, m in enumerate(merged):
        assert bits(got[:, i]) == bits(m.as_tuple()), (rows[i], m)


def test_common_data_is_merged_in_columns_without_the_fallback() -> None:
    """Random micro summaries of ordinary data take no per-column fallback (the point of the columns)."""
    rng = np.random.default_rng(1)
    rows = [
        (Summary.of_batch(list(rng.random(8) * 10), None), Summary.of_batch(list(rng.random(8) * 10), None))
        for _ in range(200)
    ]
    import metricbus.update_columns as uc

    calls = []
    real = Summary.from_tuple

    def spy(*a: Any, **k: Any) -> Summary:
        calls.append(1)
        return real(*a, **k)

    try:
        uc.Summary.from_tuple = spy  # type: ignore[method-assign]
        got = merge_columns(_columns([a for a, _ in rows]), _columns([b for _, b in rows]))
    finally:
        uc.Summary.from_tuple = real  # type: ignore[method-assign]
    assert got is not None
    assert len(calls) < 10  # an fsum zero now and then
    for i, (a, b) in enumerate(rows):
        assert bits(got[:, i]) == bits(a.merge(b).as_tuple())


KINDS = ["mean", "sum", "std", "min", "max", "first", "last", "count", ["mean", "std", "max"]]


def _run(*, columns: bool, seed: int, wide: bool, monkeypatch: Any) -> tuple[list[dict[str, float]], int]:
    """30 commits of 2-5 updates of 12 metrics of every kind, each record logged as a float (what the columns hold),
    spreads 1e-3 to 1e6 around means up to 2e3 (``wide``: spreads to 1e12 around means to 2e6, whose sums some
    updates hold outside the columns), a NaN at step 7 and an inf at step 19; the update level merged in columns or
    (``columns=False``) per metric. Returns the commits and how many were merged in columns."""
    from metricbus import MetricBus
    from metricbus.reduce import StepReducer

    merged = [0]
    real = StepReducer._merged_columns

    def counted(self: StepReducer, *a: Any, **k: Any) -> Any:
        got = real(self, *a, **k) if columns else None
        merged[0] += got is not None
        return got

    monkeypatch.setattr(StepReducer, "_merged_columns", counted)
    rng = np.random.default_rng(seed)
    rules = {f"m{i}": KINDS[i % len(KINDS)] for i in range(12)}
    bus = MetricBus(dist=None, rules=rules)
    out = []
    for step in range(30):
        for _ in range(int(rng.integers(2, 6))):
            for i in range(12):
                scale, mean = (10.0 ** rng.integers(-3, 13), 1e6) if wide else (10.0 ** rng.integers(-3, 7), 1e3)
                values = rng.standard_normal(int(rng.integers(1, 9))) * scale + mean * (i % 3)
                if step in (7, 19) and i == 5:
                    values[0] = math.nan if step == 7 else math.inf
                for v in values.tolist():
                    bus.log(f"m{i}", v)
            bus.end_update()
        out.append(bus.commit(step=step))
    bus.close()
    monkeypatch.undo()
    return out, merged[0]


def test_a_bus_with_several_updates_per_commit_emits_the_same_bits_either_way(monkeypatch: Any) -> None:
    """The update level merged in columns against the per-metric merge: every emitted value, bit for bit (most
    commits in columns; with wide data, those some update holds outside the columns take the per-metric path)."""
    for seed, wide in ((0, False), (1, False), (2, True)):
        fast, merged = _run(columns=True, seed=seed, wide=wide, monkeypatch=monkeypatch)
        slow, none = _run(columns=False, seed=seed, wide=wide, monkeypatch=monkeypatch)
        assert merged >= 25, merged
        assert none == 0
        assert [{k: bits([v]) for k, v in row.items()} for row in fast] == [
            {k: bits([v]) for k, v in row.items()} for row in slow
        ]


def test_a_two_sum_overflowing_near_the_top_of_the_range_is_left_to_the_scalar_merge() -> None:
    """The columns give ``Summary.merge``'s bits where TwoSum's intermediate overflows for a finite sum."""
    top = 1.7976931348623157e308
    rows = [(Summary.of_batch([7.976931348623158e307], None), Summary.of_batch([-top], None))]
    got = merge_columns(_columns([a for a, _ in rows]), _columns([b for _, b in rows]))
    assert got is not None
    assert bits(got[:, 0]) == bits(rows[0][0].merge(rows[0][1]).as_tuple())
