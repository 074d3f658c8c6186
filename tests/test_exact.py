"""Exact sums: sum, mean, count, min and max of any split and merge grouping equal the unsplit exact reference."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from metricbus import exact
from metricbus.kinds import KIND_NAMES, KINDS
from metricbus.summary import EMPTY, Summary

MAX = sys.float_info.max
TINY = 5e-324
Batch = tuple[list[float], list[float] | None]

# --- references, on the whole unsplit data ---------------------------------------------------------------------


def rounded(value: Fraction) -> float:
    """The correctly rounded double of an exact value, ±inf beyond the range."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def product(w: float, x: float) -> Fraction | float:
    """A record's w·x as Summary defines it: ``fl(w·x) + fl(w·x - fl(w·x))``, or the IEEE ``w*x`` if that overflows."""
    p = w * x
    if not math.isfinite(p):
        return p
    return Fraction(p) + Fraction(rounded(Fraction(w) * Fraction(x) - Fraction(p)))


def expected(batches: Sequence[Batch]) -> dict[str, float]:
    """sum, mean, count, min and max of the records of ``batches``, exactly (Fraction), unsplit."""
    xs = [x for values, _ in batches for x in values]
    ws = [w for values, weights in batches for w in (weights or [1.0] * len(values))]
    products = [product(w, x) for w, x in zip(ws, xs, strict=True)]
    overflowed = [p for p in products if isinstance(p, float)]
    weight = sum(map(Fraction, ws))
    if weight == 0:
        mean = math.nan
    elif overflowed:
        mean = sum(overflowed)  # ±inf or NaN (IEEE), over a positive finite weight
    else:
        mean = rounded(sum(products, Fraction(0)) / weight)
    return {
        "sum": rounded(sum(map(Fraction, xs))),
        "mean": mean,
        "count": float(len(xs)),
        "min": min(xs),
        "max": max(xs),
    }


