"""The rank level of many workers' partials on one process (a driver's ``ingest()``, journal replay), column-wise.

Workers rank in the order given. A partial whose metrics all have one update and plain columns (no lift between
the update and rank levels, see :func:`metricbus.reduce.columns_of`) goes into the block straight from its packed
fields, one numpy assignment per partial (per run of workers of one layout, for :class:`Ranks`); any other
worker's states (``others``: already update-level, as :meth:`metricbus.reduce.StepReducer.rank_level` and
torch.distributed's new names hand them) are lifted the usual way first. The merge is
:func:`metricbus.rank_level.merge`, the one every path uses, so the result is bit for bit what the collectives
compute from the same states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from metricbus import rank_level
from metricbus.fixed import Array
from metricbus.partial import Packed, Partial, from_packed
from metricbus.reduce import Ranked, StepReducer, WorkerStates, lift_columns
from metricbus.sketch import Sketch
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, Summary

_EMPTY = np.array(Summary().as_tuple())
_LAYOUTS_KEPT = 64
_COPY_ENTRIES = 1 << 12  # entries of Ranks copied into a block at a time (~400 KB)


@dataclass(frozen=True, slots=True)
class Ranks:
    """Several workers' partials, none with a rest or a sketch, in rank order, as one array per run of workers of
    one layout: ``groups[g]`` is ``(packed, fields)``, ``fields[:, r, :]`` the run's ``r``-th worker's packed fields
    and ``packed`` their layout (its fields are the run's first worker's). A journal commit whose rank files each
    hold ranks that log the same names is read as one."""

    groups: tuple[tuple[Packed, Array], ...]  # fields: (N_FIELDS, workers, entries) float64

    def __len__(self) -> int:
        return sum(int(fields.shape[1]) for _, fields in self.groups)

    def partials(self) -> list[Partial]:
        """Each worker's partial."""
        return [
            from_packed(Packed(packed.names, packed.specs, fields[:, r, :], (), packed.layout, packed.single),
                        frozenset())
            for packed, fields in self.groups
            for r in range(fields.shape[1])
        ]


Workers = Sequence[Partial] | Ranks
Batch = tuple[Workers, Sequence[WorkerStates], Mapping[str, Spec]]  # one commit's workers and specs


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
        key = _key(partials) if seen is not None and not others else None
        layout = seen.get(key) if seen is not None and key is not None else None
        if layout is None:
            layout = _Layout(_listed(partials), others, specs, reducer)
            if seen is not None and key is not None:
                if len(seen) >= _LAYOUTS_KEPT:
                    seen.clear()
                seen[key] = layout
        layouts.append(layout)
    rows = max((layout.rows for layout in layouts), default=0)
    total = sum(layout.width for layout in layouts)
    fields = np.empty((N_FIELDS, rows, total))
    rests: list[tuple[int, int, int, tuple[float, ...]]] = []
    sketches: list[tuple[int, int, Sketch]] = []
    offset = 0
    for layout, (partials, others, specs) in zip(layouts, commits, strict=True):
        layout.fill(fields[:, :, offset : offset + layout.width], partials, others, specs, rests, sketches, offset)
        offset += layout.width
    moments = np.concatenate([layout.moments for layout in layouts]) if layouts else np.zeros(0, dtype=bool)
    block = rank_level.Block(fields, np.arange(rows, dtype=np.int64), moments, tuple(rests), tuple(sketches))
    merged = rank_level.merge(block)
    out = []
    offset = 0
    for layout in layouts:
        ranked: Ranked
        if layout.unit:  # one column per metric: no slicing
            columns = merged[offset : offset + layout.width]
            ranked = {name: (m,) for name, m in zip(layout.where, columns, strict=True) if m is not None}
        else:
            ranked = {}
            for name, (base, n) in layout.where.items():
                results = tuple(merged[offset + base : offset + base + n])
                if any(c is not None for c in results):
                    ranked[name] = results
        out.append(ranked)
        offset += layout.width
    return out


def _listed(partials: Workers) -> Sequence[Partial]:
    """A commit's workers as partials (of :class:`Ranks`: a run's first worker's once per worker of the run: a
    layout is all a :class:`_Layout` reads of them)."""
    if isinstance(partials, Ranks):
        return [p for packed, fields in partials.groups for p in [from_packed(packed, frozenset())] * fields.shape[1]]
    return partials


