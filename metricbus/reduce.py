"""The one reduction path: micro summaries -> rank level -> step window -> emitted floats.

Live logging, ``export``/``ingest``, torch.distributed and journal replay all call these functions, so they
cannot disagree. The continuation rule: where a level's kind equals the one below, the states merge; where it
changes, each group's result becomes one unit-weight record of the next level.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from metricbus.kinds import KINDS
from metricbus.spec import Chain, Spec
from metricbus.summary import Summary

Reduced = dict[str, tuple[Chain, Summary]]
# Lifting a group's result to the next level (``summary if below == level else Summary.of_value(kind(summary))``)
# is written inline in the two loops below: it runs once per metric per commit, and a call there costs measurably
# against the 200 µs commit budget (benchmarks/bench_log.py).


def output_name(name: str, chain: Chain) -> str:
    """``name`` for a single chain, ``name/<kind>`` for a list spec."""
    return f"{name}/{chain.suffix}" if chain.suffix else name


def reduce_ranks(specs: Mapping[str, Spec], ranks: Sequence[Mapping[str, Summary]]) -> Reduced:
    """Merge each metric's per-rank micro summaries in rank order; ranks without the metric do not count.

    One pass over the ranks in order, so a metric only one rank has (the common single-worker case) is lifted
    and never merged. Workers run side by side, so there is no "later" worker: ``first`` and ``last`` both take
    the lowest-ranked worker that has the metric (its first / last record).
    """
    out: Reduced = {}
    for rank in ranks:
        for name, summary in rank.items():
            if not summary.count:
                continue
            for chain in specs[name].chains:
                key = f"{name}/{chain.suffix}" if chain.suffix else name
                lifted = summary if chain.micro == chain.rank else Summary.of_value(KINDS[chain.micro](summary))
                held = out.get(key)
                if held is None:
                    out[key] = (chain, lifted)
                else:  # across workers, first *and* last come from the lowest-ranked worker that has the metric
                    out[key] = (chain, held[1].merge(lifted)._replace(last=held[1].last))
    return out


class Window:
    """The step level: merges the rank-level results of the last ``log_every`` commits."""

    __slots__ = ("_commits", "_log_every", "_states")

    def __init__(self, *, log_every: int) -> None:
        self._log_every = log_every
        self._commits = 0
        self._states: Reduced = {}

    @property
    def pending(self) -> int:
        """Commits in the window that have not been emitted yet."""
        return self._commits

    def add(self, reduced: Reduced) -> bool:
        """Add one commit's rank-level results; True when the window is complete."""
        states = self._states
        for key, (chain, summary) in reduced.items():
            lifted = summary if chain.rank == chain.step else Summary.of_value(KINDS[chain.rank](summary))
            held = states.get(key)
            states[key] = (chain, lifted if held is None else held[1].merge(lifted))
        self._commits += 1
        return self._commits >= self._log_every

    def emit(self) -> dict[str, float]:
        """The step-level values (sorted by name), and reset the window."""
        states = self._states
        out = {key: KINDS[states[key][0].step](states[key][1]) for key in sorted(states)}
        self._states = {}
        self._commits = 0
        return out
