"""Property tests of the sketch state (metricbus.sketch, metricbus.sketch_level): the bucket mapping is ddsketch's,
quantiles meet the stated accuracy against numpy's ``method="lower"`` rank, and merge is exact under every split."""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
from ddsketch.mapping import CubicallyInterpolatedMapping
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metricbus import sketch_level
from metricbus.sketch import (
    ALPHA,
    EMPTY_SKETCH,
    GAMMA,
    HUGE,
    MAX_KEY,
    MIN_KEY,
    MULTIPLIER,
    TINY,
    Sketch,
    key_of,
    merge_all,
    value_of,
)

MAPPING = CubicallyInterpolatedMapping(ALPHA)
QS = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
DISTRIBUTIONS = ("lognormal", "uniform", "pareto", "cauchy", "negative", "mixed", "zero_heavy")
SPECIAL = [0.0, -0.0, 5e-324, -1e-300, TINY, -TINY, 1.0, -1.0, 1e30, -1e300, 1.7976931348623157e308, math.nan,
           math.inf, -math.inf]  # fmt: skip
magnitudes = st.floats(min_value=TINY, max_value=HUGE, exclude_max=True)
finite = st.floats(min_value=-HUGE, max_value=HUGE, exclude_min=True, exclude_max=True)
anything = st.one_of(st.floats(), st.sampled_from(SPECIAL))
records = st.lists(anything, max_size=30)
fast = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def draw_data(kind: str, n: int, seed: int) -> np.ndarray:
    """``n`` records of one of DISTRIBUTIONS (heavy tails and signs included)."""
    rng = np.random.default_rng(seed)
    table = {
        "lognormal": lambda: rng.lognormal(0.0, 3.0, n),
        "uniform": lambda: rng.uniform(-1e3, 1e3, n),
        "pareto": lambda: rng.pareto(0.7, n) + 1e-3,
        "cauchy": lambda: rng.standard_cauchy(n),
        "negative": lambda: -rng.lognormal(2.0, 4.0, n),
        "mixed": lambda: rng.choice([-1.0, 1.0], n) * rng.lognormal(0.0, 5.0, n),
        "zero_heavy": lambda: np.where(rng.random(n) < 0.6, rng.choice([0.0, -0.0, 1e-25], n), rng.normal(0, 1, n)),
    }
    return table[kind]()


def assert_within(reported: float, true: float) -> None:
    """The stated guarantee: NaN and ±inf exact, the zero bucket reported as 0, else within ALPHA·|true|."""
    if math.isnan(true):
        assert math.isnan(reported)
    elif math.isinf(true):
        assert reported == true
    elif abs(true) < TINY:
        assert reported == 0.0
    else:
        assert abs(reported - true) <= ALPHA * abs(true), (reported, true)


def lower(data: np.ndarray, q: float) -> float:
    """numpy's order statistic at rank floor(q·(n−1))."""
    return float(np.quantile(data, q, method="lower"))


def test_multiplier_and_gamma_are_the_librarys() -> None:
    """MULTIPLIER and GAMMA are ddsketch's ``_multiplier`` and ``gamma`` for ALPHA, bit for bit."""
    assert MAPPING._multiplier == MULTIPLIER
    assert MAPPING.gamma == GAMMA


@fast
@given(magnitudes)
def test_key_of_is_the_librarys_key(magnitude: float) -> None:
    """key_of(v) == ddsketch's key(v) for any v in [TINY, HUGE)."""
    assert key_of(magnitude) == MAPPING.key(magnitude)