def same(a: float, b: float) -> bool:
    """Identical doubles (NaN equals NaN; the sign of a zero is not compared)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def check(s: Summary, batches: Sequence[Batch]) -> None:
    """Every exact kind equals the reference; no kind raises."""
    got = {kind: KINDS[kind](s) for kind in KIND_NAMES}  # std included: it must not raise
    for kind, want in expected(batches).items():
        assert same(got[kind], want), (kind, got[kind], want)
    assert got["std"] >= 0.0 or math.isnan(got["std"])


# --- splitting and grouping ------------------------------------------------------------------------------------


def compositions(n: int) -> Iterator[list[int]]:
    """Every way to cut ``n`` records, in order, into non-empty batches (as batch sizes)."""
    for mask in range(1 << (n - 1)):
        sizes, size = [], 1
        for i in range(n - 1):
            if mask >> i & 1:
                sizes.append(size)
                size = 1
            else:
                size += 1
        yield [*sizes, size]


def groupings(parts: Sequence[Summary]) -> Iterator[Summary]:
    """The merge of ``parts`` (in order) under every bracketing."""
    if len(parts) == 1:
        yield parts[0]
        return
    for cut in range(1, len(parts)):
        for left in groupings(parts[:cut]):
            for right in groupings(parts[cut:]):
                yield left.merge(right)


def every_split(values: list[float], *, weighted: bool) -> Iterator[tuple[Summary, list[Batch]]]:
    """Every split of ``values`` into batches (weights 1 as lists, or None), merged under every grouping."""
    for sizes in compositions(len(values)):
        batches: list[Batch] = []
        start = 0
        for size in sizes:
            part = values[start : start + size]
            batches.append((part, [1.0] * size if weighted else None))
            start += size
        for merged in groupings([Summary.of_batch(v, w) for v, w in batches]):
            yield merged, batches


# --- the reported cases, verbatim ------------------------------------------------------------------------------


def test_a_second_moment_that_overflows_is_inf() -> None:
    """of_batch([1e155, -1e155]) does not raise: its m2 overflows, so std is inf."""
    s = Summary.of_batch([1e155, -1e155], None)
    assert s.m2 == math.inf
    assert KINDS["std"](s) == math.inf
    assert KINDS["sum"](s) == 0.0
    assert KINDS["mean"](s) == 0.0


@pytest.mark.parametrize("weighted", [False, True])
def test_a_sum_that_needs_three_doubles_is_correctly_rounded_under_every_split(weighted: bool) -> None:
    """[1e16, 1, 1e-20] sums to 1.0000000000000002e16 (not 1e16) under every split and grouping; mean likewise."""
    values = [1e16, 1.0, 1e-20]
    exact_sum = Fraction(1e16) + 1 + Fraction(1e-20)
    assert float(exact_sum) == 1.0000000000000002e16
    n = 0
    for merged, batches in every_split(values, weighted=weighted):
        assert KINDS["sum"](merged) == 1.0000000000000002e16
        assert KINDS["mean"](merged) == float(exact_sum / 3)
        check(merged, batches)
        n += 1
    assert n == 1 + 1 + 1 + 2  # 4 splits; the 3-batch one merges in 2 groupings


@pytest.mark.parametrize("weighted", [False, True])
def test_a_partial_sum_beyond_the_range_still_gives_the_exact_result(weighted: bool) -> None:
    """[1e308, 1e308] merged later with [-1e308, -1e308, 1e308] gives exactly 1e308, under every split too."""
    ones = [1.0, 1.0] if weighted else None
    left = Summary.of_batch([1e308, 1e308], ones)
    right = Summary.of_batch([-1e308, -1e308, 1e308], [1.0] * 3 if weighted else None)
    assert KINDS["sum"](left) == math.inf
    assert KINDS["mean"](left) == 1e308
    assert KINDS["sum"](left.merge(right)) == 1e308
    assert KINDS["sum"](right.merge(left)) == 1e308
    for merged, batches in every_split([1e308, 1e308, -1e308, -1e308, 1e308], weighted=weighted):
        assert KINDS["sum"](merged) == 1e308
        check(merged, batches)


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ([1e308, 1e308], math.inf),
        ([-1e308, -1e308, 1e307], -math.inf),
        ([MAX, MAX, -MAX], MAX),
        ([MAX, 2.0**970], math.inf),  # exactly half an ulp above MAX: rounds (to even) to inf
        ([MAX, 2.0**970, -TINY], MAX),
    ],
)
def test_a_sum_beyond_the_range_is_inf_with_the_right_sign(values: list[float], want: float) -> None:
    """An exact sum beyond the double range is ±inf, whatever the split; one just inside it is exact."""
    for merged, _ in every_split(values, weighted=False):
        assert KINDS["sum"](merged) == want


def test_non_finite_data_keeps_ieee_semantics() -> None:
    """NaN propagates, inf sums as IEEE says (inf - inf is NaN), whatever the split."""
    cases = [([1.0, math.nan, 2.0], math.nan), ([1e308, 1e308, math.inf], math.inf), ([math.inf, -math.inf], math.nan)]
    for values, want in cases:
        for merged, _ in every_split(values, weighted=False):
            assert same(KINDS["sum"](merged), want)
            assert same(KINDS["mean"](merged), want)


def test_a_product_that_overflows_is_inf_in_the_weighted_sum() -> None:
    """w·x beyond the range is IEEE's ±inf (exact Σw·x is kept only for products within it); nothing raises."""
    s = Summary.of_batch([1e308, 1.0], [10.0, 1.0])
    assert KINDS["mean"](s) == math.inf
    assert KINDS["std"](s) == math.inf


def test_weighted_non_finite_data_keeps_ieee_semantics() -> None:
    """With weights too: NaN propagates and inf sums as IEEE says; std is NaN; nothing raises."""
    s = Summary.of_batch([1.0, math.inf, 2.0], [0.5, 2.0, 1.0])
    assert KINDS["sum"](s) == math.inf
    assert KINDS["mean"](s) == math.inf
    assert math.isnan(KINDS["std"](s))
    s = s.merge(Summary.of_batch([-math.inf], [1.0]))
    assert math.isnan(KINDS["sum"](s))
    assert math.isnan(KINDS["mean"](s))


def test_a_weighted_second_moment_that_overflows_is_inf() -> None:
    """Σw·(x - mean)² beyond the range (an intermediate overflow in the second pass) gives inf, not an error."""
    s = Summary.of_batch([1e154, -1e154, 1e154, -1e154], [1.0, 2.0, 2.0, 1.0])
    assert s.m2 == math.inf
    assert KINDS["std"](s) == math.inf


def test_std_of_tiny_weights_does_not_overflow() -> None:
    """m2 / Σw may overflow where its square root does not: std is still the finite value."""
    s = Summary.of_batch([0.0, 1e200], [TINY, TINY])
    assert KINDS["std"](s) == pytest.approx(5e199, rel=1e-12)
    merged = Summary.of_batch([0.0], [TINY]).merge(Summary.of_batch([1e200], [TINY]))
    assert KINDS["std"](merged) == pytest.approx(5e199, rel=1e-12)


