"""Review of the core reductions (third round): exact references (``fractions.Fraction``) for ``std`` at the edges,
and for values and weights of every real type."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metricbus import Agg, MetricBus
from metricbus.errors import MetricValueError
from metricbus.testing import MemoryAdapter

LogUpdate = Callable[[MetricBus, list[float], list[float] | None], None]


def _exact_std(xs: list[float], ws: list[float] | None = None) -> float:
    """The population standard deviation of the records, from their exact variance (one rounding, then sqrt)."""
    w = [Fraction(1)] * len(xs) if ws is None else [Fraction(v) for v in ws]
    total = sum(w)
    mean = sum(wi * Fraction(x) for wi, x in zip(w, xs, strict=True)) / total
    return math.sqrt(float(sum(wi * (Fraction(x) - mean) ** 2 for wi, x in zip(w, xs, strict=True)) / total))


def _floats(bus: MetricBus, xs: list[float], ws: list[float] | None) -> None:
    for i, x in enumerate(xs):
        bus.log("x", x, weight=None if ws is None else ws[i])


def _list(bus: MetricBus, xs: list[float], ws: list[float] | None) -> None:
    bus.log("x", xs, weight=ws)


def _array(bus: MetricBus, xs: list[float], ws: list[float] | None) -> None:
    bus.log("x", np.array(xs), weight=None if ws is None else np.array(ws))


def _columns(bus: MetricBus, xs: list[float], ws: list[float] | None) -> None:
    assert ws is None
    for x in xs:  # nine plain metrics in one update: summarised in columns (micro_columns)
        bus.log({"x": x, **{f"other{i}": x for i in range(8)}})


PATHS: dict[str, LogUpdate] = {"floats": _floats, "list": _list, "array": _array, "columns": _columns}


def _std_of(log: LogUpdate, xs: list[float], ws: list[float] | None, split: str) -> float:
    """``std`` of ``xs`` logged through ``log`` in one update, in updates of 5, or by three workers and a driver."""
    rules = {"*": "std"}
    driver = MetricBus(dist=None, rules=rules)
    chunks = [(xs, ws)] if split == "one" else [
        (xs[i : i + 5], None if ws is None else ws[i : i + 5]) for i in range(0, len(xs), 5)
    ]
    if split == "workers":
        parts = []
        for cx, cw in chunks[:-1]:
            worker = MetricBus(dist=None, rules=rules)
            log(worker, cx, cw)
            parts.append(worker.export())
            worker.close()
        driver.ingest(parts)
        chunks = chunks[-1:]
    for cx, cw in chunks:
        log(driver, cx, cw)
        driver.end_update()
    out = driver.commit(0)["x"]
    driver.close()
    return out


# Across workers the merged m2 keeps the documented bound of rank_level.py (the same bits on every path, live
# torch.distributed included, whose one-pass commits do not agree the extrema a min == max shortcut would read).
@pytest.mark.parametrize("split", ["one", "updates"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7, 1e9 + 0.1, -2.5e-7])
def test_std_of_identical_records_is_zero(path: str, split: str, value: float) -> None:
    """std of a constant metric on one worker is exactly 0.0 on every logging path, in one call or several updates
    (it was ~1e-17 for one call of 0.1s)."""
    assert _std_of(PATHS[path], [value] * 40, None, split) == 0.0


@pytest.mark.parametrize("split", ["one", "updates"])
@pytest.mark.parametrize("path", ["floats", "list", "array"])
def test_std_of_identical_weighted_records_is_zero(path: str, split: str) -> None:
    """Weighted, too: [0.1] * 40 with weight 0.3 has std 0.0 (it was 1.4e-17)."""
    assert _std_of(PATHS[path], [0.1] * 40, [0.3] * 40, split) == 0.0


@pytest.mark.parametrize("split", ["one", "updates"])  # across workers: the documented bound (rank_level.py)
@pytest.mark.parametrize("path", list(PATHS))
def test_std_at_mean_1e9_and_spread_1e_6_is_accurate(path: str, split: str) -> None:
    """Catastrophic cancellation: std of 1e9 + 1e-6·i on one worker is within 1e-12 of the exact value in one call or
    several updates (one call was off by 1.6e-5 to 7.8e-5 relative: the two-pass sum around the rounded mean)."""
    xs = [1e9 + 1e-6 * i for i in range(40)]
    got = _std_of(PATHS[path], xs, None, split)
    assert got == pytest.approx(_exact_std(xs), rel=1e-12, abs=0.0)


@pytest.mark.parametrize("split", ["one", "updates"])
@pytest.mark.parametrize("path", ["floats", "list", "array"])
def test_weighted_std_at_mean_1e9_and_spread_1e_6_is_accurate(path: str, split: str) -> None:
    """The same with integer weights 1..7: within 1e-12 of the exact weighted std."""
    xs = [1e9 + 1e-6 * i for i in range(40)]
    ws = [float(i % 7 + 1) for i in range(40)]
    got = _std_of(PATHS[path], xs, ws, split)
    assert got == pytest.approx(_exact_std(xs, ws), rel=1e-12, abs=0.0)


@pytest.mark.parametrize("path", ["floats", "list", "array"])
def test_std_of_records_all_equal_near_the_top_of_the_range_is_zero(path: str) -> None:
    """One record of 1e300 with weight 7, or 1e300 logged 20 times with weight 3: std 0.0 (was inf: the deviation
    from the rounded mean, an ulp of 1e300, squared overflows; the true second moment is 0)."""
    assert _std_of(PATHS[path], [1e300], [7.0], "one") == 0.0
    assert _std_of(PATHS[path], [1e300] * 20, [3.0] * 20, "one") == 0.0
    assert _std_of(PATHS[path], [3e300] * 20, None, "one") == 0.0


def test_weighted_std_whose_weighted_sum_has_three_components_is_accurate() -> None:
    """Weights 0.3 and 1e-5 at mean 1e9 (Σw·x needs three doubles): within 1e-12 of the exact std (was 3e-5 off)."""
    xs, ws = [1e9, 1e9, 1e9 + 2.0**-23], [0.0, 0.3, 1e-5]
    assert _std_of(_list, xs, ws, "one") == pytest.approx(_exact_std(xs, ws), rel=1e-12, abs=0.0)


def test_std_of_one_record_and_of_weightless_records() -> None:
    """One record: 0.0; records whose weights are all 0: NaN (as their mean)."""
    with MetricBus(dist=None) as bus:
        bus.log("one", 5.0, agg="std")
        bus.log("weightless", [1.0, 2.0], weight=0, agg=["mean", "std"])
        out = bus.commit(0)
    assert out["one"] == 0.0
    assert math.isnan(out["weightless/mean"])
    assert math.isnan(out["weightless/std"])


def test_fractions_and_decimals_are_real_numbers() -> None:
    """A Fraction or Decimal (scalar, in a list, mixed with numpy scalars, or as a weight) is its nearest double; they
    were refused with 'log a real number'."""
    with MetricBus(dist=None) as bus:
        bus.log("f", Fraction(1, 3), agg="sum")
        bus.log("f", [Fraction(1, 6), Decimal("0.1")])
        bus.log("mixed", [np.int64(1), 2**64, np.float32(0.5), Fraction(1, 4)], agg="sum")
        bus.log("w", [1.0, 3.0], weight=[Fraction(1), Decimal(3)])
        bus.log("w", 5.0, weight=Fraction(1, 2))
        out = bus.commit(0)
    assert out["f"] == float(Fraction(1 / 3) + Fraction(1 / 6) + Fraction(0.1))
    assert out["mixed"] == float(1 + 2**64 + Fraction(3, 4))
    assert out["w"] == (1.0 + 9.0 + 2.5) / 4.5


@pytest.mark.parametrize(
    "value",
    [Decimal("1e400"), [Decimal("-1e400")], Fraction(10**400, 3), Decimal("sNaN"), [np.longdouble("1e400"), 2**64]],
)
def test_a_real_beyond_the_double_range_is_refused_naming_the_metric(value: object) -> None:
    """A Decimal or Fraction beyond the double range (or a signaling NaN) is a MetricValueError naming the metric, never
    an inf it did not hold (float(Decimal('1e400')) is inf), and the records logged before are kept."""
    with MetricBus(dist=None) as bus:
        bus.log("big", 1.0, agg="sum")
        with pytest.raises(MetricValueError, match="'big'"):
            bus.log("big", value)
        with pytest.raises(MetricValueError, match="'big'"):
            bus.log("big", 1.0, weight=value if not isinstance(value, list) else value[0])
        assert bus.commit(0) == {"big": 1.0}


def test_decimal_nan_and_infinity_follow_the_nan_policy() -> None:
    """Decimal NaN and Infinity are non-finite records as float ones: propagated, or refused under nan='error'."""
    with MetricBus(dist=None) as bus:
        bus.log("n", [Decimal("NaN"), 1.0], agg="max")
        bus.log("i", Decimal("-Infinity"), agg="min")
        with pytest.raises(MetricValueError, match="'e'"):
            bus.log("e", Decimal("Infinity"), agg=Agg(nan="error"))
        out = bus.commit(0)
    assert math.isnan(out["n"])
    assert out["i"] == -math.inf
    assert "e" not in out


def test_a_longdouble_weight_array_beyond_the_double_range_is_refused_naming_the_metric() -> None:
    """An array of longdouble weights beyond the double range is a MetricValueError naming the metric (it was numpy's
    'overflow encountered in cast' RuntimeWarning, then 'weight inf is invalid'); the metric's records are kept."""
    with MetricBus(dist=None) as bus:
        bus.log("w", 2.0, weight=np.longdouble(3))
        with pytest.raises(MetricValueError, match="'w' is beyond the double range"):
            bus.log("w", [1.0, 5.0], weight=np.array([np.longdouble("1e400"), np.longdouble(1)]))
        assert bus.commit(0) == {"w": 2.0}


