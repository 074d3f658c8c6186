"""The one reduction path: micro summaries -> update level -> rank level -> step window -> emitted floats.

Live logging (single process, ``export``/``ingest``, torch.distributed) and journal replay all drive one
:class:`StepReducer`, so they cannot disagree. The continuation rule, the same at every level: where a level's
kind equals the one below, the states merge; where it changes, each group's result becomes one unit-weight record
of the next level.

* **worker** (:func:`worker_states`): a worker's per-update micro summaries of a metric become its update-level
  states, one per distinct ``state key``: ``""`` (the updates' summaries merged: every chain whose update kind
  equals its micro kind) or a micro kind (each update's result lifted to one record, then merged).
* **rank** (:meth:`StepReducer.rank_level`): a metric's *columns* are its distinct rank-level inputs (a
  worker-level state, lifted by the update kind where it differs from the rank kind); each column merges across
  workers exactly and order-free (:mod:`metricbus.rank_level`); a worker without the metric does not count. Under
  torch.distributed the same merge runs as two collectives (:mod:`metricbus.dist`).
* **step**: the rank-level results of the last ``log_every`` commits merge (lifted where the step kind differs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metricbus.column_states import ColumnStates, Layouts
from metricbus.kinds import Kind, is_sketch, kind_of
from metricbus.micro_columns import MicroUpdate
from metricbus.ranked_columns import RankedColumns
from metricbus.sketch import Sketch
from metricbus.spec import Spec
from metricbus.summary import Summary, with_sketch
from metricbus.update_columns import merge_columns

WorkerStates = Mapping[str, tuple[Summary, ...]]  # metric -> its update-level states, in state_keys(spec) order
Ranked = dict[str, tuple[Summary | None, ...]]  # metric -> each column's rank-level result, in columns_of order
RankedStates = Mapping[str, tuple[Summary | None, ...]]  # a Ranked, or the same held in columns (RankedColumns)
Column = tuple[int, str | None, bool, bool]  # (the worker-level state it reads, the update kind it is lifted by or
# None, whether the rank level must merge its second moment, whether its states carry a sketch: see columns_of)
_of_value = Summary.of_value


def lift(value: float, *, sketched: bool) -> Summary:
    """A level's result as one unit-weight record of the next level (with its sketch where a distribution kind
    reads that level)."""
    state = _of_value(value)
    return with_sketch(state, Sketch.of_value(value)) if sketched else state


_MERGED = ("",)  # the state keys of a spec whose chains all keep the micro kind at the update level
# a name's decisions: its spec, plans, state keys, columns and whether each state key carries a sketch
_Held = tuple[Spec, tuple["Plan", ...], tuple[str, ...], tuple[Column, ...], tuple[bool, ...]]
_SHAPES_KEPT = 64  # name sets whose specs _merged_columns keeps


@dataclass(frozen=True, slots=True)
class Plan:
    """One chain of a spec, decided once per name: what to read and where to lift."""

    key: str  # the emitted name
    state: int  # the worker-level state it reads: its index in state_keys(spec) ("" or the micro kind)
    rank_lift: Kind | None  # the update kind, where the rank kind differs
    rank_sketch: bool  # whether the rank kind reads a sketch (so a lift into it makes one)
    column: int  # its rank-level input: the index in columns_of(spec)
    step_lift: Kind | None  # the rank kind, where the step kind differs
    step_sketch: bool  # whether the step kind reads a sketch
    emit: Kind  # the step kind

    def at_step(self, result: Summary) -> Summary:
        """Its rank-level ``result`` as the step level reads it (lifted where the step kind differs)."""
        return result if self.step_lift is None else lift(self.step_lift(result), sketched=self.step_sketch)


def plans_of(name: str, spec: Spec) -> tuple[Plan, ...]:
    """The plans of ``name``'s chains."""
    keys = state_keys(spec)
    columns = columns_of(spec)
    return tuple(
        Plan(
            key=f"{name}/{c.suffix}" if c.suffix else name,
            state=keys.index("" if c.micro == c.update else c.micro),
            rank_lift=None if c.update == c.rank else kind_of(c.update),
            rank_sketch=is_sketch(c.rank),
            column=[col[:2] for col in columns].index(_column(c, keys)),
            step_lift=None if c.rank == c.step else kind_of(c.rank),
            step_sketch=is_sketch(c.step),
            emit=kind_of(c.step),
        )
        for c in spec.chains
    )