def test_the_twelve_positional_fields_still_build_a_summary() -> None:
    """Summary(...) with the 12 fixed fields (as tensors.py builds it) has no further components."""
    s = Summary(2, 2.0, 0.0, 3.0, 0.0, 3.0, 0.0, 0.5, 1.0, 2.0, 1.0, 2.0)
    assert s.rest == ()
    assert s.rest_flat() == ()
    assert KINDS["mean"](s) == 1.5


# --- properties over the whole double range --------------------------------------------------------------------

EDGES = [MAX, 1e308, 1.5e308, 1e155, 1e16, 1.0, 1e-20, 2.0**-1022, TINY, 3 * TINY, 0.0]
VALUES = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([*EDGES, *(-x for x in EDGES)]),
    st.integers(-(10**6), 10**6).map(float),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
)
WEIGHTS = st.one_of(
    st.just(0.0),
    st.just(1.0),
    st.floats(0.0, MAX),
    st.floats(1e-3, 1e3),
    st.sampled_from([TINY, 0.5, 3.0, 1e-300, 1e300]),
)


@st.composite
def records(draw: st.DrawFn, *, max_size: int = 12) -> list[tuple[float, float | None]]:
    """Records ``(x, w)`` (w None: unit weight, unweighted batch), with cancelling pairs drawn in on purpose."""
    weighted = draw(st.booleans())
    xs = draw(st.lists(VALUES, min_size=1, max_size=max_size))
    negated = draw(st.lists(st.sampled_from(xs), max_size=4))  # -x somewhere: cancellation
    xs = draw(st.permutations([*xs, *(-x for x in negated)]))
    if not weighted:
        return [(x, None) for x in xs]
    return [(x, draw(WEIGHTS)) for x in xs]


def batches_of(recs: list[tuple[float, float | None]], cuts: list[int]) -> list[Batch]:
    """``recs`` cut (in order) at ``cuts`` into non-empty batches."""
    bounds = [0, *sorted(set(cuts)), len(recs)]
    out: list[Batch] = []
    for lo, hi in itertools.pairwise(bounds):
        part = recs[lo:hi]
        if part:
            values = [x for x, _ in part]
            weights = None if part[0][1] is None else [w if w is not None else 1.0 for _, w in part]
            out.append((values, weights))
    return out


@st.composite
def split_case(draw: st.DrawFn) -> tuple[list[Batch], Summary]:
    """Records cut into batches, summarised, then merged in a random grouping (empties slipped in)."""
    recs = draw(records())
    cuts = draw(st.lists(st.integers(1, len(recs)), max_size=len(recs)))
    batches = batches_of(recs, cuts)
    parts = [Summary.of_batch(values, weights) for values, weights in batches]
    while len(parts) > 1:
        i = draw(st.integers(0, len(parts) - 2))
        left, right = parts[i], parts[i + 1]
        if draw(st.booleans()):
            left = left.merge(EMPTY) if draw(st.booleans()) else EMPTY.merge(left)
        parts[i : i + 2] = [left.merge(right)]
    return batches, parts[0]


@settings(max_examples=400, deadline=None)
@given(split_case())
def test_any_split_and_grouping_gives_the_exact_unsplit_value(case: tuple[list[Batch], Summary]) -> None:
    """sum, mean, count, min, max of any split, merged in any grouping, equal the exact reference; std never raises."""
    batches, merged = case
    check(merged, batches)


@settings(max_examples=200, deadline=None)
@given(split_case())
def test_the_components_are_canonical(case: tuple[list[Batch], Summary]) -> None:
    """Finite components sum exactly to Σx; within range hi is the rounded sum and lo the rounded remainder."""
    batches, s = case
    xs = [x for values, _ in batches for x in values]
    parts = (s.total, s.total_lo, *(s.rest[2] if s.rest else ()))
    assert all(math.isfinite(p) for p in parts)
    exact_sum = sum(map(Fraction, xs))
    assert sum(map(Fraction, parts)) == exact_sum
    if math.isfinite(rounded(exact_sum)):
        assert s.total == rounded(exact_sum)
        assert s.total_lo == rounded(exact_sum - Fraction(s.total))
    assert s.rest == () or len(s.rest) == 3


