"""The rank level's exact merge (metricbus.rank_level): one process's extraction and the collectives' fixed-point
limbs give the same bits; sums are the exact sums; the merged second moment meets the stated bound."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus.rank_level import block_of, finish, maxima, merge, merge_collective, prepare, sums
from metricbus.summary import Summary

SPECIAL = [0.0, -0.0, 5e-324, -5e-324, 1e-310, 1.7976931348623157e308, -1e308, 1e16, 1.0, 1e-20, math.nan, math.inf,
           -math.inf]
values = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from(SPECIAL))
weights = st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0, 3.0]))
cell = st.one_of(st.none(), st.tuples(st.lists(values, min_size=1, max_size=5), weights))


def summary(data: tuple[list[float], float | None] | None) -> Summary | None:
    if data is None:
        return None
    xs, w = data
    return Summary.of_batch(xs, None if w is None else [w] * len(xs))


def bits(s: Summary | None) -> object:
    if s is None:
        return None
    return tuple(struct.pack("<d", float(x)) for x in s[:12]), s.rest


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(cell, min_size=3, max_size=3), min_size=1, max_size=6), st.lists(st.booleans(), min_size=3,
                                                                                         max_size=3))
def test_extraction_and_limbs_agree_bit_for_bit(grid: list[list[object]], moments: list[bool]) -> None:
    rows = [[summary(c) for c in row] for row in grid]  # type: ignore[arg-type]
    block = block_of(rows, list(range(len(rows))), moments)
    assert [bits(s) for s in merge(block)] == [bits(s) for s in merge_collective(block)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=4), min_size=1,
                max_size=8))
def test_the_sum_is_the_exact_sum_and_split_free(shares: list[list[float]]) -> None:
    """Σx of every worker's records is the correctly rounded exact sum, whatever the split into workers."""
    exact = sum((Fraction(x) for share in shares for x in share), Fraction(0))
    try:
        expected = float(exact)
    except OverflowError:
        expected = math.inf if exact > 0 else -math.inf
    merged = merge(block_of([[Summary.of_batch(s, None)] for s in shares], list(range(len(shares))), [False]))[0]
    assert merged is not None
    assert merged.sum() == expected or (math.isinf(expected) and merged.sum() == expected)
    assert merged.count == sum(map(len, shares))


def test_one_worker_is_the_identity() -> None:
    rng = np.random.default_rng(0)
    states = [Summary.of_batch(rng.standard_normal(9).tolist(), rng.random(9).tolist()),
              Summary.of_batch([1e16, 1.0, 1e-20], None), Summary.of_batch([-0.0, -0.0], None)]
    merged = merge(block_of([states], [3], [True, True, True]))
    assert [bits(s) for s in merged] == [bits(s) for s in states]


def _exact_m2(data: list[list[float]]) -> Fraction:
    xs = [Fraction(x) for share in data for x in share]
    mean = sum(xs, Fraction(0)) / len(xs)
    return sum(((x - mean) ** 2 for x in xs), Fraction(0))


def test_the_merged_second_moment_meets_its_bound() -> None:
    """README: |m2 - exact| <= (2**-140 * (1 + mean**2 / variance) + 2**-52) * exact, at mean 1e6 and spread 1e-3."""
    rng = np.random.default_rng(7)
    for mean, spread in ((0.0, 1.0), (1e6, 1e-3), (-3e8, 2.0), (1e-3, 1e-9)):
        shares = [(mean + spread * rng.standard_normal(int(rng.integers(1, 9)))).tolist() for _ in range(16)]
        merged = merge(block_of([[Summary.of_batch(s, None)] for s in shares], list(range(16)), [True]))[0]
        assert merged is not None
        exact = _exact_m2(shares)
        n = sum(map(len, shares))
        ratio = (Fraction(mean) ** 2) / (exact / n) if exact else Fraction(0)
        bound = (2.0**-140 * (1 + float(ratio)) + 2.0**-52) * float(exact)
        assert abs(Fraction(merged.m2) - exact) <= Fraction(bound), (mean, spread, merged.m2, float(exact))
        std = merged.std()
        assert math.isclose(std, math.sqrt(float(exact) / n), rel_tol=1e-9)


def test_two_passes_with_another_ranks_layout() -> None:
    """A rank's sums under maxima agreed with other ranks (a wider layout) still add up to the merged bits."""
    rng = np.random.default_rng(3)
    rows = [[Summary.of_batch((rng.standard_normal(4) * 10.0 ** float(e)).tolist(), None)] for e in (-200, 0, 200)]
    prepared = [prepare(block_of([row], [r], [True])) for r, row in enumerate(rows)]
    agreed = np.maximum.reduce([maxima(p) for p in prepared])
    summed = sum(sums(p, agreed) for p in prepared)
    assert bits(finish(agreed, summed, np.array([True]))[0]) == bits(merge(block_of(rows, [0, 1, 2], [True]))[0])


def test_counts_beyond_two_to_the_53_add_exactly() -> None:
    """Workers' counts whose sum passes 2**53 add as integers (a float sum would round 2**53 + 1 to 2**53)."""
    one = Summary.of_batch([1.0], None)
    big = one._replace(count=2**53 - 1, weight=float(2**53 - 1), wsum=float(2**53 - 1), total=float(2**53 - 1))
    two = Summary.of_batch([1.0, 1.0], None)
    block = block_of([[big], [two]], [0, 1], [False])
    for merged in (merge(block), merge_collective(block)):
        state = merged[0]
        assert state is not None
        assert state.count == big.merge(two).count == 2**53 + 1
