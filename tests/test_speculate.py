"""Sums laid out by a guessed (wider) window finish to the same bits as under the agreed maxima
(metricbus.speculate): the exact sums are the same integers in a wider window, and their components are canonical."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import fixed, speculate
from metricbus.rank_level import SLOTS, Prepared, block_of, finish, maxima, merge, prepare, sums
from metricbus.summary import Summary
from tests.test_rank_level import bits, cell, summary

_NONE = float(fixed.NONE)


def _widened(agreed: np.ndarray, de: int, dq: int) -> np.ndarray:
    guess = agreed.copy()
    e, nq = guess[:, :SLOTS], guess[:, SLOTS : 2 * SLOTS]
    e[e != _NONE] += de
    nq[nq != _NONE] += dq
    return guess


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(cell, min_size=3, max_size=3), min_size=1, max_size=6),
    st.lists(st.booleans(), min_size=3, max_size=3),
    st.integers(0, 40),
    st.one_of(st.integers(0, 70), st.integers(0, 2200)),
)
def test_a_wider_window_gives_the_same_bits(grid: list[list[object]], moments: list[bool], de: int, dq: int) -> None:
    rows = [[summary(c) for c in row] for row in grid]  # type: ignore[arg-type]
    block = block_of(rows, list(range(len(rows))), moments)
    prep = prepare(block)
    agreed = maxima(prep)
    guess = _widened(agreed, de, dq)
    assert speculate.fits(agreed, guess)
    got = finish(speculate.within(agreed, guess), sums(prep, guess), block.moments)
    assert [bits(s) for s in got] == [bits(s) for s in merge(block)]
    assert speculate.fits(agreed, speculate.guess_of(agreed, None))
    assert speculate.fits(agreed, speculate.guess_of(agreed, guess))


def test_a_narrower_window_or_another_lowest_rank_misses() -> None:
    rows = [[summary(([1.5, 2.25], None)), summary(([3.0], 2.0))], [None, summary(([1e6], None))]]
    agreed = maxima(prepare(block_of(rows, [0, 1], [True, False])))
    assert speculate.fits(agreed, agreed)
    narrow = agreed.copy()
    narrow[0, 2] -= 1  # the total's E
    assert not speculate.fits(agreed, narrow)
    low = agreed.copy()
    low[0, SLOTS + 2] -= 1  # the total's -Q
    assert not speculate.fits(agreed, low)
    moved = agreed.copy()
    moved[1, 2 * SLOTS + 2] = -1.0  # column 1's lowest rank
    assert not speculate.fits(agreed, moved)
    empty = agreed.copy()
    empty[0, 2] = _NONE  # a slot the guess holds empty
    assert not speculate.fits(agreed, empty)


def test_a_guess_narrows_by_at_most_a_bit_per_commit() -> None:
    rows = [[summary(([2.0**40 + 0.5], None))]]
    wide = maxima(prepare(block_of(rows, [0], [False])))
    small = maxima(prepare(block_of([[summary(([1.0], None))]], [0], [False])))
    guess = speculate.guess_of(wide, None)
    after = speculate.guess_of(small, guess)
    assert after[0, 2] == guess[0, 2] - speculate.SHRINK
    assert speculate.fits(wide, after)


def test_a_rank_whose_own_terms_leave_the_guess_sends_zeros_of_its_length() -> None:
    """A column absent (or summing to 0.0) at the last commit, or a value beyond the margin in the last slot: the
    rank's own maxima do not hold in the guess, so it sends blank sums (limbs outside their slots would raise)."""
    def prepared(row: list[Summary | None]) -> Prepared:
        return prepare(block_of([row], [0], [False] * len(row)))

    for before, now in (
        ([None, Summary.of_value(0.7)], [Summary.of_value(0.25), Summary.of_value(0.7)]),
        ([Summary.of_value(0.0), Summary.of_value(0.7)], [Summary.of_value(0.25), Summary.of_value(0.7)]),
        ([Summary.of_value(1.0), Summary.of_value(1.0)], [Summary.of_value(1.0), Summary.of_value(2.0**40)]),
    ):
        guess = speculate.guess_of(maxima(prepared(before)), None)
        own = maxima(prepared(now))
        assert not speculate.holds(own, guess)
        assert not speculate.fits(own, guess)
        blank = speculate.blank(guess)
        assert blank.dtype == np.int64
        assert not blank.any()
        assert len(blank) == len(sums(prepared(before), guess))


def test_weights_in_a_column_guessed_unweighted_do_not_fit_the_rank() -> None:
    """A rank whose row brings weights to a column the guess lays out unweighted (no weight slots) does not fit it,
    though its terms lie inside the windows: its sums would need slots the guess lacks (found by a review fuzzer:
    IndexError in the speculated commit)."""
    from metricbus import one_pass

    plain = prepare(block_of([[summary(([-1.5, 1.5], None))]], [0], [False]))
    guess = speculate.guess_of(maxima(plain), None)
    weighted = prepare(block_of([[summary(([0.0], 3.0))]], [0], [False]))
    mine = maxima(weighted)
    assert speculate.holds(mine, guess)
    assert not one_pass.own_fit(
        maxima=mine, present=weighted.present[0], weighted=weighted.weighted[0], rank=0, guess=guess
    )
