"""Helpers for testing trainers that log through metricbus: an in-memory adapter and a capture helper."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from metricbus.adapter import RunInfo, Status


class MemoryAdapter:
    """Keeps every emitted step: ``rows`` is a list of ``(step, {name: float})`` in emission order."""

    name = "memory"

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.run: RunInfo | None = None
        self.status: Status | None = None
        self.flushes = 0

    def open(self, *, run: RunInfo) -> None:
        """Remember the run."""
        self.run = run

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Keep a copy of the step."""
        self.rows.append((step, dict(metrics)))

    def flush(self) -> None:
        """Count flushes."""
        self.flushes += 1

    def close(self, *, status: Status) -> None:
        """Remember the final status."""
        self.status = status

    def series(self, name: str) -> list[tuple[int, float]]:
        """``[(step, value)]`` of one metric."""
        return [(step, metrics[name]) for step, metrics in self.rows if name in metrics]

    def last(self) -> dict[str, float]:
        """The metrics of the last emitted step ({} if none)."""
        return self.rows[-1][1] if self.rows else {}


@contextmanager
def capture(**bus_options: Any) -> Iterator[tuple[Any, MemoryAdapter]]:
    """``with capture(rules=...) as (bus, mem):`` a strict local bus writing to a MemoryAdapter, closed at exit."""
    from metricbus.bus import MetricBus

    mem = MemoryAdapter()
    options = {"strict": True, "dist": None, **bus_options}
    options["adapters"] = [mem, *options.get("adapters", ())]
    with MetricBus(**options) as bus:
        yield bus, mem
