"""The rank level's shortcuts for a steady commit give what the general path gives: _head's finite-and-nonzero
check, decompose with every value kept, the unit rows' stacked comparison, plan() by identity of a frozen guess."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import fixed, rank_finish, rank_level, speculate
from metricbus.rank_level import block_of, prepare
from metricbus.summary import Summary

_SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf]
_values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64).filter(lambda x: x != 0.0),
    st.sampled_from(_SPECIAL),
)


def _summary(values: list[float]) -> Summary:
    """A unit-weight Summary of ``values`` (NaN, infinities and signed zeros kept)."""
    return Summary.of_batch(values, None)


_rows = st.lists(st.lists(st.one_of(st.none(), st.lists(_values, min_size=1, max_size=3)), min_size=3, max_size=3),
                 min_size=1, max_size=3)


def _block(rows: list[list[list[float] | None]]) -> rank_level.Block:
    summaries = [[None if cell is None else _summary(cell) for cell in row] for row in rows]
    return block_of(summaries, list(range(len(rows))), [False] * 3)


def _general_head(prep: rank_level.Prepared, lowest: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``_head`` with its shortcut switched off."""
    head = np.zeros((prep.block.fields.shape[2], rank_level.NS), dtype=np.int64)
    with monkeypatch.context() as patched:
        patched.setattr(rank_level, "_all_finite_nonzero", lambda values: False)
        rank_level._head(prep, lowest, head)
    return head


@settings(max_examples=200, deadline=None)
@given(rows=_rows)
def test_head_shortcut_counts_as_the_general_path(rows: list[list[list[float] | None]]) -> None:
    """_head fills the same fixed slots with its shortcut as without it, on blocks with zeros, NaN and inf."""
    prep = prepare(_block(rows))
    lowest = np.zeros(3, dtype=np.int64)
    head = np.zeros((3, rank_level.NS), dtype=np.int64)
    rank_level._head(prep, lowest, head)
    with pytest.MonkeyPatch.context() as monkeypatch:
        expected = _general_head(prep, lowest, monkeypatch)
    assert np.array_equal(head, expected)


def test_head_shortcut_taken_only_where_nothing_is_counted() -> None:
    """The finite-and-nonzero check refuses zeros of either sign, NaN and both infinities."""
    for special in _SPECIAL:
        assert not rank_level._all_finite_nonzero(np.array([1.0, special, 2.0]))
    assert rank_level._all_finite_nonzero(np.array([1.0, -5e-324, 1.7e308]))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(_values, min_size=1, max_size=12))
def test_decompose_keeping_every_value_is_the_indexed_one(values: list[float]) -> None:
    """decompose gives the same terms whether every value is kept (no indexing) or some are dropped."""
    array = np.array(values, dtype=np.float64)
    slots = np.arange(len(values), dtype=np.int64)
    found = fixed.decompose(array, slots)
    keep = (np.isfinite(array) & (array != 0.0)).nonzero()[0]
    frac, top = np.frexp(array[keep])
    expected = fixed._terms_of(slots[keep], frac, top)
    for field in ("slot", "m", "q", "top"):
        assert np.array_equal(getattr(found, field), getattr(expected, field))


@settings(max_examples=100, deadline=None)
@given(rows=_rows)
def test_unit_rows_as_the_fieldwise_comparison(rows: list[list[list[float] | None]]) -> None:
    """Prepared.unit is present, weight == count, no weight_lo, wsum == total (hi and lo), no weight rests."""
    block = _block(rows)
    f = block.fields
    expected = (f[0] > 0) & (f[1] == f[0]) & (f[2] == 0.0) & (f[3] == f[5]) & (f[4] == f[6])
    for r, c, which, _ in block.rests:  # a third component of weight or wsum: not unit
        if which < 2:
            expected[r, c] = False
    assert np.array_equal(prepare(block).unit, expected)


def test_plan_of_a_frozen_guess_by_identity() -> None:
    """plan() gives a frozen guess's own layout again, and a fresh layout once the array differs."""
    block = block_of([[_summary([1.5, 2.25]), _summary([3.0])]], [0], [False, False])
    agreed = rank_level.maxima(prepare(block))
    guess = speculate.guess_of(agreed, None)
    guess.flags.writeable = False
    first = rank_finish.plan(guess)
    assert rank_finish.plan(guess) is first
    changed = guess.copy()
    changed[0, 2] += 40.0  # another E: more limbs
    assert rank_finish.plan(changed).total != first.total
    changed.flags.writeable = False
    assert rank_finish.plan(changed).total != first.total
    assert rank_finish.plan(guess) is first
