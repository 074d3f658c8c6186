"""Split invariance of the whole pipeline: workers x updates x micro-batches x commits, over every finite double.

However the records are cut (which commit of a ``log_every`` window, which worker, which optimizer update, which
micro-batch), ``sum`` and ``mean`` are the correctly rounded exact values (checked with ``fractions.Fraction``),
``count``, ``min`` and ``max`` are exact, and ``std`` never raises.
"""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metricbus import MetricBus

EXACT = ["sum", "mean", "count", "min", "max", "std"]
EXTREMES = [1.7976931348623157e308, -1.7976931348623157e308, 1e308, -1e308, 1e155, -1e155, 5e-324, -5e-324, 0.0]
values = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EXTREMES))
weights = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 3.0]), st.floats(min_value=1e-3, max_value=1e6))
CUT = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2))  # commit, worker, ...


def exact(x: Fraction) -> float:
    """The correctly rounded double of ``x`` (±inf beyond the range)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def weighted_value(x: float) -> float:
    """The value the weighted metric logs: ``x`` kept where every product w·x stays a normal double.

    A weighted mean is exact while each w·x is within [2**-960, MAX] (README, exactness); the unweighted metric
    covers the whole range.
    """
    return 0.0 if abs(x) < 1e-250 else max(-1e300, min(1e300, x))


def run(records: list[tuple[float, float, tuple[int, int, int, int]]]) -> dict[str, float]:
    """Log ``records`` cut as given through worker buses, export/ingest and a driver with a 3-commit window."""
    driver = MetricBus(dist=None, strict=True, log_every=3, rules={"x": EXACT, "w": ["mean", "sum"]})
    out: dict[str, float] = {}
    for commit in range(3):
        parts = []
        for worker in range(3):
            bus = MetricBus(dist=None, rules={"x": EXACT, "w": ["mean", "sum"]})
            for update in range(3):
                for micro in range(3):
                    mine = [(v, w) for v, w, cut in records if cut == (commit, worker, update, micro)]
                    if mine:
                        bus.log("x", [v for v, _ in mine])
                        bus.log("w", [weighted_value(v) for v, _ in mine], weight=[w for _, w in mine])
                bus.end_update()
            parts.append(bus.export())
        driver.ingest(parts)
        out = driver.commit()
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(values, weights, CUT), min_size=1, max_size=24))
def test_every_cut_gives_the_exact_values(records: list[tuple[float, float, tuple[int, int, int, int]]]) -> None:
    """sum, mean (unit and weighted), count, min, max are exact under every cut; std is a number, never an error."""
    out = run(records)
    xs = [v for v, _, _ in records]
    total = sum(map(Fraction, xs), Fraction(0))
    assert out["x/sum"] == exact(total)
    assert out["x/mean"] == exact(total / len(xs))
    assert out["x/count"] == len(xs)
    assert (out["x/min"], out["x/max"]) == (min(xs), max(xs))
    assert out["x/std"] >= 0.0  # a number (inf when the second moment overflows), never NaN for finite data
    weight = sum((Fraction(w) for _, w, _ in records), Fraction(0))
    if weight:
        wsum = sum((Fraction(w) * Fraction(weighted_value(v)) for v, w, _ in records), Fraction(0))
        assert out["w/mean"] == exact(wsum / weight)
    else:
        assert math.isnan(out["w/mean"])
    assert out["w/sum"] == exact(sum((Fraction(weighted_value(v)) for v, _, _ in records), Fraction(0)))


def test_the_issue_cases_through_the_bus() -> None:
    """[1e16, 1, 1e-20] sums to 1.0000000000000002e16 however split; near 1e308 the sign and value hold."""
    cuts = [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 1, 2)]
    records = [(1e16, 1.0, cuts[0]), (1.0, 1.0, cuts[1]), (1e-20, 1.0, cuts[2])]
    assert run(records)["x/sum"] == 1.0000000000000002e16
    big = [(1e308, 1.0, (0, 0, 0, 0)), (1e308, 1.0, (0, 0, 0, 0)), (-1e308, 1.0, (1, 0, 0, 0)),
           (-1e308, 1.0, (2, 2, 2, 2)), (1e308, 1.0, (2, 1, 0, 0))]
    out = run(big)
    assert out["x/sum"] == 1e308
    assert out["x/mean"] == 2e307