def test_keys_are_the_librarys_at_bucket_edges_and_in_bulk() -> None:
    """key_of, and the vectorized keys of_values counts, agree with ddsketch on 20k log-uniform values and on both
    neighbours of every bucket boundary."""
    rng = np.random.default_rng(1)
    spread = np.exp2(rng.uniform(-64.0, 64.0, 20_000))
    boundaries = np.array([value_of(k) * (1.0 + GAMMA) / 2.0 for k in range(MIN_KEY, MAX_KEY)])
    near = np.concatenate([boundaries, np.nextafter(boundaries, 0.0), np.nextafter(boundaries, math.inf)])
    values = np.concatenate([spread, near[(near >= TINY) & (near < HUGE)], [TINY, np.nextafter(HUGE, 0.0)]])
    expected = [MAPPING.key(float(v)) for v in values]
    assert [key_of(float(v)) for v in values] == expected
    counted = Sketch.of_values(values)
    found = np.bincount(np.array(expected) - counted.pos_lo)
    assert counted.pos.tolist() == found.tolist()
    assert Sketch.of_values(-values).neg.tolist() == found.tolist()
    assert Sketch.of_values(np.append(values, 0.0)).pos.tolist() == found.tolist()  # the mixed-data path too


def test_value_of_is_the_librarys_value() -> None:
    """value_of(k) == ddsketch's value(k) for every key from MIN_KEY to MAX_KEY."""
    assert [value_of(k) for k in range(MIN_KEY, MAX_KEY + 1)] == [MAPPING.value(k) for k in range(MIN_KEY, MAX_KEY + 1)]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DISTRIBUTIONS), st.integers(1, 5000), st.integers(0, 2**32 - 1),
       st.lists(st.floats(0.0, 1.0), max_size=3))  # fmt: skip
def test_quantiles_are_within_alpha_of_numpys_lower(kind: str, n: int, seed: int, more: list[float]) -> None:
    """Every quantile is within ALPHA of numpy.quantile(method='lower'), on every distribution and size."""
    data = draw_data(kind, n, seed)
    sketch = Sketch.of_values(data)
    for q in (*QS, *more):
        assert_within(sketch.quantile(q), lower(data, q))


@fast
@given(st.lists(finite, min_size=1, max_size=60), st.floats(0.0, 1.0))
def test_quantiles_of_any_finite_records_are_within_alpha(values: list[float], q: float) -> None:
    """Subnormals, zeros, bucket edges: any finite record below 1e19 in magnitude meets the guarantee."""
    data = np.array(values)
    sketch = Sketch.of_values(data)
    for p in (*QS, q):
        assert_within(sketch.quantile(p), lower(data, p))


def test_the_top_bucket_below_huge_is_within_alpha() -> None:
    """A record just below HUGE (0.985 * 2**64, key MAX_KEY) is reported within ALPHA, as the docstring promises."""
    for x in (0.985 * HUGE, -0.985 * HUGE):
        assert_within(Sketch.of_value(x).quantile(0.5), x)


def test_of_values_leaves_the_callers_array_alone() -> None:
    """Sketching an array (the all-positive fast path and the mixed one) does not change it."""
    for data in (np.array([1.0, 2.5, 1e30]), np.array([-1.0, 0.0, math.nan, 3.0])):
        before = data.copy()
        Sketch.of_values(data)
        assert np.array_equal(data, before, equal_nan=True)


@fast
@given(records, st.lists(st.integers(0, 4), min_size=30, max_size=30), st.permutations(range(5)))
def test_merge_of_any_split_is_the_sketch_of_the_whole(values: list[float], cut: list[int], order: list[int]) -> None:
    """Merging the parts' sketches, in any order, gives exactly the sketch of the unsplit records."""
    labelled = list(zip(values, cut, strict=False))  # cut is at least as long as values
    parts = [Sketch.of_values(np.array([v for v, c in labelled if c == label])) for label in order]
    whole = Sketch.of_values(np.array(values))
    assert functools.reduce(Sketch.merge, parts, EMPTY_SKETCH) == whole
    assert merge_all(parts) == whole
    assert functools.reduce(Sketch.merge, [Sketch.of_value(v) for v in values], EMPTY_SKETCH) == whole


@fast
@given(records, records, records)
def test_merge_is_associative_and_commutative(a: list[float], b: list[float], c: list[float]) -> None:
    """(a·b)·c == a·(b·c) and a·b == b·a, exactly."""
    x, y, z = (Sketch.of_values(np.array(v)) for v in (a, b, c))
    assert x.merge(y).merge(z) == x.merge(y.merge(z))
    assert x.merge(y) == y.merge(x)
    assert merge_all([x, merge_all([y, z])]) == merge_all([merge_all([z, x]), y])


