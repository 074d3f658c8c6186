"""Replay's columnar path: many commits of one shape reduced and emitted as arrays (``log_every`` 1; larger, with
:mod:`metricbus.replay_windows`).

Most journals are commit after commit of the same shape: the same ranks logging the same names, one Summary each.
For a run of such commits, :class:`ColumnLayout` decides once what each row is (which rank, which metric, which
emitted keys under which kind), and :meth:`ColumnLayout.emit` reduces the run's rows with numpy: the rank level
(:mod:`metricbus.column_merge`), then each emitted kind (:mod:`metricbus.column_kinds`). With ``log_every`` 1 a
commit's step level is its own rank level, so the emitted value is the kind of the merged state (or of its lift).

Exactness is kept element by element: whatever the vectorized code does not settle (non-finite data, weights across
ranks, a second moment merged across ranks, a division it cannot decide, a lift at the step level) is computed by
the scalar code every path uses (:func:`metricbus.rank_level.merge`, the :class:`metricbus.reduce.Plan`'s kinds) on
just those elements. A commit whose shape does not fit (rests or sketches, repeated names, a rule that changes a
name's columns) is not given to this path at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from metricbus import rank_level
from metricbus.canonical import canonical
from metricbus.column_kinds import COLUMN_KINDS, Merged
from metricbus.column_merge import merge_columns, single_columns
from metricbus.fixed import Array
from metricbus.journal.scan import RawPart, shape_bytes
from metricbus.kinds import is_sketch
from metricbus.reduce import Plan, StepReducer, plans_of
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, Summary

Respec = Callable[[str, Spec], Spec]
_EMPTY = np.array(Summary().as_tuple())
_new = tuple.__new__


class ColumnLayout:
    """What the rows of commits of one shape are: built from one commit's parts by :meth:`of` (None: the shape does
    not fit the columnar path), then shared by every commit whose parts have the same rows (:func:`shape_of`)."""

    def __init__(self, parts: Sequence[RawPart], names: list[str], specs: dict[str, Spec], reducer: StepReducer,
                 rows: tuple[Array, Array, Array]) -> None:
        self.tables = [part.names for part in parts]  # held: the shape key names them by id
        self.ranks, row_ranks, row_metrics = rows  # the ranks, and each row's rank (its index there) and metric
        self.rows = len(row_ranks)
        self.single = len(self.ranks) == 1
        self.names = names
        where = np.full((len(self.ranks), len(names)), self.rows, dtype=np.int64)  # the padding row: absent
        where[row_ranks, row_metrics] = np.arange(self.rows)
        self.where = where
        self.present = where < self.rows
        self.lowest = self.present.argmax(axis=0)
        self.regular = bool(self.present.all()) and bool((where.ravel() == np.arange(self.rows)).all())
        self.moments = np.array([reducer.columns(name, specs[name])[0][2] for name in names], dtype=bool)
        outputs = sorted(
            (plan.key, m, chain.step, plan)
            for m, name in enumerate(names)
            for chain, plan in zip(specs[name].chains, plans_of(name, specs[name]), strict=True)
        )
        self.keys = [key for key, _, _, _ in outputs]
        self.metric_of = np.array([m for _, m, _, _ in outputs], dtype=np.int64)
        self.plans: list[Plan] = [plan for _, _, _, plan in outputs]
        by_kind: dict[str, list[int]] = {}
        for k, (_, _, kind, plan) in enumerate(outputs):
            if plan.step_lift is None and kind in COLUMN_KINDS:
                by_kind.setdefault(kind, []).append(k)
        # each kind's outputs in metric order (a kind's columns depend on their own metric alone): where a kind is
        # every metric's, it reads the merged states as they are (select_metrics), none copied
        self.by_kind = {
            kind: np.array(sorted(ks, key=lambda k: int(self.metric_of[k])), dtype=np.int64)
            for kind, ks in by_kind.items()
        }
        self.template = dict.fromkeys(self.keys, 0.0)  # a commit's emitted dict, copied: no dict grown key by key
        self.specs = specs
        # whether a window of commits (log_every > 1) can be merged in columns (metricbus.replay_windows): the step
        # level reads the rank-level state as it is, and no kind reads a second moment the columns do not merge
        self.windowable = all(plan.step_lift is None for plan in self.plans) and (
            self.single or not (bool(self.moments.any()) or any(step == "std" for _, _, step, _ in outputs))
        )  # (std, the one kind reading m2, is a step kind only where it is the rank kind: the second test is a guard)

    @classmethod
    def of(cls, parts: Sequence[RawPart], respec: Respec, reducer: StepReducer) -> ColumnLayout | None:
        """The layout of a commit's rows, or None when they do not fit: a rest or a sketch, an unknown name id, a
        rank in two parts, a name twice for one rank (several updates), or a name whose spec is not the same one
        column from the micro to the rank level."""
        read = _rows_of(parts, respec)
        if read is None:
            return None
        specs, ranks, metrics = read
        row_ranks, row_metrics = np.concatenate(ranks), np.concatenate(metrics)
        per_part = [_distinct(r)[0] for r in ranks]
        order, rank_index = _distinct(row_ranks)
        names = list(specs)
        keys = [plan.key for name in names for plan in plans_of(name, specs[name])]
        fits = (
            len(order) == sum(len(u) for u in per_part)  # else a later part's entries of a rank replace an earlier's
            and len(_distinct(rank_index * len(names) + row_metrics)[0]) == len(row_ranks)  # one update per rank
            and all(_plain(name, spec, reducer) for name, spec in specs.items())
            and len(set(keys)) == len(keys)  # else the step level merges two chains emitting one key
        )
        return cls(parts, names, specs, reducer, (order, rank_index, row_metrics)) if fits else None

    def emit(self, fields: Array) -> list[dict[str, float]]:
        """Each commit's emitted ``{key: value}`` (sorted by key; a metric no worker has is left out; every NaN
        ``math.nan``, as :func:`metricbus.canonical.nans` makes it) from its rows (``fields``: (T, rows, N_FIELDS), in
        the layout's row order)."""
        table = self._grid(fields)
        if self.single:
            table = table[:, 0]
            merged, ok = single_columns(table)
        else:
            merged, ok = merge_columns(table, self.present, self.lowest)
        out, done = self.values(merged, ok)
        if not done.all():
            self._settle(out, table, ~done)
        return out

    def values(self, merged: Merged, ok: Array) -> tuple[list[dict[str, float]], Array]:
        """Each row's ``{key: value}`` (sorted by key) of merged states ((rows, metrics) arrays), by the column
        kinds, and (rows, keys) the mask of the values they settled where ``ok`` ((rows, metrics)) holds; the others
        are for the caller to compute."""
        values = np.empty((len(ok), len(self.keys)))
        done = np.zeros(values.shape, dtype=bool)
        for kind, ks in self.by_kind.items():
            columns = self.metric_of[ks]
            got, settled = COLUMN_KINDS[kind](select_metrics(merged, columns, len(self.names)))
            values[:, ks] = got
            done[:, ks] = settled & ok[:, columns]
        nan = np.isnan(values)
        if nan.any():  # every emitted NaN is math.nan (metricbus.canonical); np.nan has its bits
            values[nan] = np.nan
        keys, template = self.keys, self.template
        out = []
        for row in values.tolist():
            metrics = template.copy()
            metrics.update(zip(keys, row, strict=True))
            out.append(metrics)
        return out, done

    def states(self, fields: Array) -> tuple[Array, Array]:
        """``(states, held)``: each commit's rank-level state of each metric as its Summary's fields, (T, metrics,
        N_FIELDS) (a metric no worker has: count 0), from its rows (as :meth:`emit` reads them), and (T,) whether
        every state of the commit is those fields (False: one has a rest, which the columns do not hold). Of several
        workers, ``m2`` is left 0.0 unless a scalar merge settled the element (a layout is windowable only where no
        kind reads it)."""
        table = self._grid(fields)
        if self.single:  # one worker: its state as it is (the old path reads no count-0 row); read, never written
            return table[:, 0], np.ones(len(table), dtype=bool)
        merged, ok = merge_columns(table, self.present, self.lowest)
        count = merged.count
        states = np.stack(
            (count, count, np.zeros(count.shape), merged.wsum, merged.wsum_lo, merged.total, merged.wsum_lo,
             np.zeros(count.shape), merged.min, merged.max, merged.first, merged.last),
            axis=-1,
        )
        held = np.ones(len(table), dtype=bool)
        if not ok.all():
            needed = [(int(t), int(m)) for t, m in zip(*np.nonzero(~ok), strict=True)]
            for (t, m), state in zip(needed, self._states(table, needed), strict=True):
                if state is None:
                    states[t, m] = _EMPTY
                elif state.rest or state.sketch is not None:
                    held[t] = False
                else:
                    states[t, m] = state.as_tuple()
        return states, held

    def ranked(self, fields: Array, commits: list[int]) -> list[dict[str, tuple[Summary | None, ...]]]:
        """The rank-level results of some commits (indexes into ``fields``'s), per metric (one column each) as the
        reducer reads them, computed as :meth:`_settle` computes an element (a metric no worker has: left out)."""
        table = self._grid(fields)
        if self.single:
            table = table[:, 0]
        needed = [(t, m) for t in commits for m in range(len(self.names))]
        found = iter(self._states(table, needed))
        return [{name: (state,) for name in self.names if (state := next(found)) is not None} for _ in commits]

    def _grid(self, fields: Array) -> Array:
        """The rows as (T, ranks, metrics, N_FIELDS), an absent worker holding the empty Summary."""
        t = fields.shape[0]
        if self.regular:
            return fields.reshape(t, len(self.ranks), len(self.names), N_FIELDS)
        padded = np.empty((t, self.rows + 1, N_FIELDS))
        padded[:, : self.rows] = fields
        padded[:, self.rows] = _EMPTY
        return padded[:, self.where]

    def _settle(self, out: list[dict[str, float]], table: Array, unsettled: Array) -> None:
        """The unsettled elements by the scalar code: each (commit, metric)'s merged Summary, then its plans."""
        at, ks = np.nonzero(unsettled)
        needed = sorted(set(zip(at.tolist(), self.metric_of[ks].tolist(), strict=True)))
        states = dict(zip(needed, self._states(table, needed), strict=True))
        for t, k in zip(at.tolist(), ks.tolist(), strict=True):
            state = states[t, int(self.metric_of[k])]
            plan, key = self.plans[k], self.keys[k]
            if state is None:
                del out[t][key]
                continue
            out[t][key] = canonical(plan.emit(plan.at_step(state)))

    def _states(self, table: Array, needed: list[tuple[int, int]]) -> Sequence[Summary | None]:
        """The rank-level Summary of each (commit, metric) in ``needed`` (None: no worker has records)."""
        if self.single:  # one worker: its state, as the live single path reads it (a count of 0 is no state)
            rows = table[[t for t, _ in needed], [m for _, m in needed]].tolist()
            return [row_summary(row) if row[0] else None for row in rows]
        picked = table[[t for t, _ in needed], :, [m for _, m in needed]]  # (n, R, N_FIELDS)
        moments = self.moments[[m for _, m in needed]]
        block = rank_level.Block(np.ascontiguousarray(picked.transpose(2, 1, 0)), self.ranks, moments)
        return rank_level.merge(block)


def _rows_of(parts: Sequence[RawPart], respec: Respec) -> tuple[dict[str, Spec], list[Array], list[Array]] | None:
    """``(specs by name in order of appearance, each part's row ranks, each part's row metric indexes)``; None for
    a part with rests or no rows, an unknown name id, or a name with two specs."""
    specs: dict[str, Spec] = {}
    metric: dict[str, int] = {}
    ranks, metrics = [], []
    for part in parts:
        if part.rests or not len(part.rows):
            return None
        ids, inverse = _distinct(part.rows["id"])
        found = []
        for ident in ids.tolist():  # each name once per part, not once per row
            known = part.names.get(ident)
            if known is None:
                return None
            name, spec = known
            spec = respec(name, spec)
            if specs.setdefault(name, spec) != spec:
                return None
            found.append(metric.setdefault(name, len(metric)))
        ranks.append(part.rows["rank"].astype(np.int64))
        metrics.append(np.array(found, dtype=np.int64)[inverse])
    return specs, ranks, metrics


def shape_of(parts: Sequence[RawPart]) -> tuple[Any, ...] | None:
    """What makes two commits' rows the same shape (their name tables, ranks and name ids); None: rests. The
    reader's ``shape`` where it has one (the commits of a run share one bytes object: compared at once)."""
    if len(parts) == 1:  # one rank file
        part = parts[0]
        if part.rests:
            return None
        return id(part.names), part.shape or shape_bytes(part.rows)
    key: list[Any] = []
    for part in parts:
        if part.rests:
            return None
        key.extend((id(part.names), part.shape or shape_bytes(part.rows)))
    return tuple(key)


def _plain(name: str, spec: Spec, reducer: StepReducer) -> bool:
    """One column kept from the micro to the rank level, no distribution kind at any level."""
    return reducer.plain(name, spec) and not any(
        is_sketch(kind) for chain in spec.chains for kind in (chain.micro, chain.update, chain.rank, chain.step)
    )


def _distinct(values: Array) -> tuple[Array, Array]:
    """``(sorted distinct values, each value's index among them)`` of non-negative integers: by a table as long
    as the largest value where that is short (row ids and ranks are), else by sorting."""
    values = values.astype(np.int64)
    top = int(values.max()) if len(values) else -1
    if top > 4 * len(values) + 4096:
        uniq, inverse = np.unique(values, return_inverse=True)
        return uniq, inverse.ravel()
    seen = np.zeros(top + 1, dtype=bool)
    seen[values] = True
    uniq = np.flatnonzero(seen)
    index = np.zeros(top + 1, dtype=np.int64)
    index[uniq] = np.arange(len(uniq))
    return uniq, index[values]


def select_metrics(merged: Merged, columns: Array, metrics: int) -> Merged:
    """The merged states of some metrics (columns) of ``metrics``: ``merged`` itself when they are all of them, in
    order (a journal whose metrics all have one kind)."""
    if len(columns) == metrics and bool((columns == np.arange(metrics)).all()):
        return merged
    held = {f.name: getattr(merged, f.name) for f in dataclasses.fields(Merged)}
    return Merged(**{name: None if a is None else a[:, columns] for name, a in held.items()})


def row_summary(row: list[float]) -> Summary:
    """A journal row's Summary, as the reader builds it (the count back to an int)."""
    return _new(Summary, (int(row[0]), *row[1:], (), None))


class Layouts:
    """The layouts of the commit shapes met so far (a few: a writer's commits repeat one or two shapes)."""

    def __init__(self, respec: Respec, reducer: StepReducer, *, windows: bool = False) -> None:
        self._respec, self._reducer = respec, reducer
        self._windows = windows  # log_every > 1: only layouts whose windows merge in columns
        self._held: dict[tuple[Any, ...], ColumnLayout | None] = {}
        self._last: tuple[tuple[Any, ...] | None, ColumnLayout | None] = (None, None)

    def of(self, parts: Sequence[RawPart]) -> ColumnLayout | None:
        """The layout of a commit's rows (None: they do not fit the columnar path)."""
        key = shape_of(parts)
        if key is None:
            return None
        if key == self._last[0]:  # the shape of the commit before: compared, not hashed
            return self._last[1]
        if key not in self._held:
            if len(self._held) >= _LAYOUTS_KEPT:
                self._held.clear()
            layout = ColumnLayout.of(parts, self._respec, self._reducer)
            self._held[key] = layout if layout is None or layout.windowable or not self._windows else None
        self._last = (key, self._held[key])
        return self._last[1]


def run_fields(parts: Sequence[Sequence[RawPart]]) -> Array:
    """(T, rows, N_FIELDS): the rows of several commits of one shape, stacked."""
    if len(parts) == 1 and len(parts[0]) == 1:  # one commit (a large one, or a run cut short): its rows as they are
        return parts[0][0].rows["fields"][None]
    if all(len(p) == 1 for p in parts):
        return np.stack([p[0].rows["fields"] for p in parts])
    return np.stack([np.concatenate([part.rows["fields"] for part in p]) for p in parts])


_LAYOUTS_KEPT = 64