def _column(chain: Any, keys: list[str]) -> tuple[int, str | None]:
    return keys.index("" if chain.micro == chain.update else chain.micro), (
        None if chain.update == chain.rank else chain.update
    )


def columns_of(spec: Spec) -> list[Column]:
    """The distinct rank-level inputs of ``spec``'s chains, in a fixed order: ``(state, lift, moment, sketch)``,
    where ``moment`` says whether a chain reads the second moment of the merged state (its rank kind is ``std``) and
    ``sketch`` whether the states carry a sketch (a lifted column: a chain's rank kind reads one; else the state
    carries one)."""
    keys = state_keys(spec)
    carried = state_sketches(spec)
    found: dict[tuple[int, str | None], tuple[bool, bool]] = {}
    for chain in spec.chains:
        column = _column(chain, keys)
        moment, sketch = found.get(column, (False, False))
        found[column] = (moment or chain.rank == "std", sketch or is_sketch(chain.rank))
    return [
        (state, lift, found[state, lift][0], found[state, lift][1] if lift is not None else carried[state])
        for state, lift in sorted(found, key=lambda c: (c[0], c[1] or ""))
    ]


def lift_columns(states: tuple[Summary, ...], columns: Sequence[Column]) -> tuple[Summary, ...]:
    """One worker's rank-level inputs of a metric: each column's state, lifted where it says."""
    return tuple(
        states[state] if up is None else lift(kind_of(up)(states[state]), sketched=sketched)
        for state, up, _, sketched in columns
    )


def state_keys(spec: Spec) -> list[str]:
    """The worker-level state keys ``spec`` needs, in a fixed order."""
    return sorted({"" if c.micro == c.update else c.micro for c in spec.chains})


def state_sketches(spec: Spec) -> list[bool]:
    """Per state key (:func:`state_keys`): whether its states carry a sketch (``""``: where a chain that merges the
    micro summaries has a distribution kind; a lifted key: where an update kind reading it is one). The micro
    summaries carry one whenever any micro kind is a distribution (:func:`metricbus.spec.micro_sketch`); a ``""``
    state that no distribution kind reads drops it (see :func:`worker_state`)."""
    return [
        any(is_sketch(c.micro) for c in spec.chains if c.micro == c.update)
        if key == ""
        else any(is_sketch(c.update) for c in spec.chains if c.micro == key and c.update != c.micro)
        for key in state_keys(spec)
    ]


def worker_state(keys: Iterable[str], updates: Sequence[Summary], sketches: Sequence[bool]) -> tuple[Summary, ...]:
    """One worker's update-level states of one metric from its per-update micro summaries (in update order)."""
    out: list[Summary] = []
    for key, sketched in zip(keys, sketches, strict=True):
        if key == "":
            state = updates[0]
            for part in updates[1:]:
                state = state.merge(part)
            if not sketched and state.sketch is not None:  # only a lifted key's micro kind reads the sketch
                state = with_sketch(state, None)
        else:
            kind = kind_of(key)
            state = lift(kind(updates[0]), sketched=sketched)
            for part in updates[1:]:
                state = state.merge(lift(kind(part), sketched=sketched))
        out.append(state)
    return tuple(out)