@fast
@given(records)
def test_the_empty_sketch_is_neutral(values: list[float]) -> None:
    """EMPTY_SKETCH merged on either side, or in merge_all, changes nothing; it is the sketch of no records."""
    s = Sketch.of_values(np.array(values))
    assert EMPTY_SKETCH.merge(s) == s
    assert s.merge(EMPTY_SKETCH) == s
    assert merge_all([EMPTY_SKETCH, s, EMPTY_SKETCH]) == s
    assert Sketch.of_values(np.zeros(0)) == EMPTY_SKETCH
    assert EMPTY_SKETCH.count == 0
    assert math.isnan(EMPTY_SKETCH.quantile(0.5))


@fast
@given(st.lists(records, max_size=6))
def test_merge_all_is_folded_merge(groups: list[list[float]]) -> None:
    """merge_all(sketches) == the left fold of merge over them."""
    sketches = [Sketch.of_values(np.array(g)) for g in groups]
    assert merge_all(sketches) == functools.reduce(Sketch.merge, sketches, EMPTY_SKETCH)


@fast
@given(records)
def test_ints_round_trip(values: list[float]) -> None:
    """from_ints(to_ints()) is the same sketch, and count is the number of records."""
    s = Sketch.of_values(np.array(values))
    assert Sketch.from_ints(s.to_ints()) == s
    assert Sketch.from_ints(list(s.to_ints())).to_ints() == s.to_ints()
    assert s.count == len(values)


def test_from_ints_rejects_lengths_that_disagree() -> None:
    """A flat form with too few or too many counts is a ValueError."""
    ints = Sketch.of_values(np.array([1.0, 2.0, -3.0])).to_ints()
    for bad in (ints[:-1], (*ints, 1), ints[:5]):
        with pytest.raises(ValueError, match="sketch"):
            Sketch.from_ints(bad)


def test_any_nan_makes_every_quantile_nan() -> None:
    """One NaN among the records: every quantile is NaN; the NaN is counted."""
    s = Sketch.of_values(np.array([1.0, math.nan, 2.0, math.inf]))
    assert (s.count, s.nan) == (4, 1)
    assert all(math.isnan(s.quantile(q)) for q in QS)


def test_infinities_are_reported_as_infinities() -> None:
    """±inf records sit below and above every finite one and are reported as ±inf."""
    s = Sketch.of_values(np.array([-math.inf, 1.0, 2.0, 3.0, math.inf, math.inf]))
    assert (s.inf, s.ninf) == (2, 1)
    assert s.quantile(0.0) == -math.inf
    assert s.quantile(1.0) == math.inf
    assert s.quantile(0.8) == math.inf
    assert_within(s.quantile(0.4), 2.0)


def test_the_zero_bucket_holds_magnitudes_below_tiny() -> None:
    """0, -0, subnormals and |x| < 2**-64 count as zero and are reported as 0; TINY itself is a bucket."""
    below = [0.0, -0.0, 5e-324, -1e-300, np.nextafter(TINY, 0.0)]
    s = Sketch.of_values(np.array(below))
    assert (s.zero, len(s.pos), len(s.neg)) == (5, 0, 0)
    assert s.quantile(0.0) == s.quantile(1.0) == 0.0
    t = Sketch.of_values(np.array([TINY, -TINY]))
    assert (t.zero, t.pos_lo, t.neg_lo) == (0, MIN_KEY, MIN_KEY)


def test_magnitudes_beyond_huge_clamp_to_the_outermost_bucket() -> None:
    """|x| >= HUGE counts in key MAX_KEY of its sign and is reported as that bucket's value (within ALPHA of HUGE)."""
    s = Sketch.of_values(np.array([HUGE, 1e30, 1.7976931348623157e308, -1e300]))
    assert (s.pos_lo, len(s.pos), int(s.pos[0])) == (MAX_KEY, 1, 3)
    assert (s.neg_lo, len(s.neg)) == (MAX_KEY, 1)
    assert s.quantile(1.0) == value_of(MAX_KEY)
    assert s.quantile(0.0) == -value_of(MAX_KEY)


