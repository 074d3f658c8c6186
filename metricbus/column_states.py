"""A single worker's commit read from its micro columns: the emitted values of most metrics in a few numpy calls.

:class:`ColumnStates` is what :meth:`StepReducer.worker <metricbus.reduce.StepReducer.worker>` returns for one
update held as a :class:`~metricbus.micro_columns.MicroUpdate`: the worker-level states of each metric, built on
first use (the rank level, several workers, a ``log_every`` window read them so). A single worker's commit with
``log_every=1`` instead calls :meth:`ColumnStates.emit`: each metric whose chains all keep one kind of the Summary's
statistics from the micro to the step level emits that kind of its column, for all such metrics at once, and the
same value :mod:`metricbus.kinds` computes, bit for bit. A value a plain IEEE operation would not give exactly
(a mean whose sums have a remainder, a std whose quotient overflows) is computed from the Summary, as is every
metric of another shape (a lift, a distribution kind, a metric summarised on its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from metricbus.exact import _COUNT_LIMIT, _QUOTIENT_HIGH, _QUOTIENT_LOW, _SPLIT
from metricbus.kinds import KINDS, Kind
from metricbus.micro_columns import MicroUpdate
from metricbus.spec import Spec
from metricbus.summary import Summary

States = tuple[Summary, ...]
StatesOf = Callable[[Mapping[str, Summary]], Mapping[str, States]]  # worker-level states of micro summaries
Scalar = Callable[[str, States], dict[str, float]]  # a metric's emitted values from its states, one at a time
_ROWS = {"count": 0, "min": 8, "max": 9, "first": 10, "last": 11}  # the kinds that are one field
_VECTOR: dict[Kind, str] = {KINDS[kind]: kind for kind in (*_ROWS, "sum", "mean", "std")}
_LAYOUTS_KEPT = 64
_MAX = 1.7976931348623157e308


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

    def emit(self, *, specs: Mapping[str, Spec], layouts: Layouts, scalar: Scalar) -> dict[str, float]:
        """The emitted values (sorted by key) of this update as one worker's whole commit with ``log_every=1``."""
        update = self.update
        names = update.names
        layout = layouts.of(names, specs)
        fields = update.fields
        parts = []
        for kind, _, index in layout.groups:
            values, exact = _values(kind, fields[:, index])
            if exact is not None:  # computed from the Summary where the columns do not settle it
                values = values.copy()
                kind_fn = KINDS[kind]
                for j in np.flatnonzero(~exact).tolist():
                    values[j] = kind_fn(update[names[index[j]]])
            parts.append(values)
        joined = (np.concatenate(parts) if len(parts) > 1 else parts[0]) if parts else np.empty(0)
        if not layout.single and not update.others:  # the usual commit: the keys' sorted order is decided already
            return dict(zip(layout.ordered, joined[layout.order].tolist(), strict=True))
        out = dict(zip(layout.keys, joined.tolist(), strict=True))
        for name in layout.single:
            out.update(scalar(name, self._one(name)))
        for name in update.others:
            out.update(scalar(name, self._one(name)))
        return {key: out[key] for key in sorted(out)}


def _values(kind: str, columns: Any) -> tuple[Any, Any]:
    """A kind's values of ``columns`` (the fields of some metrics) and where they are exact (None: everywhere)."""
    row = _ROWS.get(kind)
    if row is not None:
        return columns[row], None
    weight = columns[1]
    if kind == "sum":  # Summary.sum: the total, within the double range
        exact = np.abs(columns[5]) < _MAX
        return columns[5], None if exact.all() else exact
    if kind == "mean":
        return _means(columns)
    m2 = np.maximum(columns[7], 0.0)  # std: Summary.std where its quotient neither overflows nor is NaN
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        ratio = m2 / weight
    exact = (ratio < np.inf) & (weight > 0.0)
    return np.sqrt(np.where(exact, ratio, 0.0)), None if exact.all() else exact


def _means(columns: Any) -> tuple[Any, Any]:
    """Summary.mean of each column where it is decided here: one IEEE division where both sums are one component;
    where Σw·x has a remainder and the weight is a count, the first step of :func:`metricbus.exact.divide_by_count`
    (a power-of-two count, or a quotient whose exact residual lies strictly inside the half gaps around it)."""
    weight, wsum, wsum_lo = columns[1], columns[3], columns[4]
    with np.errstate(all="ignore"):
        q = wsum / weight
        one = (columns[2] == 0.0) & (wsum_lo == 0.0)
        if one.all():
            return q, None
        c = _SPLIT * q
        q_hi = c - (c - q)
        rho = (wsum - q_hi * weight) - (q - q_hi) * weight
        off = rho + wsum_lo
        up = (np.nextafter(q, np.inf) - q) * 0.5 * weight
        down = (np.nextafter(q, -np.inf) - q) * 0.5 * weight
        size = np.abs(q)
        count = (columns[2] == 0.0) & (weight >= 1.0) & (weight < _COUNT_LIMIT) & (weight == np.floor(weight))
        inside = (size > _QUOTIENT_LOW) & (size < _QUOTIENT_HIGH)
        decided = one | (count & inside & ((np.frexp(weight)[0] == 0.5) | ((down < off) & (off < up))))
    return q, None if decided.all() else decided


class Layout:
    """What :meth:`ColumnStates.emit` decided for one list of names and their specs: per vectorized kind, the
    emitted keys and the columns they read (``groups``); ``keys``, theirs in group order, and ``ordered`` = ``keys``
    sorted, = ``keys[order]``; the names emitted one at a time (``single``)."""

    __slots__ = ("groups", "keys", "order", "ordered", "single")

    def __init__(self, groups: list[tuple[str, list[str], Any]], single: list[str]) -> None:
        self.groups = groups
        self.single = single
        self.keys = [key for _, keys, _ in groups for key in keys]
        self.order = np.array(sorted(range(len(self.keys)), key=self.keys.__getitem__), dtype=np.intp)
        self.ordered = [self.keys[i] for i in self.order.tolist()]


class Layouts:
    """The layouts met so far, keyed by the names and their spec objects (a few per run: the names of a commit
    rarely change). ``plans_of(name, spec)`` gives a metric's ``(state keys, plans)``."""

    __slots__ = ("_held", "_plans_of")

    def __init__(self, plans_of: Callable[[str, Spec], tuple[tuple[str, ...], tuple[Any, ...]]]) -> None:
        self._plans_of = plans_of
        self._held: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[Layout, tuple[Spec, ...]]] = {}

    def of(self, names: tuple[str, ...], specs: Mapping[str, Spec]) -> Layout:
        """The layout of ``names`` under ``specs``."""
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
        return Layout(groups, single)
