"""Property tests of the one mergeable state: merge laws, identity, and split invariance against numpy/Python."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import MetricBus
from metricbus.kinds import KIND_NAMES, KINDS
from metricbus.summary import EMPTY, Summary
from metricbus.testing import MemoryAdapter

VALUES = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
WEIGHTS = st.one_of(st.just(0.0), st.floats(1e-3, 1e3))
RECORDS = st.lists(st.tuples(VALUES, WEIGHTS), min_size=1, max_size=40)
ORDER_FREE = [k for k in KIND_NAMES if k not in ("first", "last")]
WEIGHTED = ("mean", "std")


def reference(kind: str, xs: list[float], ws: list[float]) -> float:
    """The kind computed on the whole, unsplit data with plain numpy/Python (long double for std)."""
    x = np.asarray(xs, dtype=np.float64)
    w = np.asarray(ws, dtype=np.float64)
    if kind == "mean":
        return math.fsum((w * x).tolist()) / math.fsum(ws)
    if kind == "std":
        xl, wl = x.astype(np.longdouble), w.astype(np.longdouble)
        mean = np.sum(wl * xl) / np.sum(wl)
        return float(np.sqrt(np.sum(wl * (xl - mean) ** 2) / np.sum(wl)))
    table = {
        "sum": lambda: math.fsum(xs),
        "min": lambda: float(np.min(x)),
        "max": lambda: float(np.max(x)),
        "first": lambda: xs[0],
        "last": lambda: xs[-1],
        "count": lambda: float(len(xs)),
    }
    return table[kind]()


def assert_close(kind: str, actual: float, expected: float, xs: list[float]) -> None:
    """Relative 1e-12; std also allows the rounding of the mean itself (~eps * max|x|), as numpy does.

    m2 is a double: squared deviations below the subnormal range underflow (each by < 2**-1074), so a std under
    ~sqrt(40 records * 2**-1074 / 1e-3 weight) ~ 1e-159 is only known to that absolute accuracy.
    """
    scale = max(abs(v) for v in xs)
    atol = max(1e-14 * scale, 1e-159) if kind == "std" else 1e-300
    assert actual == pytest.approx(expected, rel=1e-12, abs=atol), (kind, actual, expected)


def summary_of(records: list[tuple[float, float]]) -> Summary:
    """Summarise ``records`` as one batch."""
    return Summary.of_batch([x for x, _ in records], [w for _, w in records])


def values(s: Summary) -> dict[str, float]:
    """Every kind's value of a summary."""
    return {kind: KINDS[kind](s) for kind in KIND_NAMES}


def same(a: float, b: float) -> bool:
    """Equal within 1e-12, or both NaN (empty-weight means)."""
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-9)


@given(RECORDS, RECORDS, RECORDS)
def test_merge_is_associative(
    a: list[tuple[float, float]], b: list[tuple[float, float]], c: list[tuple[float, float]]
) -> None:
    """(a+b)+c and a+(b+c) give the same value for every kind."""
    sa, sb, sc = summary_of(a), summary_of(b), summary_of(c)
    left, right = values(sa.merge(sb).merge(sc)), values(sa.merge(sb.merge(sc)))
    for kind in KIND_NAMES:
        assert same(left[kind], right[kind]), kind


@given(RECORDS, RECORDS)
def test_merge_is_commutative_for_order_free_kinds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> None:
    """a+b and b+a agree for every kind except first/last."""
    sa, sb = summary_of(a), summary_of(b)
    ab, ba = values(sa.merge(sb)), values(sb.merge(sa))
    for kind in ORDER_FREE:
        assert same(ab[kind], ba[kind]), kind


