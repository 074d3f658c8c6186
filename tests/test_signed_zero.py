"""Every min and max orders -0.0 below +0.0, whatever the path, the split and the order of the merges.

The reference is a plain Python min/max under IEEE 754's totalOrder on the whole, unsplit records; each path
(``Summary.of_batch`` of lists short and long, numpy arrays, columns of micro summaries, ``Summary.merge`` in any
grouping, the update level in columns, the rank level on one process and as the collective computes it, replay's
columns, torch tensors) must give its bits.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import column_merge, micro_columns, rank_level, signed_zero
from metricbus.summary import EMPTY, Summary
from metricbus.summary_arrays import of_arrays
from metricbus.update_columns import merge_columns

VALUES = [0.0, -0.0, 0.0, -0.0, 1.5, -1.5]
ALL = [*VALUES, math.inf, -math.inf, math.nan]


def total_order(x: float) -> tuple[float, bool]:
    """The sort key of a non-NaN float under totalOrder: -0.0 sorts before +0.0."""
    return x, math.copysign(1.0, x) > 0.0


def reference(values: list[float]) -> tuple[bytes, bytes]:
    """The bits of the min and max of ``values`` (NaN if any is NaN)."""
    if any(math.isnan(x) for x in values):
        return _bits(math.nan), _bits(math.nan)
    return _bits(min(values, key=total_order)), _bits(max(values, key=total_order))


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def extremes(state: Any) -> tuple[bytes, bytes]:
    return _bits(state.min), _bits(state.max)


records = st.lists(st.sampled_from(VALUES), min_size=1, max_size=80)
splits = st.lists(st.integers(1, 12), min_size=1, max_size=12)


def split(values: list[float], sizes: list[int]) -> list[list[float]]:
    """``values`` cut into consecutive non-empty chunks of ``sizes`` (cycled), in order."""
    out, at, i = [], 0, 0
    while at < len(values):
        size = sizes[i % len(sizes)]
        out.append(values[at : at + size])
        at, i = at + size, i + 1
    return out


def test_pairs_follow_total_order() -> None:
    """``least`` and ``greatest`` of every pair of special values: NaN wins, else the totalOrder extreme."""
    for a in ALL:
        for b in ALL:
            assert _bits(signed_zero.least(a, b)) == reference([a, b])[0], (a, b)
            assert _bits(signed_zero.greatest(a, b)) == reference([a, b])[1], (a, b)


@settings(max_examples=300, deadline=None)
@given(values=records)
def test_a_batch_of_floats_and_an_array(values: list[float]) -> None:
    """``Summary.of_batch`` (sorted up to 32 records, min()/max() beyond) and numpy arrays of the same records."""
    assert extremes(Summary.of_batch(values, None)) == reference(values)
    assert extremes(Summary.of_batch(values, [2.0] * len(values))) == reference(values)
    assert extremes(of_arrays([np.array(values * 20)])) == reference(values)


@settings(max_examples=200, deadline=None)
@given(values=records, sizes=splits, data=st.data())
def test_merges_in_any_grouping(values: list[float], sizes: list[int], data: st.DataObject) -> None:
    """``Summary.merge`` of the chunks' summaries, folded left, right and in a random tree."""
    parts = [Summary.of_batch(chunk, None) for chunk in split(values, sizes)]
    left = EMPTY
    for part in parts:
        left = left.merge(part)
    right = EMPTY
    for part in reversed(parts):
        right = part.merge(right)
    tree = list(parts)
    while len(tree) > 1:
        i = data.draw(st.integers(0, len(tree) - 2))
        tree[i : i + 2] = [tree[i].merge(tree[i + 1])]
    for state in (left, right, tree[0]):
        assert extremes(state) == reference(values)


