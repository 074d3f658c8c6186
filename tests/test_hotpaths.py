"""The hot paths (``log(dict)`` of floats, numpy arrays) record exactly what the validated list paths record."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pytest

from metricbus import MetricBus, MetricTypeError, MetricValueError, exact
from metricbus.accumulate import FOLD_AT
from metricbus.summary import Summary
from metricbus.summary_arrays import of_arrays

ALL = ["mean", "sum", "min", "max", "first", "last", "count", "std"]
EXACT = [k for k in ALL if k != "std"]


def bus(**options: object) -> MetricBus:
    """A strict local bus with no adapters, every kind of ``m*`` metrics emitted."""
    options.setdefault("rules", {"m*": ALL})
    return MetricBus(dist=None, strict=True, **options)  # type: ignore[arg-type]


def bits(values: dict[str, float]) -> dict[str, str]:
    """Each value's exact bits (``-0.0`` and ``0.0`` differ, NaN equals NaN)."""
    return {k: v.hex() for k, v in values.items()}


def committed(log: Callable[[MetricBus], None], **options: object) -> dict[str, float]:
    """What one commit emits after ``log(bus)``."""
    b = bus(**options)
    log(b)
    out = b.commit()
    b.close()
    return out


def assert_same(fast: dict[str, float], slow: dict[str, float]) -> None:
    """Every kind but std bit for bit; std within a few ulps (numpy's two-pass sum of squares)."""
    assert fast.keys() == slow.keys()
    exact_keys = [k for k in fast if not k.endswith("/std")]
    assert bits({k: fast[k] for k in exact_keys}) == bits({k: slow[k] for k in exact_keys})
    for key in fast.keys() - exact_keys:
        assert fast[key] == pytest.approx(slow[key], rel=1e-13, abs=1e-300, nan_ok=True)


# -- log(dict) -----------------------------------------------------------------------------------------------------

ROWS = [{f"m{i}": math.sin(7 * step + i) * 10.0 ** (i - 5) for i in range(10)} for step in range(40)]


def test_dict_fast_path_records_what_the_validated_path_records() -> None:
    """A dict of known names and floats (fast path) commits bitwise what an OrderedDict (validated path) does."""

    def fast(b: MetricBus) -> None:
        for row in ROWS:
            b.log(row)

    def slow(b: MetricBus) -> None:
        for row in ROWS:
            b.log(OrderedDict(row))

    assert bits(committed(fast)) == bits(committed(slow))


def test_dict_fast_path_folds_long_buffers() -> None:
    """Logging a dict many more than FOLD_AT times commits what one-by-one logging commits."""
    rows = [{"ma": float(i) * 0.1, "mb": 1.0 / (i + 1)} for i in range(5 * FOLD_AT + 3)]

    def fast(b: MetricBus) -> None:
        for row in rows:
            b.log(row)

    def one_by_one(b: MetricBus) -> None:
        for row in rows:
            for name, x in row.items():
                b.log(name, x)

    assert_same(committed(fast), committed(one_by_one))


@pytest.mark.parametrize("bad", ["x", None, 1 + 2j])
def test_dict_with_a_bad_value_records_nothing(bad: object) -> None:
    """One bad value in a dict of known names: MetricTypeError naming the metric, and no record of the call."""
    b = bus()
    b.log({"ma": 1.0, "mb": 2.0})
    with pytest.raises(MetricTypeError, match="'mb'"):
        b.log({"ma": 5.0, "mb": bad, "mc": 3.0})
    out = b.commit()
    assert out["ma/count"] == 1.0
    assert out["ma/sum"] == 1.0
    assert "mc/count" not in out
    b.close()


def test_dict_with_a_new_name_takes_the_validated_path() -> None:
    """A dict naming a metric not logged before records all of it (and the next call can take the fast path)."""
    b = bus()
    b.log({"ma": 1.0, "mb": 2.0})
    b.log({"ma": 3.0, "mb": 4.0})
    out = b.commit()
    assert (out["ma/sum"], out["mb/sum"], out["mb/first"], out["mb/last"]) == (4.0, 6.0, 2.0, 4.0)
    b.close()


def test_dict_of_a_nan_error_metric_is_checked() -> None:
    """Under nan='error' (no fast buffer) a dict with a NaN is rejected whole."""
    b = bus(nan="error")
    b.log({"ma": 1.0, "mb": 2.0})
    with pytest.raises(MetricValueError, match="'mb'"):
        b.log({"ma": 1.0, "mb": math.nan})
    assert b.commit()["ma/count"] == 1.0
    b.close()


# -- arrays --------------------------------------------------------------------------------------------------------

RNG = np.random.default_rng(15)
ARRAYS = {
    "normal": RNG.standard_normal(3000),
    "linspace": np.linspace(0.0, 1.0, 1024),
    "signed_zeros": np.array([0.0, -0.0, 0.0] * 30),
    "negative_zeros_first": np.r_[-0.0, 0.0, -RNG.random(40), RNG.random(40)],
    "integers": RNG.integers(-50, 50, 500).astype(np.float64),
    "three_components": np.array([1e16, 1.0, 1e-20] * 40),
    "wide_range": np.r_[RNG.standard_normal(100) * 1e200, RNG.standard_normal(100) * 1e-200],
    "beyond_range": np.r_[np.full(40, 1.7e308), RNG.random(40)],
    "subnormal": np.array([5e-324, 2.0**-1022, -(2.0**-1074)] * 50),
    "float32": RNG.standard_normal(700).astype(np.float32),
    "int_matrix": RNG.integers(0, 9, (30, 40)),
    "bools": RNG.random(100) > 0.5,
    "large": RNG.standard_normal(70_000) + 1e6,
}


