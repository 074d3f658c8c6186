"""The fold of logged numpy arrays (``of_arrays``) records what ``Summary.of_batch`` of the same list records."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from metricbus import exact
from metricbus.summary import EMPTY, Summary
from metricbus.summary_arrays import of_arrays

Array = np.ndarray[Any, Any]
TINY = 5e-324
# Values that break naive sums and orderings: non-finite ones, signed zeros, subnormals, the edge of the double range,
# and 1e16, 1, 1e-20, whose exact sum needs three components.
FINITE_EDGES = [0.0, -0.0, TINY, -TINY, 2.2250738585072014e-308, 1e-300, 1e16, -1e16, 1.0, -1.0, 1e-20, 0.1, 2.0**900]
NON_FINITE_EDGES = [math.nan, math.inf, -math.inf, 1.8e308, -1.8e308]
SHAPES = ["normal", "lognormal", "integers", "linspace", "exponents", "constant"]


def exact_bits(value: object) -> object:
    """Every float as its exact bits (``-0.0`` and ``0.0`` differ, NaN equals NaN), through nested tuples."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, tuple):
        return tuple(exact_bits(v) for v in value)
    return value


def base_values(rng: np.random.Generator, shape: str, size: int) -> Array:
    """``size`` records of a common shape of data."""
    if shape == "normal":
        return rng.standard_normal(size) * 10.0 ** rng.integers(-5, 6)
    if shape == "lognormal":
        return rng.lognormal(5.0, 1.0, size)
    if shape == "integers":
        return rng.integers(-3, 1000, size).astype(np.float64)
    if shape == "linspace":
        return np.linspace(0.0, 1.0, size)
    if shape == "exponents":  # every binade from subnormal to 2**900, both signs: many extraction rounds
        signs = rng.choice([-1.0, 1.0], size)
        return signs * np.ldexp(rng.random(size) + 0.5, rng.integers(-1080, 900, size))
    return np.full(size, 0.1)


@st.composite
def chunked(draw: st.DrawFn, sizes: st.SearchStrategy[int] | None = None) -> list[Array]:
    """Records of a common shape sprinkled with edge values, cut into chunks (empty ones included)."""
    size = draw(sizes if sizes is not None else st.one_of(st.integers(0, 40), st.integers(0, 20000)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = base_values(rng, draw(st.sampled_from(SHAPES)), size)
    edges = FINITE_EDGES + (NON_FINITE_EDGES if draw(st.booleans()) else [])
    spots = rng.random(size) < draw(st.sampled_from([0.0, 0.001, 0.05, 0.5]))
    values[spots] = rng.choice(edges, int(spots.sum()))
    cuts = np.sort(rng.integers(0, size + 1, draw(st.integers(0, 60))))
    return [np.array(part, dtype=np.float64) for part in np.split(values, cuts)]


def assert_folds_as_of_batch(chunks: list[Array]) -> None:
    """Every field of the fold but m2 is bit for bit of_batch's of the whole list; m2 is within 1e-12 of it (BLAS
    dots against math.dist: an ulp or two on common data, tens of ulps on the hostile mixes)."""
    values = np.concatenate(chunks).tolist()
    got = of_arrays(chunks)
    if not values:
        assert got == EMPTY
        return
    want = Summary.of_batch(values, None)
    assert exact_bits(got._replace(m2=0.0)) == exact_bits(want._replace(m2=0.0))
    # Data with no spread (99,999 copies of 0.1): the exact m2 is 0, and either side may keep a rounding residue
    # far below the data's own scale (1.9e-29 here, next to Σx² = 1e3): allow 2**-96 of Σx² as well.
    with np.errstate(over="ignore", invalid="ignore"):
        scale = float(np.sum(np.square(np.concatenate(chunks)))) * 2.0**-96
    floor = scale if math.isfinite(scale) else 0.0
    assert got.m2 == pytest.approx(want.m2, rel=1e-12, abs=max(1e-300, floor), nan_ok=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked())
def test_fold_is_of_batch_of_the_concatenated_records(chunks: list[Array]) -> None:
    """Every field of the fold but m2 is bit for bit of_batch's of the whole list; m2 is within 1e-12 of it."""
    assert_folds_as_of_batch(chunks)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked(st.integers(30000, 100000)))
def test_fold_of_several_blocks_is_of_batch_of_the_concatenated_records(chunks: list[Array]) -> None:
    """Folds longer than one block (their summaries merged, long chunks cut) record what of_batch records too."""
    assert_folds_as_of_batch(chunks)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked())
