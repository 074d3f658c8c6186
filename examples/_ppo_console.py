"""A console view for the demo: a few metrics, every N-th row, so the terminal shows a glance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from metricbus import Adapter, RunInfo
from metricbus.adapter import Status

CONSOLE_METRICS = ("actor/entropy", "actor/pg_clipfrac", "actor/pg_loss")


class ConsoleView:
    """An adapter around the console adapter: a few metrics, every ``every``-th emitted row and the last one.

    The demo emits a row per step with ~20 metrics; the other backends get all of it, the terminal a glance.
    """

    name = "console"

    def __init__(self, inner: Adapter, *, every: int, metrics: Sequence[str]) -> None:
        self._inner = inner
        self._every = every
        self._metrics = tuple(metrics)
        self._rows = 0
        self._held: tuple[int, dict[str, float]] | None = None  # the last row, when it was not printed

    def open(self, *, run: RunInfo) -> None:
        """Open the console."""
        self._inner.open(run=run)

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Print every ``every``-th row; hold the others until the next one arrives (or close)."""
        row = {name: metrics[name] for name in self._metrics if name in metrics}
        if self._rows % self._every == 0:
            self._inner.write(step=step, metrics=row)
            self._held = None
        else:
            self._held = (step, row)
        self._rows += 1

    def flush(self) -> None:
        """Flush the console."""
        self._inner.flush()

    def close(self, *, status: Status) -> None:
        """Print the last row if it was held, then close the console."""
        if self._held is not None:
            self._inner.write(step=self._held[0], metrics=self._held[1])
        self._inner.close(status=status)


def with_console_view(config: Mapping[str, Any], *, every: int) -> dict[str, Any]:
    """``config`` with its console adapter wrapped in a :class:`ConsoleView` ($METRICBUS_ADAPTERS still wins)."""
    from metricbus.registry import make_adapter

    adapters = []
    for entry in config.get("adapters") or []:
        kind = entry.get("type") if isinstance(entry, Mapping) else str(entry).partition(":")[0]
        view = kind == "console" and every > 1
        adapters.append(ConsoleView(make_adapter(entry), every=every, metrics=CONSOLE_METRICS) if view else entry)
    return {**config, "adapters": adapters}