@settings(max_examples=150, deadline=None)
@given(st.lists(records(max_size=6), min_size=3, max_size=3))
def test_merge_is_associative(recs: list[list[tuple[float, float | None]]]) -> None:
    """(a+b)+c and a+(b+c) hold the same exact sums, hence the same sum and mean."""
    a, b, c = (Summary.of_batch(*batches_of(r, [])[0]) for r in recs)
    left, right = a.merge(b).merge(c), a.merge(b.merge(c))
    assert all(same(x, y) for x, y in zip(exact_sums(left), exact_sums(right), strict=True))
    assert left.rest == right.rest
    for kind in ("sum", "mean", "count", "min", "max", "first", "last"):
        assert same(KINDS[kind](left), KINDS[kind](right)), kind


def exact_sums(s: Summary) -> tuple[float, ...]:
    """The (hi, lo) pairs of weight, wsum and total."""
    return (s.weight, s.weight_lo, s.wsum, s.wsum_lo, s.total, s.total_lo)


@settings(max_examples=100, deadline=None)
@given(records())
def test_the_empty_summary_is_the_identity(recs: list[tuple[float, float | None]]) -> None:
    """Merging with EMPTY on either side gives the summary back."""
    s = Summary.of_batch(*batches_of(recs, [])[0])
    assert s.merge(EMPTY) is s
    assert EMPTY.merge(s) is s


@settings(max_examples=100, deadline=None)
@given(split_case())
def test_a_summary_round_trips_through_its_flat_fields(case: tuple[list[Batch], Summary]) -> None:
    """from_tuple(as_tuple(), rest_flat()) gives the summary back, components beyond the double-double included."""
    _, s = case
    assert len(s.as_tuple()) == 12
    assert Summary.from_tuple(s.as_tuple(), s.rest_flat()) == s


def test_a_summary_with_rest_round_trips() -> None:
    """The reported cases carry extra components, and they survive the flat form."""
    for s in (
        Summary.of_batch([1e16, 1.0, 1e-20], None),
        Summary.of_batch([1e308] * 4, [1.0] * 4),
        Summary.of_batch([1e308, 1e308, 1e308], None).merge(Summary.of_batch([1e-300, 3.0], [0.5, 2.0])),
    ):
        assert s.rest != ()
        flat = s.rest_flat()
        assert flat[:3] == tuple(float(len(r)) for r in s.rest)
        assert Summary.from_tuple(s.as_tuple(), flat) == s


def test_from_tuple_rejects_a_malformed_rest() -> None:
    """A rest whose lengths do not add up is refused with a message that says the layout."""
    s = Summary.of_batch([1e16, 1.0, 1e-20], None)
    with pytest.raises(ValueError, match="len_w, len_ws, len_t"):
        Summary.from_tuple(s.as_tuple(), s.rest_flat()[:-1])


# --- exact.py on its own ---------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(VALUES, min_size=1, max_size=10), st.lists(VALUES, min_size=1, max_size=10))
def test_exact_add_and_divide_are_exact(xs: list[float], ys: list[float]) -> None:
    """components/add keep the exact sum; divide is the correctly rounded quotient."""
    a, b = exact.components(xs), exact.components(ys)
    total = sum(map(Fraction, xs)) + sum(map(Fraction, ys))
    assert sum(map(Fraction, exact.add(a, b))) == total
    assert exact.add(a, b) == exact.components([*xs, *ys])
    assert same(exact.value(exact.add(a, b)), rounded(total))
    den = sum(map(Fraction, ys))
    want = math.nan if den == 0 else rounded(sum(map(Fraction, xs)) / den)
    assert same(exact.divide(a, b), want)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(1e-250, 1e250),
    st.sampled_from([1.0, -1.0]),
    st.integers(1, 2**26 - 1),
    st.sampled_from([Fraction(0), Fraction(1, 2), Fraction(-1, 2), Fraction(1, 4), Fraction(2**19 - 1, 2**20)]),
)
def test_divide_by_count_is_correctly_rounded_at_and_near_ties(q: float, sign: float, count: int, at: Fraction) -> None:
    """The quick mean path: (hi + lo) / count for X = (q + at·ulp(q))·count, ties included, is correctly rounded."""
    q *= sign
    x = (Fraction(q) + at * Fraction(math.ulp(q))) * count
    p = float(x)
    parts = exact.components([p, float(x - Fraction(p))])  # x is exact in at most two doubles here
    assume(len(parts) <= 2 and sum(map(Fraction, parts)) == x)
    hi, lo = parts[0], (parts[1] if len(parts) > 1 else 0.0)
    got = exact.divide_by_count(hi, lo, float(count))
    assert got is not None
    assert got == rounded(x / count)