@settings(max_examples=200, deadline=None)
@given(values=records, sizes=splits)
def test_micro_summaries_in_columns(values: list[float], sizes: list[int]) -> None:
    """Metrics summarised in columns (``np.minimum.reduceat``), each metric's records a chunk of ``values``."""
    chunks = split(values, sizes)
    chunks += [[-0.0, 0.0]] * max(0, micro_columns.COLUMNS_FROM - len(chunks))  # enough metrics for columns
    names = [f"m{i}" for i in range(len(chunks))]
    out = micro_columns.summarize(names, chunks, {})
    assert isinstance(out, micro_columns.MicroUpdate)
    for name, chunk in zip(names, chunks, strict=True):
        assert extremes(out[name]) == reference(chunk), name


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(records, records), min_size=1, max_size=10))
def test_update_level_in_columns(pairs: list[tuple[list[float], list[float]]]) -> None:
    """``update_columns.merge_columns`` of two updates' summaries, column by column."""
    a = np.array([Summary.of_batch(x, None).as_tuple() for x, _ in pairs]).T.copy()
    b = np.array([Summary.of_batch(y, None).as_tuple() for _, y in pairs]).T.copy()
    out = merge_columns(a, b)
    assert out is not None
    for i, (x, y) in enumerate(pairs):
        assert (_bits(out[8, i]), _bits(out[9, i])) == reference(x + y)


@st.composite
def blocks(draw: st.DrawFn) -> tuple[list[list[Summary | None]], list[list[float]]]:
    """Per worker (2..6), per column (1..4), a Summary of some records or none; and each column's records."""
    workers, width = draw(st.integers(2, 6)), draw(st.integers(1, 4))
    rows: list[list[Summary | None]] = []
    columns: list[list[float]] = [[] for _ in range(width)]
    for _ in range(workers):
        row: list[Summary | None] = []
        for c in range(width):
            values = draw(st.one_of(st.none(), records))
            row.append(None if values is None else Summary.of_batch(values, None))
            columns[c] += values or []
        rows.append(row)
    for c, values in enumerate(columns):
        if not values:  # every column held by someone
            rows[0][c] = Summary.of_batch([-0.0], None)
            values.append(-0.0)
    return rows, columns


@settings(max_examples=200, deadline=None)
@given(block=blocks(), data=st.data())
def test_rank_level_on_one_process_and_as_the_collective(
    block: tuple[list[list[Summary | None]], list[list[float]]], data: st.DataObject
) -> None:
    """``rank_level.merge`` and ``merge_collective`` (what torch.distributed's all_reduce computes), with the
    workers' rows in any order."""
    rows, columns = block
    order = data.draw(st.permutations(range(len(rows))))
    ranks = [order.index(r) for r in range(len(rows))]
    built = rank_level.block_of(rows, ranks, [False] * len(columns))
    for merged in (rank_level.merge(built), rank_level.merge_collective(built)):
        for c, values in enumerate(columns):
            state = merged[c]
            assert state is not None
            assert extremes(state) == reference(values), c


@settings(max_examples=200, deadline=None)
@given(block=blocks())
def test_replay_columns(block: tuple[list[list[Summary | None]], list[list[float]]]) -> None:
    """``column_merge.merge_columns`` (replay's rank level in columns) settles every zero extreme, as the
    reference says."""
    rows, columns = block
    fields = np.array([[(s or EMPTY).as_tuple() for s in row] for row in rows])[None]  # (1, R, M, N_FIELDS)
    present = fields[0, ..., 0] > 0
    merged, _ = column_merge.merge_columns(fields, present, present.argmax(axis=0))
    for c, values in enumerate(columns):
        assert (_bits(merged.min[0, c]), _bits(merged.max[0, c])) == reference(values), c


@settings(max_examples=100, deadline=None)
@given(values=records, sizes=splits, ignore=st.booleans())
def test_tensors(values: list[float], sizes: list[int], ignore: bool) -> None:
    """Tensors logged in chunks merge on the device; the zero extremes get their sign at the one copy."""
    torch = pytest.importorskip("torch")
    from metricbus.tensors import DeviceStates

    states = DeviceStates()
    for chunk in split(values, sizes):
        logged = [*chunk, math.nan] if ignore else chunk  # a NaN the "ignore" policy drops
        states.add("m", torch.tensor(logged, dtype=torch.float64), None, nan="ignore" if ignore else "error")
    states.end_update(0)
    out, errors = states.take_all(nan_of=lambda _: "ignore" if ignore else "error")
    assert not errors
    fields = out[0][1]
    assert (_bits(fields[8, 0]), _bits(fields[9, 0])) == reference(values)
