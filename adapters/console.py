"""The console adapter: one compact, aligned line per emitted step on stdout.

Options are checked at construction (:class:`~metricbus.errors.ConfigError` naming the option and what is valid):
``stream`` is a text stream or None (stdout at write time), ``max_metrics`` an int >= 1.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TextIO

from metricbus.adapter import RunInfo, Status
from metricbus.errors import ConfigError
from metricbus.histogram import Histogram

_VALUE_WIDTH = 10


def format_value(value: float) -> str:
    """Compact fixed-width rendering of a float; a Histogram as ``hist(n=1000, p50=1.2, p90=3.4, p99=7)``."""
    if isinstance(value, Histogram):
        return format_histogram(value)
    if not math.isfinite(value):
        return f"{value!s:>10}"
    if value == int(value) and abs(value) < 1e10:
        return f"{int(value):>10d}"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:>10.4f}"
    return f"{value:>10.3e}"


def format_histogram(value: Histogram) -> str:
    """``hist(n=<records>, p50=..., ...)``: the record count and the quantiles, four significant digits."""
    cells = [f"n={float(value):g}", *(f"{name}={q:.4g}" for name, q in value.quantiles)]
    return f"hist({', '.join(cells)})"


class ConsoleAdapter:
    """Prints ``step N | name value | ...``; columns keep their width from line to line."""

    name = "console"

    def __init__(self, *, stream: TextIO | None = None, max_metrics: int = 12) -> None:
        if stream is not None and not callable(getattr(stream, "write", None)):
            hint = " ('console:VALUE' sets the stream; set max_metrics with {type: console, max_metrics: N})"
            raise ConfigError(
                f"console: stream must be a text stream with write(), or None for stdout; got {stream!r}"
                + (hint if isinstance(stream, str) else "")
            )
        if isinstance(max_metrics, bool) or not isinstance(max_metrics, int) or max_metrics < 1:
            raise ConfigError(f"console: max_metrics must be an int >= 1 (metrics shown per line), got {max_metrics!r}")
        self._stream = stream
        self._max = max_metrics
        self._widths: dict[str, int] = {}

    @property
    def stream(self) -> TextIO:
        """Where lines go (stdout at write time unless a stream was given)."""
        return self._stream if self._stream is not None else sys.stdout

    def open(self, *, run: RunInfo) -> None:
        """Print the run's name."""
        print(f"metricbus run {run.name or run.project}", file=self.stream)

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Print one aligned line."""
        cells = []
        for key in list(metrics)[: self._max]:
            cell = f"{key} {format_value(metrics[key]).strip()}"
            # Reserve format_value's fixed width from the first line on, so a column does not shift right when a
            # wider value comes along later.
            width = self._widths[key] = max(self._widths.get(key, len(key) + 1 + _VALUE_WIDTH), len(cell))
            cells.append(cell.ljust(width))
        more = len(metrics) - self._max
        tail = f" | (+{more} more)" if more > 0 else ""
        print(f"step {step:>6} | " + " | ".join(cells) + tail, file=self.stream)

    def flush(self) -> None:
        """Flush the stream."""
        self.stream.flush()

    def close(self, *, status: Status) -> None:
        """Print the final status."""
        print(f"metricbus run {status}", file=self.stream)
        self.flush()