@fast
@given(st.lists(anything, max_size=40), st.floats(-1e6, 1e6), st.integers(1, 80))
def test_histogram_bins(values: list[float], one_finite: float, bins: int) -> None:
    """Edges increase, len(edges) == len(counts) + 1, at most ``bins`` bins, and they hold every non-NaN record."""
    s = Sketch.of_values(np.array([*values, one_finite]))
    edges, counts = s.histogram(bins=bins)
    assert len(edges) == len(counts) + 1
    assert 1 <= len(counts) <= bins
    assert all(lo < hi for lo, hi in itertools.pairwise(edges))
    assert sum(counts) == s.count - s.nan
    assert all(c >= 0 for c in counts)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DISTRIBUTIONS), st.integers(1, 500), st.integers(0, 2**32 - 1), st.integers(1, 80))
def test_histogram_bins_hold_their_records(kind: str, n: int, seed: int, bins: int) -> None:
    """Each bin counts exactly the records in (edges[i], edges[i + 1]] (continuous data: no record on an edge)."""
    data = draw_data(kind, n, seed)
    edges, counts = Sketch.of_values(data).histogram(bins=bins)
    held = [int(((data > lo) & (data <= hi)).sum()) for lo, hi in itertools.pairwise(edges)]
    assert held == list(counts)


def test_histogram_of_nothing_is_empty() -> None:
    """No record with a bin, no bins: the empty sketch and all-NaN records (README: wandb leaves such a hist out);
    ±inf records alone have the outermost buckets' bins (test_review_distributions.py)."""
    assert EMPTY_SKETCH.histogram() == ((), ())
    assert Sketch.of_values(np.array([math.nan])).histogram() == ((), ())
    assert Sketch.of_values(np.array([math.inf, -math.inf, math.nan])).histogram()[1] == (1, 0, 1)


sketches = st.one_of(st.none(), records.map(lambda v: Sketch.of_values(np.array(v))))


@fast
@given(st.integers(1, 4).flatmap(lambda c: st.lists(st.lists(sketches, min_size=c, max_size=c), min_size=1,
                                                     max_size=5)))  # fmt: skip
def test_two_pass_collective_equals_the_single_process_merge(grid: list[list[Sketch | None]]) -> None:
    """bounds -> elementwise max -> counts under the agreed bounds -> elementwise sum -> finish == merge, exactly."""
    agreed = np.maximum.reduce([sketch_level.bounds(row) for row in grid])
    summed = np.sum([sketch_level.counts(row, agreed) for row in grid], axis=0, dtype=np.int64)
    two_pass = sketch_level.finish(agreed, summed)
    columns = [[row[c] for row in grid if row[c] is not None] for c in range(len(grid[0]))]
    assert two_pass == sketch_level.merge(columns)
    assert two_pass == [merge_all(column) for column in columns]  # type: ignore[arg-type]
    assert [s.to_ints() for s in two_pass] == [functools.reduce(Sketch.merge, col, EMPTY_SKETCH).to_ints()
                                               for col in columns]  # fmt: skip


def test_the_cell_table_gives_the_exact_keys() -> None:
    """keys() (a cell table, exact_keys where a bucket boundary crosses a cell) equals exact_keys at both ends of
    every cell from TINY to HUGE, next to every bucket boundary, and on random values."""
    from metricbus.sketch import exact_keys, keys

    first = np.arange((1023 - 64) << 10, (1023 + 64) << 10, dtype=np.int64)
    ends = np.concatenate([(first << 42).view(np.float64), (((first + 1) << 42) - 1).view(np.float64)])
    mapping = CubicallyInterpolatedMapping(0.01)
    bounds = np.array([mapping._pow_gamma(k) for k in range(MIN_KEY, MAX_KEY)])
    near = np.concatenate([bounds, np.nextafter(bounds, 0.0), np.nextafter(bounds, np.inf)])
    spread = np.exp(np.random.default_rng(0).uniform(-44.3, 44.3, 200_000))
    values = np.concatenate([ends, near, spread])
    values = values[(values >= TINY) & (values < HUGE)]
    assert np.array_equal(keys(values), exact_keys(values))