def _key(partials: Workers) -> tuple[bytes, ...]:
    """The layouts of a commit's workers, in order."""
    if isinstance(partials, Ranks):
        return tuple(layout for packed, fields in partials.groups for layout in [packed.layout] * fields.shape[1])
    return tuple(p.packed.layout for p in partials)


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
        moments: list[bool] = []
        width = 0
        for name in sorted(names):
            columns = reducer.columns(name, specs[name])
            self.where[name] = (width, len(columns))
            moments.extend(moment for _, _, moment, _ in columns)
            width += len(columns)
        self.moments = np.array(moments, dtype=bool)
        self.width = width
        self.unit = width == len(self.where)  # one column per metric
        self.rows = len(partials) + len(others)
        self.index: dict[bytes, slice | Array] = {}  # per plain layout: where its entries go

    def fill(  # noqa: PLR0917  (one commit's share of the block)
        self,
        fields: Array,
        partials: Workers,
        others: Sequence[WorkerStates],
        specs: Mapping[str, Spec],
        rests: list[tuple[int, int, int, tuple[float, ...]]],
        sketches: list[tuple[int, int, Sketch]],
        offset: int,
    ) -> None:
        """Write this commit's rows into ``fields`` (its columns of the block), and its rests (block columns)."""
        reducer, where = self.reducer, self.where
        if isinstance(partials, Ranks):
            if all(self.plain[packed.layout] for packed, _ in partials.groups):
                self._copy(fields, partials)
                partials = ()
            else:
                partials = partials.partials()
        elif partials and self._stacked(fields, partials):
            partials = ()
        slow: list[tuple[int, WorkerStates]] = []
        for r, partial in enumerate(partials):
            packed = partial.packed
            if not self.plain[packed.layout]:
                slow.append((r, reducer.worker(partial.updates(), specs)))
                continue
            at = self._at(packed)
            if not (isinstance(at, slice) and at == slice(0, self.width)):  # the partial lacks some columns
                fields[:, r, :] = _EMPTY[:, None]
            fields[:, r, at] = packed.fields
            for i, rest in packed.rests:
                column = offset + where[packed.names[i]][0]
                rests.extend((r, column, which, parts) for which, parts in enumerate(rest) if parts)
            for i, sketch in packed.sketches:
                sketches.append((r, offset + where[packed.names[i]][0], sketch))
        slow.extend((self.rows - len(others) + i, states) for i, states in enumerate(others))
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

    def _stacked(self, fields: Array, partials: Sequence[Partial]) -> bool:
        """Write every row in one ``np.stack`` where all ``partials`` are plain, of one layout filling every column,
        without rests or sketches (a driver's usual commit: its workers log the same metrics); else False."""
        packeds = [partial.packed for partial in partials]
        layout = packeds[0].layout
        at = self._at(packeds[0]) if self.plain[layout] else None
        if not (isinstance(at, slice) and at == slice(0, self.width)):
            return False
        if any(packed.layout != layout or packed.rests or packed.sketches for packed in packeds):
            return False
        np.stack([packed.fields for packed in packeds], axis=1, out=fields[:, : len(packeds), :])
        return True

    def _copy(self, fields: Array, ranks: Ranks) -> None:
        """Write plain :class:`Ranks` into ``fields``: a run of workers in a few numpy assignments."""
        first = 0
        for packed, source in ranks.groups:
            at = self._at(packed)
            n = source.shape[1]
            if not (isinstance(at, slice) and at == slice(0, self.width)):  # the workers lack some columns
                fields[:, first : first + n, :] = _EMPTY[:, None, None]
            step = max(1, _COPY_ENTRIES // max(1, source.shape[2]))
            for r in range(0, n, step):  # a few workers at a time: the transposing copy stays in cache
                fields[:, first + r : first + min(r + step, n), at] = source[:, r : r + step]
            first += n

    def _at(self, packed: Packed) -> slice | Array:
        """Where a plain layout's entries go in this commit's columns."""
        at = self.index.get(packed.layout)
        if at is None:
            at = self.index[packed.layout] = _positions([self.where[name][0] for name in packed.names])
        return at


def _positions(columns: list[int]) -> slice | Array:
    """Where a layout's entries go: a slice when they are consecutive columns (a plain copy), else an index."""
    if columns and columns == list(range(columns[0], columns[0] + len(columns))):
        return slice(columns[0], columns[0] + len(columns))
    return np.array(columns, dtype=np.int64)
