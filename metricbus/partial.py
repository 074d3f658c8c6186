"""``Partial``: the picklable micro-level state of one worker's uncommitted records."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from metricbus.spec import Spec
from metricbus.summary import Summary

Updates = list[dict[str, Summary]]  # per optimizer update, in order: metric -> micro-level Summary


@dataclass(frozen=True, slots=True)
class Partial:
    """What one worker logged since its last commit: per metric and optimizer update, its spec and Summary.

    ``entries`` are ``(name, spec, summary)`` in update order: a name appears once per update in which it was
    logged (once when no update boundary was marked). ``undeclared`` names the metrics whose spec is only the
    worker's default (no ``agg=``, no rule): the receiving bus's own rules or another worker's declaration win.
    """

    entries: tuple[tuple[str, Spec, Summary], ...] = ()
    undeclared: frozenset[str] = field(default_factory=frozenset)

    def __iter__(self) -> Iterator[tuple[str, Spec, Summary]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def updates(self) -> Updates:
        """The entries as updates: a new update starts where a name repeats (each name's order is kept, which is
        all the reduction reads)."""
        out: Updates = [{}]
        for name, _, summary in self.entries:
            if name in out[-1]:
                out.append({})
            out[-1][name] = summary
        return out if out[0] else []
