"""The rank level of many workers' partials on one process (a driver's ``ingest()``, journal replay), column-wise.

Workers rank in the order given. A partial whose metrics all have one update and plain columns (no lift between
the update and rank levels, see :func:`metricbus.reduce.columns_of`) goes into the block straight from its packed
fields, one numpy assignment per partial; any other worker's states (``others``: already update-level, as
:meth:`metricbus.reduce.StepReducer.rank_level` and torch.distributed's new names hand them) are lifted the usual
way first. The merge is :func:`metricbus.rank_level.merge`, the one every path uses, so the result is bit for bit
what the collectives compute from the same states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from metricbus import rank_level
from metricbus.fixed import Array
from metricbus.partial import Partial
from metricbus.reduce import Ranked, StepReducer, WorkerStates, lift_columns
from metricbus.sketch import Sketch
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, Summary

_EMPTY = np.array(Summary().as_tuple())
_LAYOUTS_KEPT = 64


Batch = tuple[Sequence[Partial], Sequence[WorkerStates], Mapping[str, Spec]]  # one commit's workers and specs


def rank_level_of(
    partials: Sequence[Partial], others: Sequence[WorkerStates], specs: Mapping[str, Spec], reducer: StepReducer
) -> Ranked:
    """Each metric's columns merged over ``partials`` (ranked first, in order) then ``others`` (states)."""
    return rank_levels([(partials, others, specs)], reducer)[0]


def rank_levels(
    commits: Sequence[Batch], reducer: StepReducer, *, seen: dict[tuple[bytes, ...], _Layout] | None = None
) -> list[Ranked]:
    """:func:`rank_level_of` of several commits at once: their columns side by side in one block (columns merge
    independently), so replay pays numpy's per-call cost once per batch instead of once per commit.

    ``seen`` remembers the layout of each combination of partial layouts (commits without ``others``), for a caller
    whose specs of a layout never change (replay)."""
    layouts = []
    for partials, others, specs in commits:
        key = tuple(p.packed.layout for p in partials) if seen is not None and not others else None
        layout = seen.get(key) if seen is not None and key is not None else None
        if layout is None:
            layout = _Layout(partials, others, specs, reducer)
            if seen is not None and key is not None:
                if len(seen) >= _LAYOUTS_KEPT:
                    seen.clear()
                seen[key] = layout
        layouts.append(layout)
    rows = max((layout.rows for layout in layouts), default=0)
    total = sum(layout.width for layout in layouts)
    fields = np.empty((N_FIELDS, rows, total))
    moments: list[bool] = []
    rests: list[tuple[int, int, int, tuple[float, ...]]] = []
    sketches: list[tuple[int, int, Sketch]] = []
    offset = 0
    for layout, (partials, others, specs) in zip(layouts, commits, strict=True):
        layout.fill(fields[:, :, offset : offset + layout.width], partials, others, specs, rests, sketches, offset)
        moments.extend(layout.moments)
        offset += layout.width
    block = rank_level.Block(
        fields, np.arange(rows, dtype=np.int64), np.array(moments, dtype=bool), tuple(rests), tuple(sketches)
    )
    merged = rank_level.merge(block)
    out = []
    offset = 0
    for layout in layouts:
        ranked: Ranked = {}
        for name, (base, n) in layout.where.items():
            results = tuple(merged[offset + base : offset + base + n])
            if any(c is not None for c in results):
                ranked[name] = results
        out.append(ranked)
        offset += layout.width
    return out


class _Layout:
    """Where one commit's workers and metrics go in a block."""

    def __init__(
        self,
        partials: Sequence[Partial],
        others: Sequence[WorkerStates],
        specs: Mapping[str, Spec],
        reducer: StepReducer,
    ) -> None:
        self.reducer = reducer
        self.plain: dict[bytes, bool] = {}  # per layout: every name single-update with plain columns
        names: set[str] = set()
        for partial in partials:
            packed = partial.packed
            if packed.layout not in self.plain:
                names.update(packed.names)
                self.plain[packed.layout] = packed.single and all(
                    reducer.plain(name, specs[name]) for name in packed.names
                )
        for states in others:
            names.update(states)
        self.where: dict[str, tuple[int, int]] = {}
        self.moments: list[bool] = []
        width = 0
        for name in sorted(names):
            columns = reducer.columns(name, specs[name])
            self.where[name] = (width, len(columns))
            self.moments.extend(moment for _, _, moment, _ in columns)
            width += len(columns)
        self.width = width
        self.rows = len(partials) + len(others)

    def fill(  # noqa: PLR0917  (one commit's share of the block)
        self,
        fields: Array,
        partials: Sequence[Partial],
        others: Sequence[WorkerStates],
        specs: Mapping[str, Spec],
        rests: list[tuple[int, int, int, tuple[float, ...]]],
        sketches: list[tuple[int, int, Sketch]],
        offset: int,
    ) -> None:
        """Write this commit's rows into ``fields`` (its columns of the block), and its rests (block columns)."""
        reducer, where = self.reducer, self.where
        whole = slice(0, self.width)
        index: dict[bytes, slice | Array] = {}  # per plain layout: where its entries go
        slow: list[tuple[int, WorkerStates]] = []
        for r, partial in enumerate(partials):
            packed = partial.packed
            if not self.plain[packed.layout]:
                slow.append((r, reducer.worker(partial.updates(), specs)))
                continue
            at = index.get(packed.layout)
            if at is None:
                at = index[packed.layout] = _positions([where[name][0] for name in packed.names])
            if not (isinstance(at, slice) and at == whole):  # the partial lacks some columns
                fields[:, r, :] = _EMPTY[:, None]
            fields[:, r, at] = packed.fields
            for i, rest in packed.rests:
                column = offset + where[packed.names[i]][0]
                rests.extend((r, column, which, parts) for which, parts in enumerate(rest) if parts)
            for i, sketch in packed.sketches:
                sketches.append((r, offset + where[packed.names[i]][0], sketch))
        slow.extend((len(partials) + i, states) for i, states in enumerate(others))
        for r, states in slow:
            fields[:, r, :] = _EMPTY[:, None]
            for name, by_key in states.items():
                base, _ = where[name]
                for j, state in enumerate(lift_columns(by_key, reducer.columns(name, specs[name]))):
                    if state.count:
                        fields[:, r, base + j] = state.as_tuple()
                        rests.extend(
                            (r, offset + base + j, which, parts) for which, parts in enumerate(state.rest) if parts
                        )
                        if state.sketch is not None:
                            sketches.append((r, offset + base + j, state.sketch))
        fields[:, self.rows :, :] = _EMPTY[:, None, None]  # rows of a longer commit in the batch


def _positions(columns: list[int]) -> slice | Array:
    """Where a layout's entries go: a slice when they are consecutive columns (a plain copy), else an index."""
    if columns and columns == list(range(columns[0], columns[0] + len(columns))):
        return slice(columns[0], columns[0] + len(columns))
    return np.array(columns, dtype=np.int64)
