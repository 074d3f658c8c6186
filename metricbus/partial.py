"""``Partial``: the picklable micro-level state of one worker's uncommitted records."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from metricbus.spec import Spec
from metricbus.summary import Summary


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

    def updates(self) -> dict[str, list[Summary]]:
        """``{name: [Summary of each update, in order]}``."""
        out: dict[str, list[Summary]] = {}
        for name, _, summary in self.entries:
            held = out.get(name)
            if held is None:
                out[name] = [summary]
            else:
                held.append(summary)
        return out