def test_fold_is_deterministic(chunks: list[Array]) -> None:
    """The same records in the same chunks fold to the same bits, m2 included, whatever arrays hold them."""
    if any(c.size for c in chunks):
        copies = [c.copy() for c in chunks]
        assert exact_bits(of_arrays(chunks)) == exact_bits(of_arrays(copies))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20000), st.integers(0, 2**32 - 1), st.sampled_from([*SHAPES, "edges"]))
def test_array_components_are_the_greedy_components(size: int, seed: int, shape: str) -> None:
    """array_components of finite records is exact.components of their list, with or without a least |x| given."""
    rng = np.random.default_rng(seed)
    x = rng.choice(np.array(FINITE_EDGES), size) if shape == "edges" else base_values(rng, shape, size)
    magnitudes = np.abs(x)
    largest = float(magnitudes.max())
    assume(largest > 0.0)
    want = exact.components(x.tolist())
    assert exact.array_components(x, largest) == want
    smallest = float(magnitudes[magnitudes > 0.0].min())
    assert exact.array_components(x, largest, smallest=smallest) == want


def test_three_components_and_subnormals_in_one_block() -> None:
    """1e16, 1, 1e-20 and a subnormal, repeated in one block, keep every component of their exact sum."""
    x = np.tile([1e16, 1.0, 1e-20, TINY, -0.0], 4000)
    chunks = np.array_split(x, 7)
    got, want = of_arrays(chunks), Summary.of_batch(x.tolist(), None)
    assert exact_bits(got._replace(m2=0.0)) == exact_bits(want._replace(m2=0.0))
    assert want.rest  # the case is the one it claims to be


def test_signed_zeros_keep_the_first_one_as_min_and_max() -> None:
    """A block of zeros only: min and max are the first zero logged, as min() and max() of the list give."""
    for first in (0.0, -0.0):
        x = np.array([first, -first] * 100)
        got, want = of_arrays([x]), Summary.of_batch(x.tolist(), None)
        assert exact_bits(got) == exact_bits(want)


@pytest.mark.parametrize("size", [17, 1000, 8192, 20000])
def test_dynamic_range_at_the_edge_of_one_extraction_round(size: int) -> None:
    """Records whose residuals all round the same way, with one small record whose last bit is set, at every
    ratio of largest to smallest around where one extraction round stops sufficing: still the exact sum."""
    big = 1.0 + 2.0**-38 - 2.0**-52  # leaves a residual of nearly half a unit, of one sign, in every round
    for shift in range(70):
        small = (1.0 + 2.0**-52) * 2.0**-shift
        x = np.full(size, big)
        x[size // 2] = small
        assert exact.array_components(x, big) == exact.components(x.tolist()), shift
        got, want = of_arrays([x]), Summary.of_batch(x.tolist(), None)
        assert exact_bits(got._replace(m2=0.0)) == exact_bits(want._replace(m2=0.0)), shift


def exact_m2(values: Array) -> float:
    """Σ(x - mean)², computed exactly and rounded once."""
    records = [Fraction(v) for v in values.tolist()]
    mean = sum(records, Fraction(0)) / len(records)
    return float(sum((v - mean) ** 2 for v in records))


@pytest.mark.parametrize("shape", ["normal", "lognormal", "integers", "linspace"])
@pytest.mark.parametrize("size", [20480, 40000])
def test_m2_of_common_data_is_within_a_few_ulps(shape: str, size: int) -> None:
    """On common data the fold's m2 (of one block, or of two merged) is within a few ulps of the exact value."""
    x = base_values(np.random.default_rng(5), shape, size)
    want = exact_m2(x)
    assert abs(of_arrays(np.array_split(x, size // 1024)).m2 - want) <= 4 * math.ulp(want)


def test_a_fold_of_records_without_spread() -> None:
    """99,999 copies of 0.1 (several blocks): hypothesis found of_batch's m2 1.9e-29 next to the fold's 0.0."""
    assert_folds_as_of_batch([np.full(99_999, 0.1)])
