"""The one reduction path: micro summaries -> update level -> rank level -> step window -> emitted floats.

Live logging (single process, ``export``/``ingest``, torch.distributed) and journal replay all drive one
:class:`StepReducer`, so they cannot disagree. The continuation rule, the same at every level: where a level's
kind equals the one below, the states merge; where it changes, each group's result becomes one unit-weight record
of the next level.

* **worker** (:func:`worker_states`): a worker's per-update micro summaries of a metric become its update-level
  states, one per distinct ``state key``: ``""`` (the updates' summaries merged: every chain whose update kind
  equals its micro kind) or a micro kind (each update's result lifted to one record, then merged).
* **rank** (:meth:`StepReducer.commit`): each chain merges the workers' update-level states, lifted by the update
  kind where it differs from the rank kind, in rank order; a worker without the metric does not count.
* **step**: the rank-level results of the last ``log_every`` commits merge (lifted where the step kind differs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from metricbus.kinds import KINDS
from metricbus.spec import Spec
from metricbus.summary import Summary

WorkerStates = dict[str, dict[str, Summary]]  # metric -> state key -> update-level state
_of_value = Summary.of_value


@dataclass(frozen=True, slots=True)
class Plan:
    """One chain of a spec, decided once per name: what to read and where to lift."""

    key: str  # the emitted name
    state: str  # the worker-level state it reads ("" or the micro kind)
    rank_lift: Callable[[Summary], float] | None  # the update kind, where the rank kind differs
    step_lift: Callable[[Summary], float] | None  # the rank kind, where the step kind differs
    emit: Callable[[Summary], float]  # the step kind


def plans_of(name: str, spec: Spec) -> tuple[Plan, ...]:
    """The plans of ``name``'s chains."""
    return tuple(
        Plan(
            key=f"{name}/{c.suffix}" if c.suffix else name,
            state="" if c.micro == c.update else c.micro,
            rank_lift=None if c.update == c.rank else KINDS[c.update],
            step_lift=None if c.rank == c.step else KINDS[c.rank],
            emit=KINDS[c.step],
        )
        for c in spec.chains
    )


def state_keys(spec: Spec) -> list[str]:
    """The worker-level state keys ``spec`` needs, in a fixed order."""
    return sorted({"" if c.micro == c.update else c.micro for c in spec.chains})


def worker_state(keys: Iterable[str], updates: Sequence[Summary]) -> dict[str, Summary]:
    """One worker's update-level states of one metric from its per-update micro summaries (in update order)."""
    out: dict[str, Summary] = {}
    for key in keys:
        if key == "":
            state = updates[0]
            for part in updates[1:]:
                state = state.merge(part)
        else:
            kind = KINDS[key]
            state = _of_value(kind(updates[0]))
            for part in updates[1:]:
                state = state.merge(_of_value(kind(part)))
        out[key] = state
    return out


class StepReducer:
    """The rank and step levels of one run: ``commit()`` per commit, ``finish()`` for the last partial window."""

    __slots__ = ("_commits", "_log_every", "_plans", "_window")

    def __init__(self, *, log_every: int) -> None:
        self._log_every = log_every
        self._commits = 0
        self._window: dict[str, tuple[Plan, Summary]] = {}
        self._plans: dict[str, tuple[Spec, tuple[Plan, ...], tuple[str, ...]]] = {}

    @property
    def pending(self) -> int:
        """Commits in the window that have not been emitted yet."""
        return self._commits

    def _plan(self, name: str, spec: Spec) -> tuple[Spec, tuple[Plan, ...], tuple[str, ...]]:
        held = self._plans.get(name)
        if held is None or (held[0] is not spec and held[0] != spec):
            held = self._plans[name] = (spec, plans_of(name, spec), tuple(state_keys(spec)))
        return held

    def worker(self, updates: Mapping[str, Sequence[Summary]], specs: Mapping[str, Spec]) -> WorkerStates:
        """A worker's update-level states of every metric it logged (``updates``: per name, per-update summaries,
        in update order; see :func:`worker_state`)."""
        out: WorkerStates = {}
        for name, parts in updates.items():
            if len(parts) != 1 or not parts[0].count:
                parts = [p for p in parts if p.count]
                if not parts:
                    continue
            keys = self._plan(name, specs[name])[2]
            if len(parts) == 1 and keys == ("",):
                out[name] = {"": parts[0]}  # the common case: one update, no lift
            else:
                out[name] = worker_state(keys, parts)
        return out

    def commit(self, workers: Sequence[WorkerStates], specs: Mapping[str, Spec]) -> dict[str, float] | None:
        """Add one commit (every worker's states, in rank order); the emitted values when the window completes."""
        ranked: dict[str, tuple[Plan, Summary]] = {}
        for states in workers:
            for name, by_key in states.items():
                for plan in self._plan(name, specs[name])[1]:
                    state = by_key[plan.state]
                    if plan.rank_lift is not None:
                        state = _of_value(plan.rank_lift(state))
                    held = ranked.get(plan.key)
                    if held is None:
                        ranked[plan.key] = (plan, state)
                    else:  # across workers, first *and* last come from the lowest-ranked worker that has it
                        ranked[plan.key] = (plan, held[1].merge(state)._replace(last=held[1].last))
        window = self._window
        for key, (plan, state) in ranked.items():
            if plan.step_lift is not None:
                state = _of_value(plan.step_lift(state))
            held = window.get(key)
            window[key] = (plan, state if held is None else held[1].merge(state))
        self._commits += 1
        if self._commits < self._log_every:
            return None
        return self.finish()

    def finish(self) -> dict[str, float]:
        """The step-level values of the window so far (sorted by name), and reset it."""
        window = self._window
        out = {key: window[key][0].emit(window[key][1]) for key in sorted(window)}
        self._window = {}
        self._commits = 0
        return out
