"""The console adapter: one compact, aligned line per emitted step on stdout.

Options are checked at construction (:class:`~metricbus.errors.ConfigError` naming the option and what is valid):
``stream`` is a text stream or None (stdout at write time), ``max_metrics`` an int >= 1.

A stream whose reader is gone (``python train.py | head``: a broken pipe; or a closed file) is reported once, as a
warning on the ``metricbus.adapters.console`` logger, and the adapter prints nothing more to that stream (another
stream put in ``sys.stdout`` later is printed to). Retrying the line would only hold ``close()`` up: no one can
read it, and the journal and the other adapters keep every step. After a broken pipe the lines still in the stream's
buffer are dropped (they would otherwise fail again at interpreter exit, ``Exception ignored ... BrokenPipeError``,
and turn the trainer's exit code into 120): the stream is flushed into ``/dev/null``, its file descriptor pointed
there for that one flush and then back at the pipe. The process's stdout stays the trainer's: its own prints to the
gone reader raise BrokenPipeError as they would without metricbus. Pointing stdout at ``/dev/null`` for good, as
Python's documentation on SIGPIPE advises, is the program's call at its entry point (``metricbus show | head`` does
it), not an adapter's: it would silence every later print of the trainer. (Another thread of the process writing to
that descriptor during the flush writes into ``/dev/null``: no one could read it either.)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import TextIO

from metricbus.adapter import RunInfo, Status
from metricbus.errors import ConfigError
from metricbus.histogram import Histogram

_VALUE_WIDTH = 10
logger = logging.getLogger(__name__)


def _reader_gone(exc: BaseException, stream: object) -> bool:
    """Whether ``exc`` says that no one reads ``stream`` any more: a broken pipe, or a closed stream."""
    if isinstance(exc, OSError):
        return exc.errno == errno.EPIPE
    return isinstance(exc, ValueError) and bool(getattr(stream, "closed", False))


def format_value(value: float) -> str:
    """Compact fixed-width rendering of a float; a Histogram as ``hist(n=1000, p50=1.2, p90=3.4, p99=7)``.

    Whole numbers print as ints, -0.0 as ``-0`` (its sign is the metric's, as every other adapter keeps it)."""
    if isinstance(value, Histogram):
        return format_histogram(value)
    if not math.isfinite(value):
        return f"{value!s:>10}"
    if value == int(value) and abs(value) < 1e10:
        return f"{'-0' if math.copysign(1.0, value) < 0 and not value else int(value):>10}"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:>10.4f}"
    return f"{value:>10.3e}"


def format_histogram(value: Histogram) -> str:
    """``hist(n=<records>, p50=..., ...)``: the record count and the quantiles, four significant digits."""
    cells = [f"n={float(value):g}", *(f"{name}={q:.4g}" for name, q in value.quantiles)]
    return f"hist({', '.join(cells)})"


def _drop_buffered(stream: object) -> None:
    """Drop what ``stream`` still buffers for a pipe whose reader left: flush it into ``/dev/null``, its file
    descriptor pointed there for that flush alone, then back at the pipe (the process's own, left as it was)."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # not a real file: nothing fails at exit
        return
    inheritable = os.get_inheritable(fd)
    saved, devnull = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd, inheritable=inheritable)
        with contextlib.suppress(OSError, ValueError):  # what it holds is lost either way
            stream.flush()  # type: ignore[attr-defined]
    finally:
        os.dup2(saved, fd, inheritable=inheritable)
        os.close(saved)
        os.close(devnull)


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
        self._gone: object = None  # the stream whose reader went away: nothing more is printed to it

    @property
    def stream(self) -> TextIO:
        """Where lines go (stdout at write time unless a stream was given)."""
        return self._stream if self._stream is not None else sys.stdout

    def open(self, *, run: RunInfo) -> None:
        """Print the run's name."""
        self._print(f"metricbus run {run.name or run.project}")

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
        self._print(f"step {step:>6} | " + " | ".join(cells) + tail, step=step)

    def flush(self) -> None:
        """Flush the stream."""
        self._print(None)

    def close(self, *, status: Status) -> None:
        """Print the final status."""
        self._print(f"metricbus run {status}")
        self.flush()

    def _print(self, line: str | None, *, step: int | None = None) -> None:
        """Print ``line`` (None: flush), unless the stream's reader is gone (see the module docstring)."""
        stream = self.stream
        if stream is self._gone:
            return
        try:
            if line is None:
                stream.flush()
            else:
                print(line, file=stream)
        except (OSError, ValueError) as exc:
            if not _reader_gone(exc, stream):
                raise
            self._gone = stream
            if isinstance(exc, OSError):
                _drop_buffered(stream)
            logger.warning("console: no one reads %s any more (%r)%s; the console adapter prints nothing more to it "
                           "(the journal and the other adapters keep every step)", getattr(stream, "name", stream),
                           exc, "" if step is None else f" at step {step}")
