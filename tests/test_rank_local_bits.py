"""A rank's local steps (prepare, maxima, sums, the one-pass vector and read, finish), with their fast paths for one
row, unit weights and no rests or moments: a block's passes finish to the reference's bits
(tests/test_rank_level_fast.py: the limbs as Python integers) and to the one-process merge's, and so do its rows'
own passes reduced as the collectives reduce them; a one-pass hit finishes to the merge. One-row and many-row
blocks of hostile values."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_rank_level_fast import reference_finish

from metricbus import one_pass, speculate
from metricbus.rank_level import Block, block_of, finish, maxima, merge, prepare, sums
from metricbus.summary import Summary

PAYLOAD_NAN = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000123))[0]  # a negative NaN with a payload
SPECIAL = [0.0, -0.0, 5e-324, -5e-324, 1e-310, 2.2250738585072014e-308, 1.7976931348623157e308, -1e308, 1e16, 1.0,
           1e-20, 3.0, math.nan, PAYLOAD_NAN, math.inf, -math.inf]
values = st.one_of(st.floats(width=64), st.sampled_from(SPECIAL))
weights = st.one_of(st.none(), st.none(), st.sampled_from([0.0, 0.5, 1.0, 3.0, 1e-300]))
counts = st.sampled_from([None, None, None, 2**40, 2**53 - 1, 2**53, 2**60])
cell = st.one_of(st.none(), st.tuples(st.lists(values, min_size=1, max_size=4), weights, counts))
Cell = tuple[list[float], float | None, int | None] | None


def _summary(data: Cell) -> Summary | None:
    if data is None:
        return None
    xs, w, count = data
    state = Summary.of_batch(xs, None if w is None else [w] * len(xs))
    if count is not None:  # a huge count (one of a long run): still unit where the weight follows it
        unit = state.weight == state.count
        state = state._replace(count=count, weight=float(count) if unit else state.weight)
    return state


def _bits(merged: Any) -> object:
    return [None if s is None else (struct.pack("<12d", *s.as_tuple()), s.rest) for s in merged]


def _same(got: Any, want: Any) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def _fields_agree(merged: Any) -> None:
    """``Merged.fields`` (where set) holds the fields of the columns ``picks`` names, bit for bit."""
    fields, picks = merged.fields, merged.picks
    if fields is None:
        return
    items = list(merged)
    kept = list(range(len(items))) if picks is None else picks.tolist()
    assert [i for i, s in enumerate(items) if s is not None] == kept
    want = np.array([items[i].as_tuple() for i in kept], dtype=np.float64).reshape(-1, 12).T
    _same(np.ascontiguousarray(fields), np.ascontiguousarray(want))


def _cell(block: Block, r: int, c: int) -> Summary | None:
    fields = block.fields[:, r, c].tolist()
    if not fields[0]:
        return None
    held: list[tuple[float, ...]] = [(), (), ()]
    rest = [(w, parts) for row, col, w, parts in block.rests if row == r and col == c]
    for w, parts in rest:
        held[w] = parts
    return Summary(int(fields[0]), *fields[1:12], tuple(held) if rest else (), None)  # type: ignore[arg-type]


def _rows(block: Block) -> list[Block]:
    """Each row of ``block`` as a participant's one-row block."""
    width = block.fields.shape[2]
    return [block_of([[_cell(block, r, c) for c in range(width)]], [int(block.ranks[r])], block.moments.tolist())
            for r in range(block.fields.shape[1])]


def _block(rows: list[list[Cell]], ranks: list[int], moments: list[bool]) -> Block:
    return block_of([[_summary(c) for c in row] for row in rows], ranks, moments)


grids = st.integers(1, 4).flatmap(
    lambda width: st.tuples(
        st.lists(st.lists(cell, min_size=width, max_size=width), min_size=1, max_size=5),
        st.lists(st.booleans(), min_size=width, max_size=width),
    )
)