class StepReducer:
    """The rank and step levels of one run: ``commit()`` per commit, ``finish()`` for the last partial window."""

    __slots__ = ("_commits", "_layouts", "_log_every", "_merged_specs", "_plans", "_window")

    def __init__(self, *, log_every: int) -> None:
        self._log_every = log_every
        self._commits = 0
        self._window: dict[str, tuple[Plan, Summary]] = {}
        self._plans: dict[str, _Held] = {}
        self._layouts = Layouts(self._keys_and_plans)
        # names -> (their specs, whether every one's update level merges its micro summaries)
        self._merged_specs: dict[tuple[str, ...], tuple[tuple[Spec | None, ...], bool]] = {}

    def _keys_and_plans(self, name: str, spec: Spec) -> tuple[tuple[str, ...], tuple[Plan, ...]]:
        held = self._plan(name, spec)
        return held[2], held[1]

    @property
    def pending(self) -> int:
        """Commits in the window that have not been emitted yet."""
        return self._commits

    def _plan(self, name: str, spec: Spec) -> _Held:
        held = self._plans.get(name)
        if held is None or held[0] is not spec:
            if held is None or held[0] != spec:
                keys = tuple(state_keys(spec))
                held = (spec, plans_of(name, spec), keys, tuple(columns_of(spec)), tuple(state_sketches(spec)))
            else:  # an equal spec object (a journal's name table read again): compare by identity from now on
                held = (spec, *held[1:])
            self._plans[name] = held
        return held

    def columns(self, name: str, spec: Spec) -> tuple[Column, ...]:
        """``name``'s rank-level inputs under ``spec`` (see :func:`columns_of`)."""
        return self._plan(name, spec)[3]

    def plain(self, name: str, spec: Spec) -> bool:
        """True when a worker's micro summary of ``name`` (one update) is its one rank-level input as it is: every
        chain keeps one kind from the micro to the rank level."""
        _, _, keys, columns, _ = self._plan(name, spec)
        return keys == _MERGED and len(columns) == 1 and columns[0][1] is None

    def worker(self, updates: Sequence[Mapping[str, Summary]], specs: Mapping[str, Spec]) -> WorkerStates:
        """A worker's update-level states of every metric it logged (``updates``: per optimizer update, in order,
        metric -> micro-level Summary; see :func:`worker_state`)."""
        out: dict[str, tuple[Summary, ...]] = {}
        plans = self._plans
        if updates and type(updates[0]) is MicroUpdate:  # held in columns: states built when read
            # several updates in columns are merged at once where their metrics allow it
            merged = updates[0] if len(updates) == 1 else self._merged_columns(updates, specs)
            if merged is not None:
                return ColumnStates(update=merged, states_of=lambda summaries: self.worker([dict(summaries)], specs))
        if len(updates) == 1:  # the common case: one update, so no merge; a lift only where a chain asks
            for name, summary in updates[0].items():
                if summary.count:
                    spec = specs[name]
                    held = plans.get(name)
                    if held is None or held[0] is not spec:
                        held = self._plan(name, spec)
                    out[name] = (summary,) if held[2] == _MERGED else worker_state(held[2], [summary], held[4])
            return out
        grouped: dict[str, list[Summary]] = {}
        for update in updates:
            for name, summary in update.items():
                if summary.count:
                    grouped.setdefault(name, []).append(summary)
        for name, parts in grouped.items():
            held = self._plan(name, specs[name])
            out[name] = worker_state(held[2], parts, held[4])
        return out

    def _merged_columns(
        self, updates: Sequence[Mapping[str, Summary]], specs: Mapping[str, Spec]
    ) -> MicroUpdate | None:
        """The updates merged in columns (:mod:`metricbus.update_columns`) when every one is held in columns with
        the same names and every name's update level is its merged micro summary (the state key ``""``); else
        None."""
        first = updates[0]
        assert type(first) is MicroUpdate
        names = first.names
        if first.others or any(type(u) is not MicroUpdate or u.others or u.names != names for u in updates[1:]):
            return None
        now = tuple(map(specs.get, names))
        held = self._merged_specs.get(names)
        if held is None or held[0] != now:  # a tuple compares its items by identity first
            if len(self._merged_specs) >= _SHAPES_KEPT:
                self._merged_specs.clear()
            held = self._merged_specs[names] = (now, all(self._plan(n, specs[n])[2] == _MERGED for n in names))
        if not held[1]:
            return None
        fields = first.fields
        for update in updates[1:]:
            fields = merge_columns(fields, update.fields)  # type: ignore[attr-defined]
            if fields is None:
                return None
        return MicroUpdate(names=names, fields=fields, others={})

    def rank_level(self, workers: Sequence[WorkerStates], specs: Mapping[str, Spec]) -> Ranked:
        """Each metric's columns merged across ``workers`` (in rank order) exactly: :mod:`metricbus.rank_level`, with
        the block laid out by :func:`metricbus.packed_ranks.rank_level_of` (the one place that lays out workers)."""
        if len(workers) == 1:  # the merge of one worker is the identity
            return {name: lift_columns(states, self._plan(name, specs[name])[3]) for name, states in workers[0].items()}
        from metricbus.packed_ranks import rank_level_of  # it builds on this module: imported when used

        return rank_level_of((), workers, specs, self)

    def commit(
        self, workers: Sequence[WorkerStates], specs: Mapping[str, Spec], *, version: int | None = None
    ) -> dict[str, float] | None:
        """Add one commit (every worker's states, in rank order); the emitted values when the window completes.
        ``version``: the spec table's, when ``specs`` is its mapping (a repeated layout is then known at once)."""
        if len(workers) == 1 and self._log_every == 1:
            return self._single(workers[0], specs, version)
        return self.commit_ranked(self.rank_level(workers, specs), specs)

    def commit_ranked(self, ranked: RankedStates, specs: Mapping[str, Spec]) -> dict[str, float] | None:
        """Add one commit's rank-level results (see :meth:`rank_level`); the emitted values when the window
        completes."""
        window = self._window
        if type(ranked) is RankedColumns and self._log_every == 1 and not window:  # emitted from the columns
            return ColumnStates(update=ranked.update, states_of=_one_column).emit(
                specs=specs,
                layouts=self._layouts,
                scalar=lambda name, merged: self._emit_ranked(name, merged, specs),
                version=ranked.version,
            )
        for name, merged in ranked.items():
            for plan in self._plan(name, specs[name])[1]:
                result = merged[plan.column]
                if result is None:
                    continue
                state = plan.at_step(result)
                seen = window.get(plan.key)
                window[plan.key] = (plan, state if seen is None else seen[1].merge(state))
        self._commits += 1
        if self._commits < self._log_every:
            return None
        return self.finish()

    def _emit_ranked(
        self, name: str, merged: tuple[Summary | None, ...], specs: Mapping[str, Spec]
    ) -> dict[str, float]:
        """``name``'s emitted values from its rank-level results ``merged`` alone (``log_every=1``)."""
        out: dict[str, float] = {}
        for plan in self._plan(name, specs[name])[1]:
            result = merged[plan.column]
            if result is not None:
                out[plan.key] = plan.emit(plan.at_step(result))
        return out

    def _single(self, states: WorkerStates, specs: Mapping[str, Spec], version: int | None) -> dict[str, float]:
        """``commit()`` for one worker and ``log_every=1``, the common case: no merge at the rank or step level."""
        if type(states) is ColumnStates:
            return states.emit(
                specs=specs,
                layouts=self._layouts,
                scalar=lambda name, held: self._emit_into({}, name, held, specs),
                version=version,
            )
        out: dict[str, float] = {}
        for name, by_key in states.items():
            self._emit_into(out, name, by_key, specs)
        return {key: out[key] for key in sorted(out)}

    def _emit_into(
        self, out: dict[str, float], name: str, by_key: tuple[Summary, ...], specs: Mapping[str, Spec]
    ) -> dict[str, float]:
        """Put ``name``'s emitted values (one worker, ``log_every=1``) into ``out``, and return it."""
        spec = specs[name]
        held = self._plans.get(name)
        for plan in held[1] if held is not None and held[0] is spec else self._plan(name, spec)[1]:
            state = by_key[plan.state]
            if plan.rank_lift is not None:
                state = lift(plan.rank_lift(state), sketched=plan.rank_sketch)
            if plan.step_lift is not None:
                state = lift(plan.step_lift(state), sketched=plan.step_sketch)
            out[plan.key] = plan.emit(state)
        return out

    def finish(self) -> dict[str, float]:
        """The step-level values of the window so far (sorted by name), and reset it."""
        window = self._window
        out = {key: window[key][0].emit(window[key][1]) for key in sorted(window)}
        self._window = {}
        self._commits = 0
        return out


def _one_column(summaries: Mapping[str, Summary]) -> dict[str, tuple[Summary, ...]]:
    """Rank-level results of metrics that have one column each: their merged Summaries."""
    return {name: (summary,) for name, summary in summaries.items()}