# -- the hierarchy against an exact reference ------------------------------------------------------------------------

Records = list[tuple[float, float]]
Window = list[list[list[Records]]]  # commits -> workers (the driver last) -> updates -> (x, w) records
CHAIN_KINDS = ["mean", "sum", "min", "max", "count", "first", "last"]


def _total_order(x: float) -> tuple[float, int]:
    return (x, 0 if math.copysign(1.0, x) < 0 else 1)


def _kind(kind: str, records: Records) -> float:
    """``kind`` of records (finite, or NaN where a weightless mean was lifted), exactly (Fractions), rounded once."""
    xs = [x for x, _ in records]
    if kind == "count":
        return float(len(xs))
    if kind in ("first", "last"):
        return xs[0] if kind == "first" else xs[-1]
    if any(map(math.isnan, xs)):
        return math.nan
    if kind in ("min", "max"):
        return (min if kind == "min" else max)(xs, key=_total_order)
    if kind == "sum":
        return float(sum(map(Fraction, xs)))
    weight = sum(Fraction(w) for _, w in records)
    return math.nan if weight == 0 else float(sum(Fraction(w) * Fraction(x) for x, w in records) / weight)


def _reference(chain: tuple[str, str, str, str], window: Window) -> float | None:
    """The README's continuation rule: where a level keeps the kind below, states merge; where it changes, each
    group's result is one unit-weight record. ``first``/``last`` across workers take the lowest-ranked worker."""
    micro, update, rank, step = chain
    commits: list[Records] = []
    for commit in window:
        workers = []
        for updates in commit:
            ups = [u for u in updates if u]
            if ups:
                merged = update == micro
                workers.append([r for u in ups for r in u] if merged else [(_kind(micro, u), 1.0) for u in ups])
        if not workers:
            continue
        if rank != update:
            workers = [[(_kind(update, w), 1.0)] for w in workers]
        commits.append(workers[0] if rank in ("first", "last") else [r for w in workers for r in w])
    if not commits:
        return None
    if step != rank:
        commits = [[(_kind(rank, c), 1.0)] for c in commits]
    return _kind(step, [r for c in commits for r in c])