@settings(max_examples=300, deadline=None)
@given(grids, st.randoms(use_true_random=False))
@example(([[([1.0, 2.0], None, None), None]], [False, False]), None)
@example(([[([-0.0], None, None), ([math.inf, -math.inf], None, None)]], [False, True]), None)
@example(([[([1e300, 1.0, 1e-300], None, None)], [([-0.0, 3.0], 0.5, None)]], [True]), None)
def test_both_passes_and_the_finish_are_the_reference_bits(grid: tuple[list[list[Cell]], list[bool]],
                                                         shuffle: Any) -> None:
    """maxima, sums and finish of one block (one row or several, ranks in any order) give the reference's bits and
    the merge's; so do the rows' own passes, reduced as the collectives reduce them (MAX, then SUM)."""
    rows, moments = grid
    ranks = list(range(len(rows)))
    if shuffle is not None:
        shuffle.shuffle(ranks)
    block = _block(rows, ranks, moments)
    prep = prepare(block)
    agreed = maxima(prep)
    summed = sums(prep, agreed)
    merged = finish(agreed, summed, block.moments)
    want = _bits(reference_finish(agreed, summed, block.moments))
    assert _bits(merged) == want
    assert _bits(merge(block)) == want
    _fields_agree(merged)
    if block.fields[0].sum(axis=0).max(initial=0.0) < 2**53:  # a block's counts add in float64: exact below 2**53
        parts = [prepare(b) for b in _rows(block)]
        reduced = np.max([maxima(p) for p in parts], axis=0)
        collective = finish(reduced, np.sum([sums(p, reduced) for p in parts], axis=0), block.moments)
        assert _bits(collective) == want
        _fields_agree(collective)


def _no_extrema(merged: Any) -> object:
    return _bits([None if s is None else s._replace(min=math.nan, max=math.nan) for s in merged])


@settings(max_examples=300, deadline=None)
@given(grids, st.data())
@example(([[([1.0, 2.0], None, None), ([0.5], None, None)]], [False, False]), None)
def test_a_one_pass_hit_finishes_to_the_merge(grid: tuple[list[list[Cell]], list[bool]],
                                              data: st.DataObject | None) -> None:
    """Each rank's one-pass vector under a guess (from this commit's maxima or another's): the guess hits exactly
    where the reduced maxima fit it, the longest payload's bound holds, and a hit finishes to the one-process merge
    (its extrema NaN: nothing reads them)."""
    rows, moments = grid
    blocks = [_block([row], [rank], moments) for rank, row in enumerate(rows)]
    agreed = np.max([maxima(prepare(b)) for b in blocks], axis=0)
    guess = speculate.guess_of(agreed, None)
    if data is not None and data.draw(st.booleans()):  # another commit's guess: often a miss
        other = data.draw(st.lists(cell, min_size=len(moments), max_size=len(moments)))
        guess = speculate.guess_of(maxima(prepare(_block([other], [0], moments))), None)
    total = None
    for rank, block in enumerate(blocks):
        prep = prepare(block)
        sent = one_pass.vector(prep, maxima=maxima(prep), rank=rank, guess=guess, length=rank * 1000)
        total = sent if total is None else total + sent
    assert total is not None
    hit, longest, summed = one_pass.read(total, guess)
    assert hit == speculate.fits(agreed, guess)
    most = 1000 * (len(rows) - 1)
    assert most <= longest < max(1, 2 * most)
    if hit:
        merged = finish(guess, summed, blocks[0].moments)
        _fields_agree(merged)
        whole = _block(rows, list(range(len(rows))), moments)
        if whole.fields[0].sum(axis=0).max(initial=0.0) < 2**53:  # a block's counts add in float64
            assert _no_extrema(merged) == _no_extrema(merge(whole))


def test_a_steady_one_row_commit_finishes_to_the_merge() -> None:
    """The common case (one row, plain float records, no moments) over many commits of varying data: hits finish to
    the merge, misses guess again."""
    rng = np.random.default_rng(7)
    guess = None
    hits = 0
    for step in range(40):
        scale = 10.0 ** (3 * (step // 10))  # values jump a thousandfold every 10 commits
        states = [Summary.of_batch((rng.standard_normal(8) * scale * 10.0**i).tolist(), None) for i in range(12)]
        if 15 <= step < 20:  # a metric not logged for a while
            states[3] = None  # type: ignore[call-overload]
        block = block_of([states], [0], [False] * 12)
        prep = prepare(block)
        own = maxima(prep)
        if guess is None:
            guess = speculate.guess_of(own, None)
        sent = one_pass.vector(prep, maxima=own, rank=0, guess=guess, length=0)
        hit, _, summed = one_pass.read(sent, guess)
        assert hit == speculate.fits(own, guess)
        if hit:
            hits += 1
            merged = finish(guess, summed, block.moments)
            assert _no_extrema(merged) == _no_extrema(merge(block))
            _fields_agree(merged)
        else:
            assert _bits(finish(own, sums(prep, own), block.moments)) == _bits(merge(block))
            guess = speculate.guess_of(own, guess, commits=1)
    assert hits >= 20
