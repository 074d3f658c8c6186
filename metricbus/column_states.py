"""A single worker's commit read from its micro columns: the emitted values of most metrics in a few numpy calls.

:class:`ColumnStates` is what :meth:`StepReducer.worker <metricbus.reduce.StepReducer.worker>` returns for one
update held as a :class:`~metricbus.micro_columns.MicroUpdate`: the worker-level states of each metric, built on
first use (the rank level, several workers, a ``log_every`` window read them so). A single worker's commit with
``log_every=1`` instead calls :meth:`ColumnStates.emit`: each metric whose chains all keep one kind of the Summary's
statistics from the micro to the step level emits that kind of its column, for all such metrics at once, and the
same value :mod:`metricbus.kinds` computes, bit for bit (the elementwise kinds of :mod:`metricbus.column_kinds`,
which replay's columnar path uses too). A value they leave unsettled (a tie in a division, a std whose quotient
overflows) is computed from the Summary, as is every metric of another shape (a lift, a distribution kind, a
metric summarised on its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from metricbus.column_kinds import COLUMN_KINDS, Merged, divide_by_count, shifted
from metricbus.kinds import KINDS, Kind
from metricbus.micro_columns import MicroUpdate
from metricbus.spec import Spec
from metricbus.summary import Summary

States = tuple[Summary, ...]
StatesOf = Callable[[Mapping[str, Summary]], Mapping[str, States]]  # worker-level states of micro summaries
Scalar = Callable[[str, States], dict[str, float]]  # a metric's emitted values from its states, one at a time
_VECTOR: dict[Kind, str] = {KINDS[kind]: kind for kind in COLUMN_KINDS}
_LAYOUTS_KEPT = 64


class ColumnStates(Mapping[str, States]):
    """Every metric's worker-level states of one update held in columns: read as a mapping (the rank level, a
    window), all are built at once on first use by ``states_of`` (the update's Summaries in one go); :meth:`emit`
    builds only the few it computes one at a time."""

    __slots__ = ("_built", "states_of", "update")

    def __init__(self, *, update: MicroUpdate, states_of: StatesOf) -> None:
        self.update = update
        self.states_of = states_of
        self._built: Mapping[str, States] | None = None

    def __getitem__(self, name: str) -> States:
        built = self._built
        if built is None:
            built = self._built = self.states_of(self.update)
        return built[name]

    def get(self, name: str, default: Any = None) -> Any:  # Mapping.get's try/except costs ~1 µs a call
        built = self._built
        if built is None:
            built = self._built = self.states_of(self.update)
        return built.get(name, default)

    def _one(self, name: str) -> States:
        """``name``'s states alone (what emit computes one at a time)."""
        return self.states_of({name: self.update[name]})[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.update)

    def __len__(self) -> int:
        return len(self.update)

    def emit(
        self, *, specs: Mapping[str, Spec], layouts: Layouts, scalar: Scalar, version: int | None = None
    ) -> dict[str, float]:
        """The emitted values (sorted by key) of this update as one worker's whole commit with ``log_every=1``
        (``version``: the spec table's, when ``specs`` is its mapping)."""
        update = self.update
        names = update.names
        layout = layouts.of(names, specs, version)
        fields = update.fields
        parts = []
        for kind, _, index in layout.groups:
            values, exact = _values(kind, fields if index is layout.every else fields[:, index])
            if exact is not None:  # computed from the Summary where the columns do not settle it
                values = values.copy()
                kind_fn = KINDS[kind]
                for j in np.flatnonzero(~exact).tolist():
                    values[j] = kind_fn(update[names[index[j]]])
            parts.append(values)
        joined = (np.concatenate(parts) if len(parts) > 1 else parts[0]) if parts else np.empty(0)
        if not layout.single and not update.others:  # the usual commit: the keys' sorted order is decided already
            ordered = joined if layout.order is None else joined[layout.order]
            return dict(zip(layout.ordered, ordered.tolist(), strict=True))
        out = dict(zip(layout.keys, joined.tolist(), strict=True))
        for name in layout.single:
            out.update(scalar(name, self._one(name)))
        for name in update.others:
            out.update(scalar(name, self._one(name)))
        return {key: out[key] for key in sorted(out)}


def _values(kind: str, columns: Any) -> tuple[Any, Any]:
    """A kind's values of ``columns`` (the fields of some metrics) and where they are exact (None: everywhere), by
    :mod:`metricbus.column_kinds`."""
    f = columns
    micro = _MICRO_KINDS.get(kind)
    if micro is not None:
        return micro(f)
    return _merged_values(kind, f)


def _merged_values(kind: str, f: Any) -> tuple[Any, Any]:
    merged = Merged(f[0], f[1], f[2], f[3], f[4], f[5], f[7], f[8], f[9], f[10], f[11])
    values, done = COLUMN_KINDS[kind](merged)
    return values, None if done.all() else done


def _micro_mean(f: Any) -> tuple[Any, Any]:
    """:func:`metricbus.column_kinds.mean` of unit-weight columns, whose weight is their count (>= 1, no
    ``weight_lo``): one division where ``wsum_lo`` is 0, else ``divide_by_count``. Columns of another kind
    (tensor weights, held on the device; several updates of them merged) take ``column_kinds.mean``."""
    if not ((f[2] == 0.0).all() and (f[1] == f[0]).all()):
        return _merged_values("mean", f)
    values = f[3] / f[1]  # wsum / weight: finite over at least 1, so no overflow
    rest = f[4] != 0.0
    if not rest.any():
        return values, None
    rest &= ~shifted(values, f[1])  # a power-of-two count: exact already
    if not rest.any():
        return values, None
    quick, found = divide_by_count(f[3][rest], f[4][rest], f[1][rest])
    values[rest] = quick
    if found.all():
        return values, None
    exact = np.ones(len(values), dtype=bool)
    exact[rest] = found
    return values, exact


_MICRO_KINDS: dict[str, Callable[[Any], tuple[Any, Any]]] = {"mean": _micro_mean}  # shortcuts for micro columns


class Layout:
    """What :meth:`ColumnStates.emit` decided for one list of names and their specs: per vectorized kind, the
    emitted keys and the columns they read (``groups``); ``keys``, theirs in group order, and ``ordered`` = ``keys``
    sorted, = ``keys[order]``; the names emitted one at a time (``single``)."""

    __slots__ = ("every", "groups", "keys", "order", "ordered", "single")

    def __init__(self, groups: list[tuple[str, list[str], Any]], single: list[str], every: Any = None) -> None:
        self.groups = groups
        self.single = single
        self.every = every  # a group's index that reads every column in order (the group reads the fields as they are)
        self.keys = [key for _, keys, _ in groups for key in keys]
        order = sorted(range(len(self.keys)), key=self.keys.__getitem__)
        self.ordered = [self.keys[i] for i in order]
        sorted_already = order == list(range(len(order)))
        self.order = None if sorted_already else np.array(order, dtype=np.intp)  # None: ``keys`` are sorted


class Layouts:
    """The layouts met so far, keyed by the names and their spec objects (a few per run: the names of a commit
    rarely change). ``plans_of(name, spec)`` gives a metric's ``(state keys, plans)``."""

    __slots__ = ("_held", "_last", "_plans_of")

    def __init__(self, plans_of: Callable[[str, Spec], tuple[tuple[str, ...], tuple[Any, ...]]]) -> None:
        self._plans_of = plans_of
        self._held: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[Layout, tuple[Spec, ...]]] = {}
        self._last: tuple[tuple[str, ...], Mapping[str, Spec], int, Layout] | None = None  # the last, by version

    def of(self, names: tuple[str, ...], specs: Mapping[str, Spec], version: int | None = None) -> Layout:
        """The layout of ``names`` under ``specs`` (``version``: the spec table's, when ``specs`` is its mapping:
        the same names object, mapping and version as last time decide the same layout without a look at them)."""
        last = self._last
        if last is not None and names is last[0] and specs is last[1] and version == last[2]:
            return last[3]
        layout = self._of(names, specs)
        if version is not None:
            self._last = (names, specs, version, layout)
        return layout

    def _of(self, names: tuple[str, ...], specs: Mapping[str, Spec]) -> Layout:
        of_name = [*map(specs.__getitem__, names)]
        key = (names, tuple(map(id, of_name)))
        held = self._held.get(key)
        if held is not None:
            return held[0]
        if len(self._held) >= _LAYOUTS_KEPT:
            self._held.clear()
        layout = self._decide(names, of_name)
        self._held[key] = (layout, tuple(of_name))  # the specs are kept so their ids stay theirs
        return layout

    def _decide(self, names: tuple[str, ...], specs: list[Spec]) -> Layout:
        grouped: dict[str, tuple[list[str], list[int]]] = {}
        single = []
        for i, (name, spec) in enumerate(zip(names, specs, strict=True)):
            keys, plans = self._plans_of(name, spec)
            kinds = [_VECTOR.get(plan.emit) for plan in plans]
            direct = all(plan.rank_lift is None and plan.step_lift is None for plan in plans)
            if keys != ("",) or not direct or None in kinds:
                single.append(name)
                continue
            for plan, kind in zip(plans, kinds, strict=True):
                assert kind is not None
                group = grouped.setdefault(kind, ([], []))
                group[0].append(plan.key)
                group[1].append(i)
        groups = [(kind, keys, np.array(index, dtype=np.intp)) for kind, (keys, index) in grouped.items()]
        index = groups[0][2] if len(groups) == 1 and not single else None
        every = index if index is not None and np.array_equal(index, np.arange(len(names))) else None
        return Layout(groups, single, every)
