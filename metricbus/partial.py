"""``Partial``: the picklable micro-level state of one worker's uncommitted records."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from metricbus.spec import Spec
from metricbus.summary import Summary


@dataclass(frozen=True, slots=True)
class Partial:
    """What one worker logged since its last commit: per metric, its resolved spec and micro-level Summary."""

    entries: tuple[tuple[str, Spec, Summary], ...] = ()

    def __iter__(self) -> Iterator[tuple[str, Spec, Summary]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def summaries(self) -> dict[str, Summary]:
        """``{name: Summary}``."""
        return {name: summary for name, _, summary in self.entries}

    def specs(self) -> dict[str, Spec]:
        """``{name: Spec}``."""
        return {name: spec for name, spec, _ in self.entries}