_VALUES = st.one_of(
    st.floats(-1e6, 1e6).filter(lambda x: x == 0.0 or abs(x) > 1e-200),
    st.sampled_from([0.0, -0.0, 0.1, 1e16, -1e16, 1e9 + 1e-6]),
)
_RECORDS = st.lists(st.tuples(_VALUES, st.sampled_from([0.0, 0.5, 1.0, 3.0])), max_size=12)
_WORKERS = st.lists(st.lists(_RECORDS, min_size=1, max_size=3), min_size=1, max_size=3)  # each: its updates
_WINDOWS = st.lists(_WORKERS, min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.tuples(*[st.sampled_from(CHAIN_KINDS)] * 4),
    st.sampled_from([1, 2, 3]),
    _WINDOWS,
    st.booleans(),
    st.sampled_from(["floats", "list", "array"]),
)
def test_every_chain_over_workers_updates_and_windows_is_the_exact_reference(
    chain: tuple[str, str, str, str], every: int, window: Window, weighted: bool, path: str
) -> None:
    """Any Agg of the fixed kinds, over workers (export/ingest, the driver's own records last), several updates per
    step and log_every windows (the last one partial, emitted by close()), weighted or not, is the exact reference."""
    if not weighted:
        window = [[[[(x, 1.0) for x, _ in u] for u in w] for w in c] for c in window]
    spec = Agg(micro=chain[0], update=chain[1], rank=chain[2], step=chain[3])
    log = PATHS[path]
    mem = MemoryAdapter()
    driver = MetricBus(adapters=[mem], log_every=every, dist=None, rules={"x": spec})
    for step, commit in enumerate(window):
        parts = []
        for updates in commit[:-1]:
            worker = MetricBus(dist=None, rules={"x": spec})
            for u in updates:
                if u:
                    log(worker, [x for x, _ in u], [w for _, w in u] if weighted else None)
                worker.end_update()
            parts.append(worker.export())
            worker.close()
        driver.ingest(parts)
        for u in commit[-1]:
            if u:
                log(driver, [x for x, _ in u], [w for _, w in u] if weighted else None)
            driver.end_update()
        driver.commit(step)
    driver.close()
    got = {step: out["x"] for step, out in mem.rows if "x" in out}
    want = {}
    for start in range(0, len(window), every):
        value = _reference(chain, window[start : start + every])
        if value is not None:
            want[min(start + every, len(window)) - 1] = value
    assert set(got) == set(want)
    for step, value in want.items():
        if value == 0.0 and got[step] == 0.0 and {"sum", "mean"} & set(chain):
            continue  # a sum or mean of -0.0s may be either zero (README, exactness)
        assert struct.pack("<d", got[step]) == struct.pack("<d", value) or (math.isnan(value) and math.isnan(got[step]))
