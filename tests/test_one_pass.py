"""A one-pass commit (metricbus.one_pass), simulated on one process: R ranks each send their checks and their sums
laid out by a guess made from an earlier commit; the reduced checks hit exactly when the agreed maxima fit the guess,
and a hit finishes to the bits of the one-process merge (but the merged min/max, which it does not agree)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import Agg, one_pass, speculate
from metricbus.rank_level import block_of, finish, maxima, merge, prepare
from metricbus.spec import parse_spec
from tests.test_rank_level import bits, cell, summary

grids = st.lists(st.lists(cell, min_size=3, max_size=3), min_size=1, max_size=5)


def _one_pass(rows: list[list[object]], moments: list[bool], guess: np.ndarray, lengths: list[int]) -> tuple:
    """The reduced ``(hit, longest, sums)`` of every rank's checks and sums, each rank a row of ``rows``."""
    total = None
    for rank, row in enumerate(rows):
        prep = prepare(block_of([row], [rank], moments))  # type: ignore[list-item]
        vector = one_pass.vector(prep, maxima=maxima(prep), rank=rank, guess=guess, length=lengths[rank])
        total = vector if total is None else total + vector
    assert total is not None
    return one_pass.read(total, guess)


def _agreed(rows: list[list[object]], moments: list[bool]) -> np.ndarray:
    """The maxima the ranks agree: the all_reduce(MAX) of each rank's own (not the maxima of all rows as one block,
    which can be wider: a unit row in one rank and another rank's Σx bound Σw·x together)."""
    own = [maxima(prepare(block_of([row], [rank], moments))) for rank, row in enumerate(rows)]  # type: ignore[list-item]
    return np.max(own, axis=0)


def _without_extrema(state: object) -> object:
    held = bits(state)  # type: ignore[arg-type]
    if held is None:
        return None
    fields, rest = held  # type: ignore[misc]
    return fields[:8] + fields[10:], rest


@settings(max_examples=200, deadline=None)
@given(grids, st.lists(st.booleans(), min_size=3, max_size=3), st.data())
def test_a_hit_is_a_fit_and_finishes_to_the_merge(
    before: list[list[object]], moments: list[bool], data: st.DataObject
) -> None:
    earlier = [[summary(c) for c in row] for row in before]  # type: ignore[arg-type]
    same = data.draw(st.booleans())  # the commit the guess was made from again: a hit
    # the same ranks (the guessed lowest rank of a column is one of them, and says so when it lacks the column)
    now = data.draw(st.lists(st.lists(cell, min_size=3, max_size=3), min_size=len(before), max_size=len(before)))
    rows = earlier if same else [[summary(c) for c in row] for row in now]  # type: ignore[arg-type]
    lengths = data.draw(st.lists(st.integers(0, 2**20), min_size=len(rows), max_size=len(rows)))
    hit = _check(earlier, rows, moments, lengths)
    assert hit or not same


def test_a_hit_where_one_block_of_every_row_would_agree_wider_maxima() -> None:
    """Found by hypothesis: a column guessed weighted from rank 0; then a unit row on rank 0 and a weight-0 row on
    rank 1. The maxima of both rows as one block bound Σw·x by rank 1's Σx (rank 0's row is unit); the ranks' own
    maxima, MAX-reduced, do not (neither has a Σw·x term): the guess holds, and the sums are exact."""
    earlier = [[summary(([5e-324], 0.5)), None, None], [None, None, None]]
    rows = [[summary(([0.0], None)), None, None], [summary(([5e-324], 0.0)), None, None]]
    assert _check(earlier, rows, [False, False, False], [0, 0])


def test_a_sum_beyond_the_double_range_read_as_std() -> None:
    """Found by hypothesis: records at the top of the range in a column read as std: Σw·x holds further components
    whose sum overflows, which raised OverflowError out of prepare() (every path's commit) instead of giving t inf."""
    top = 1.7976931348623157e308
    earlier = [[summary(([top] * 4, None)), None, None]]
    assert _check(earlier, [[None, None, None]], [True, False, False], [0]) in (True, False)
    assert _check(earlier, earlier, [True, False, False], [0])