@pytest.mark.parametrize("case", sorted(ARRAYS))
def test_array_commits_what_its_list_commits(case: str) -> None:
    """An array commits bitwise the sum/mean/min/max/first/last/count of the same values as a list."""
    x = ARRAYS[case]
    as_array = committed(lambda b: b.log("m", x))
    as_list = committed(lambda b: b.log("m", x.tolist()))
    assert_same(as_array, as_list)


@pytest.mark.parametrize("case", ["normal", "signed_zeros", "three_components", "subnormal"])
def test_array_commits_what_one_by_one_commits(case: str) -> None:
    """An array commits what logging its values one by one commits."""
    x = ARRAYS[case]

    def one_by_one(b: MetricBus) -> None:
        for v in x.tolist():
            b.log("m", v)

    assert_same(committed(lambda b: b.log("m", x)), committed(one_by_one))


def test_array_is_copied() -> None:
    """Changing the logged array afterwards changes nothing that was recorded."""
    x = np.linspace(0.0, 1.0, 100)
    expected = math.fsum(x.tolist())
    b = bus()
    b.log("m", x)
    x[:] = 7.0
    out = b.commit()
    assert out["m/sum"] == expected
    b.close()


@pytest.mark.parametrize("nan", ["propagate", "ignore"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_array_with_non_finite_values_follows_the_policy(nan: str, bad: float) -> None:
    """NaN and inf in an array give what they give in a list, under each nan policy."""
    x = np.r_[RNG.standard_normal(50), bad, RNG.standard_normal(50)]
    as_array = committed(lambda b: b.log("m", x), nan=nan)
    as_list = committed(lambda b: b.log("m", x.tolist()), nan=nan)
    assert_same(as_array, as_list)


def test_array_with_nan_under_error_records_nothing() -> None:
    """nan='error': an array with a NaN raises as its list does, and records nothing."""
    b = bus(nan="error")
    b.log("m", np.ones(40))
    x = np.r_[np.ones(40), math.nan]
    with pytest.raises(MetricValueError) as from_array:
        b.log("m", x)
    with pytest.raises(MetricValueError) as from_list:
        b.log("m", x.tolist())
    assert str(from_array.value) == str(from_list.value)
    assert b.commit()["m/count"] == 40.0
    b.close()


def test_mixed_floats_arrays_and_weights_keep_log_order() -> None:
    """Floats, arrays and weighted records of one metric commit what the same records as lists commit."""
    a, c = RNG.standard_normal(300), RNG.standard_normal(40) * 3

    def steps(as_list: bool) -> Callable[[MetricBus], None]:
        def log(b: MetricBus) -> None:
            b.log("m", 9.5)
            b.log("m", a.tolist() if as_list else a)
            b.log("m", [1.0, 2.0], weight=[0.5, 3.0])
            b.log("m", c.tolist() if as_list else c)
            b.log("m", -4.25)
            b.log("m", a.tolist() if as_list else a)
            b.log("m", 2.5, weight=2.0)
            b.log("m", c.tolist() if as_list else c)

        return log

    assert_same(committed(steps(False)), committed(steps(True)))


def test_array_with_weights_matches_its_list() -> None:
    """A weighted array commits what the same values and weights as lists commit."""
    x, w = RNG.standard_normal(200), RNG.random(200)
    as_array = committed(lambda b: b.log("m", x, weight=w))
    as_list = committed(lambda b: b.log("m", x.tolist(), weight=w.tolist()))
    assert_same(as_array, as_list)


def test_arrays_across_update_boundaries() -> None:
    """Arrays logged in several updates reduce as their lists do (mean of update means)."""

    def updates(as_list: bool) -> Callable[[MetricBus], None]:
        def log(b: MetricBus) -> None:
            for i in range(3):
                x = ARRAYS["normal"][i * 1000 : (i + 1) * 1000]
                with b.update():
                    b.log("m", x.tolist() if as_list else x)

        return log

    rules = {"m*": ["mean", "std", "max"]}
    assert_same(committed(updates(False), rules=rules), committed(updates(True), rules=rules))


# -- the vectorized pieces -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["normal", "three_components", "wide_range", "subnormal", "large", "integers"])
def test_array_components_are_the_exact_components(case: str) -> None:
    """exact.array_components equals exact.components of the same values."""
    x = np.asarray(ARRAYS[case], dtype=np.float64).ravel()
    got = exact.array_components(x, float(np.max(np.abs(x))))
    assert got == exact.components(x.tolist())


def test_of_arrays_matches_of_batch_for_any_split() -> None:
    """of_arrays of any split of the values equals of_batch of them (std within ulps)."""
    x = ARRAYS["large"][:20000]
    whole = Summary.of_batch(x.tolist(), None)
    for parts in (7, 3, 1):
        got = of_arrays(np.array_split(x, parts))
        assert got._replace(m2=0.0) == whole._replace(m2=0.0)
        assert got.m2 == pytest.approx(whole.m2, rel=1e-12)
