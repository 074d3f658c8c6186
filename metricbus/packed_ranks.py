"""The rank level of many workers' partials on one process (a driver's ``ingest()``, journal replay), column-wise.

Workers rank in the order given. A partial whose metrics all have one update and plain columns (no lift between
the update and rank levels, see :func:`metricbus.reduce.columns_of`) goes into the block straight from its packed
fields, one numpy assignment per partial; any other worker's states are lifted the usual way first. The merge is
:func:`metricbus.rank_level.merge`, the one every path uses, so the result is bit for bit what
:meth:`metricbus.reduce.StepReducer.rank_level` gives on the same states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from metricbus import rank_level
from metricbus.fixed import Array
from metricbus.partial import Partial
from metricbus.reduce import Ranked, StepReducer, WorkerStates, lift_columns
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, Summary

_EMPTY = np.array(Summary().as_tuple())


def rank_level_of(
    partials: Sequence[Partial], others: Sequence[WorkerStates], specs: Mapping[str, Spec], reducer: StepReducer
) -> Ranked:
    """Each metric's columns merged over ``partials`` (ranked first, in order) then ``others`` (states)."""
    plain: dict[bytes, bool] = {}  # per layout: every name single-update with plain columns
    names: set[str] = set()
    for partial in partials:
        packed = partial.packed
        if packed.layout not in plain:
            names.update(packed.names)
            plain[packed.layout] = packed.single and all(reducer.plain(name, specs[name]) for name in packed.names)
    for states in others:
        names.update(states)
    where: dict[str, tuple[int, int]] = {}
    moments: list[bool] = []
    width = 0
    for name in sorted(names):
        columns = reducer.columns(name, specs[name])
        where[name] = (width, len(columns))
        moments.extend(moment for _, _, moment in columns)
        width += len(columns)
    rows = len(partials) + len(others)
    fields = np.empty((N_FIELDS, rows, width))
    whole = slice(0, width)
    rests: list[tuple[int, int, int, tuple[float, ...]]] = []
    index: dict[bytes, slice | Array] = {}  # per plain layout: where its entries go
    slow: list[tuple[int, WorkerStates]] = []
    for r, partial in enumerate(partials):
        packed = partial.packed
        if not plain[packed.layout]:
            slow.append((r, reducer.worker(partial.updates(), specs)))
            continue
        at = index.get(packed.layout)
        if at is None:
            at = index[packed.layout] = _positions([where[name][0] for name in packed.names])
        if not (isinstance(at, slice) and at == whole):  # the partial lacks some columns
            fields[:, r, :] = _EMPTY[:, None]
        fields[:, r, at] = packed.fields
        for i, rest in packed.rests:
            column = where[packed.names[i]][0]
            rests.extend((r, column, which, parts) for which, parts in enumerate(rest) if parts)
    slow.extend((len(partials) + i, states) for i, states in enumerate(others))
    for r, states in slow:
        fields[:, r, :] = _EMPTY[:, None]
        for name, by_key in states.items():
            base, n = where[name]
            for j, state in enumerate(lift_columns(by_key, reducer.columns(name, specs[name]))):
                if state.count:
                    fields[:, r, base + j] = state.as_tuple()
                    rests.extend((r, base + j, which, parts) for which, parts in enumerate(state.rest) if parts)
    ranks = np.arange(fields.shape[1], dtype=np.int64)
    block = rank_level.Block(fields, ranks, np.array(moments, dtype=bool), tuple(rests))
    merged = rank_level.merge(block)
    out: Ranked = {}
    for name, (base, n) in where.items():
        results = tuple(merged[base : base + n])
        if any(c is not None for c in results):
            out[name] = results
    return out


def _positions(columns: list[int]) -> slice | Array:
    """Where a layout's entries go: a slice when they are consecutive columns (a plain copy), else an index."""
    if columns and columns == list(range(columns[0], columns[0] + len(columns))):
        return slice(columns[0], columns[0] + len(columns))
    return np.array(columns, dtype=np.int64)
