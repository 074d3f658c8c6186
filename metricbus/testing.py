"""Helpers for testing trainers that log through metricbus: an in-memory adapter and a capture helper."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from metricbus.adapter import RunInfo, Status


class MemoryAdapter:
    """Keeps every emitted step: ``rows`` is a list of ``(step, {name: float})`` in emission order.

    Rows arrive from the bus's delivery thread; after ``bus.flush()`` returned True (or ``bus.close()``) they hold
    every committed step.
    """

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


class FlakyAdapter(MemoryAdapter):
    """A backend that fails its first ``outage`` write calls (ConnectionError), then keeps every step.

    For testing how a trainer's bus rides out a backend outage; ``recovered_at`` is the ``time.perf_counter()``
    of the first successful write.
    """

    name = "flaky"

    def __init__(self, outage: int) -> None:
        super().__init__()
        self.outage = outage
        self.calls = 0
        self.recovered_at: float | None = None

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Fail during the outage, then keep the step."""
        self.calls += 1
        if self.calls <= self.outage:
            raise ConnectionError(f"outage, call {self.calls}")
        if self.recovered_at is None:
            self.recovered_at = time.perf_counter()
        super().write(step=step, metrics=metrics)


@contextmanager
def capture(**bus_options: Any) -> Iterator[tuple[Any, MemoryAdapter]]:
    """``with capture(rules=...) as (bus, mem):`` a strict local bus writing to a MemoryAdapter, closed at exit."""
    from metricbus.bus import MetricBus

    mem = MemoryAdapter()
    options = {"strict": True, "dist": None, **bus_options}
    options["adapters"] = [mem, *options.get("adapters", ())]
    with MetricBus(**options) as bus:
        yield bus, mem