def _check(earlier: list[list[object]], rows: list[list[object]], moments: list[bool], lengths: list[int]) -> bool:
    """A one-pass commit of ``rows`` under the guess made from ``earlier``: it hits exactly when the agreed maxima
    fit the guess, bounds the longest payload, and a hit finishes to the one-process merge; returns the hit."""
    guess = speculate.guess_of(_agreed(earlier, moments), None)
    hit, longest, summed = _one_pass(rows, moments, guess, lengths)
    block = block_of(rows, list(range(len(rows))), moments)  # type: ignore[arg-type]
    assert hit == speculate.fits(_agreed(rows, moments), guess)
    assert max(lengths) <= longest < 2 * max(lengths) or longest == max(lengths) == 0
    if hit:
        got = finish(guess, summed, block.moments)
        assert [_without_extrema(s) for s in got] == [_without_extrema(s) for s in merge(block)]
        assert all(s is None or (np.isnan(s.min) and np.isnan(s.max)) for s in got)
    return hit


def test_each_way_a_rank_misses_the_guess() -> None:
    """Terms outside the window, a column below the guessed lowest rank, the guessed lowest rank lacking it,
    weights in a column guessed unweighted, none in one guessed weighted: each a miss on every rank."""
    a, b, big = summary(([1.5, 2.0], None)), summary(([0.25], None)), summary(([1.5e12], None))
    weighted = summary(([1.0, 3.0], 2.0))
    moments = [False, False]
    guess = speculate.guess_of(maxima(prepare(block_of([[None, a], [a, b]], [0, 1], moments))), None)
    assert _one_pass([[None, a], [a, b]], moments, guess, [0, 0])[0]  # the same layout: a hit
    assert _one_pass([[None, b], [b, a]], moments, guess, [0, 0])[0]  # other values inside the windows: a hit
    assert not _one_pass([[None, a], [big, b]], moments, guess, [0, 0])[0]  # beyond the window
    assert not _one_pass([[a, a], [a, b]], moments, guess, [0, 0])[0]  # rank 0 has column 0: below the lowest
    assert not _one_pass([[None, None], [a, b]], moments, guess, [0, 0])[0]  # rank 0, column 1's lowest, lacks it
    assert not _one_pass([[None, a], [weighted, b]], moments, guess, [0, 0])[0]  # weights, guessed unweighted
    heavy = speculate.guess_of(maxima(prepare(block_of([[None, a], [weighted, b]], [0, 1], moments))), None)
    assert _one_pass([[None, a], [weighted, b]], moments, heavy, [0, 0])[0]
    assert not _one_pass([[None, a], [a, b]], moments, heavy, [0, 0])[0]  # guessed weighted, none has weights
    hit, longest, _ = _one_pass([[None, a], [a, b]], moments, guess, [300, 5])
    assert hit
    assert longest == 300 | 5


def test_a_payload_too_long_for_the_length_bits_is_refused() -> None:
    guess = speculate.guess_of(maxima(prepare(block_of([[summary(([1.0], None))]], [0], [False]))), None)
    with pytest.raises(ValueError, match="2\\*\\*48"):
        one_pass.flags(fits=True, length=1 << one_pass.LENGTH_BITS, weighted=np.zeros(1, bool), guess=guess)


@pytest.mark.parametrize(
    ("rules", "reads"),
    [
        ({"a": "mean", "b": "sum"}, False),
        ({"a": ["mean", "std", "first", "last", "count"]}, False),
        ({"a": "mean", "b": "max"}, True),
        ({"a": Agg(micro="mean", rank="min")}, True),
        ({"a": Agg(micro="max", rank="mean")}, False),  # each worker's max, read before the rank level
    ],
)
def test_which_layouts_read_the_merged_extrema(rules: dict[str, object], reads: bool) -> None:
    specs = {name: parse_spec(rule, metric=name) for name, rule in rules.items()}  # type: ignore[arg-type]
    assert one_pass.reads_extrema(specs) == reads