@given(RECORDS, RECORDS)
def test_first_last_follow_merge_order(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> None:
    """first comes from the left operand, last from the right."""
    merged = summary_of(a).merge(summary_of(b))
    assert KINDS["first"](merged) == a[0][0]
    assert KINDS["last"](merged) == b[-1][0]


@given(RECORDS)
def test_empty_is_the_identity(a: list[tuple[float, float]]) -> None:
    """Merging with the empty summary on either side changes no kind's value."""
    s = summary_of(a)
    for merged in (EMPTY.merge(s), s.merge(EMPTY)):
        got, want = values(merged), values(s)
        for kind in KIND_NAMES:
            assert same(got[kind], want[kind]), kind


def test_empty_summary_has_no_records() -> None:
    """The identity counts zero records and zero weight."""
    assert KINDS["count"](EMPTY) == 0.0
    assert math.isnan(KINDS["mean"](EMPTY))


def test_summary_round_trips_through_a_tuple() -> None:
    """as_tuple/from_tuple is lossless (the journal's format)."""
    s = Summary.of_batch([1.0, 2.5, -3.0], [1.0, 2.0, 0.5])
    assert Summary.from_tuple(s.as_tuple(), s.rest_flat()) == s


@st.composite
def split_records(draw: st.DrawFn) -> tuple[str, list[tuple[float, float]], list[Any]]:
    """A kind, records, and the same records cut (in order) into commits x workers x micro-batches."""
    kind = draw(st.sampled_from(KIND_NAMES))
    records = draw(RECORDS)
    if kind in WEIGHTED and sum(w for _, w in records) == 0:
        records = [(records[0][0], 1.0), *records[1:]]
    n_commits = draw(st.integers(1, 3))
    n_workers = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, len(records)), min_size=n_commits * n_workers - 1,
                                max_size=n_commits * n_workers - 1)))
    bounds = [0, *cuts, len(records)]
    pieces = [records[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
    layout = []
    for c in range(n_commits):
        workers = []
        for piece in pieces[c * n_workers:(c + 1) * n_workers]:
            micro_cuts = sorted(draw(st.lists(st.integers(0, len(piece)), max_size=3)))
            mb = [0, *micro_cuts, len(piece)]
            workers.append([piece[mb[i]:mb[i + 1]] for i in range(len(mb) - 1)])
        layout.append(workers)
    return kind, records, layout


def _log_micro_batches(bus: MetricBus, kind: str, batches: list[list[tuple[float, float]]]) -> None:
    for batch in batches:
        if not batch:
            continue
        if len(batch) == 1:
            bus.log("m", batch[0][0], weight=batch[0][1])
        else:
            bus.log("m", np.array([x for x, _ in batch]), weight=np.array([w for _, w in batch]))


@settings(max_examples=300, deadline=None)
@given(split_records())
def test_any_split_gives_the_unsplit_value(case: tuple[str, list[tuple[float, float]], list]) -> None:
    """Records split over commits, workers and micro-batches, any weights, match numpy on the unsplit data.

    (``last`` across workers is the lowest-ranked worker's last record, so its reference follows the layout.)
    """
    kind, records, layout = case
    xs, ws = [x for x, _ in records], [w for _, w in records]
    mem = MemoryAdapter()
    driver = MetricBus(adapters=[mem], rules={"m": kind}, log_every=len(layout), dist=None, strict=True)
    for workers in layout:
        *remote, own = workers
        partials = []
        for batches in remote:
            worker = MetricBus(rules={"m": kind}, dist=None, strict=True)
            _log_micro_batches(worker, kind, batches)
            partials.append(worker.export())
            worker.close()
        driver.ingest(partials)
        _log_micro_batches(driver, kind, own)
        driver.commit()
    driver.close()
    assert len(mem.rows) == 1
    (_, out), = mem.rows
    if kind in WEIGHTED and math.fsum(ws) == 0:
        return
    expected = last_across_workers(layout) if kind == "last" else reference(kind, xs, ws)
    assert_close(kind, out["m"], expected, xs)


def last_across_workers(layout: list[Any]) -> float:
    """``last``: the last commit that has records, its lowest-ranked worker that has them, that worker's last."""
    for workers in reversed(layout):
        for batches in workers:
            records = [r for batch in batches for r in batch]
            if records:
                return float(records[-1][0])
    raise AssertionError("no records")


@pytest.mark.parametrize("n_parts", [1, 2, 7, 100])
def test_std_is_stable_for_a_large_mean_and_tiny_spread(n_parts: int) -> None:
    """std of data with mean 1e6 and spread 1e-3, split into parts, matches numpy's weighted covariance to 1e-12."""
    rng = np.random.default_rng(7)
    x = 1e6 + 1e-3 * rng.standard_normal(2000)
    w = rng.uniform(0.5, 2.0, 2000)
    expected = float(np.sqrt(np.cov(x, aweights=w, ddof=0)))
    state = EMPTY
    for xs, ws in zip(np.array_split(x, n_parts), np.array_split(w, n_parts), strict=False):
        state = state.merge(Summary.of_batch(xs.tolist(), ws.tolist()))
    assert KINDS["std"](state) == pytest.approx(expected, rel=1e-12)


def test_std_through_workers_is_stable() -> None:
    """The same stability holds through export/ingest across 4 workers x 5 micro-batches."""
    rng = np.random.default_rng(11)
    x = 1e6 + 1e-3 * rng.standard_normal(400)
    mem = MemoryAdapter()
    driver = MetricBus(adapters=[mem], rules={"x": "std"}, dist=None, strict=True)
    chunks = np.array_split(x, 20)
    parts = []
    for worker_chunks in (chunks[0:5], chunks[5:10], chunks[10:15]):
        worker = MetricBus(dist=None, strict=True)
        for chunk in worker_chunks:
            worker.log("x", chunk, agg="std")
        parts.append(worker.export())
    driver.ingest(parts)
    for chunk in chunks[15:]:
        driver.log("x", chunk, agg="std")
    out = driver.commit()
    assert out["x"] == pytest.approx(float(np.std(x.astype(np.longdouble))), rel=1e-12)


def test_two_sums_near_the_top_of_the_range_merge_exactly() -> None:
    """TwoSum's ``hi - a`` overflows for a finite sum of opposite-signed values near ±MAX (its remainder would be
    NaN, and the next merge raise): the merge takes the exact path instead (found by a review fuzzer)."""
    from fractions import Fraction

    top = sys.float_info.max
    a = 7.976931348623158e307
    merged = Summary.of_batch([a], None).merge(Summary.of_batch([-top], None))
    assert math.isfinite(merged.total_lo)
    assert Fraction(merged.total) + Fraction(merged.total_lo) == Fraction(a) - Fraction(top)
    three = merged.merge(Summary.of_batch([1.0], None))
    assert three.sum() == float(Fraction(a) - Fraction(top) + 1)
