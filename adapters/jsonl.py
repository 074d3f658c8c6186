"""The JSON Lines adapter: one line per write, readable back exactly with :func:`read_jsonl`.

Each line is ``{"step": 7, "time_unix_ns": 1700000000000000000, "metrics": {"loss": 0.25}}``. Finite floats use
Python's ``repr`` (shortest round-trip form), so they read back bit for bit. Non-finite values are written as the
JSON *strings* ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` — the file stays strict JSON that any parser
accepts — and :func:`read_jsonl` turns them back into floats. Two lines may share a step (training, then
evaluation, at one step, with disjoint names); :func:`read_jsonl` returns both, in file order.

Histograms. A :class:`~metricbus.histogram.Histogram` (the ``hist`` kind) is written as the object
``{"count": 1000.0, "edges": [...], "counts": [...], "quantiles": {"p50": ..., "p90": ..., "p99": ...}}`` instead of
a float (its floats encoded as above, its counts ints); :func:`read_jsonl` turns it back into the same
``Histogram`` (an object with only ``edges`` and ``counts`` reads back with ``count = sum(counts)`` and no quantiles).

Where. The spec ``"jsonl:out.jsonl"`` (or ``path=``) names the file. Without a path (the spec ``"jsonl"``) the file
is ``runs/<project>/<run id>/metrics.jsonl`` under the working directory, decided at ``open()`` from the
:class:`~metricbus.adapter.RunInfo`: one file per run, never shared between runs, and the same file for every
process writing that run (a resumed trainer, ``metricbus sync``). ``identity`` is ``{"path": <absolute path>}``.

Durability. Each ``write()`` hands its whole line to the operating system before it returns (a killed process
loses nothing it wrote), or, when that fails (a full disk), cuts what part of it was written and raises, so the
retry writes the line once; ``flush()`` also ``fsync``s the file, so a step is durable once ``flush()`` returned —
that is when the bus and ``metricbus sync`` acknowledge it to the delivery cursor. ``close()`` fsyncs too (the bus
counts every written step as delivered once ``close()`` returned). Once an ``fsync`` failed, every later ``flush()``
and ``close()`` of that open file raises as well: the kernel reports a failed write-back once and may have dropped
those lines, so a later fsync that succeeds proves nothing about them. The cursor then stays before every step
written since the last fsync that succeeded, and ``metricbus sync`` cuts the file there and sends those steps again.

Resuming (the optional ``resume`` verb of the adapter protocol). ``resume(after_step=N, identity=...)`` says that
the cursor acknowledged steps up to ``N`` (``None``: none). Lines after the last line of a step ``<= N`` were
written but never acknowledged, and the caller is about to send those steps again, so ``resume`` truncates the
file to end right after that line (``None``: to empty). Without a path of its own the adapter writes where
``identity`` says the run's file is (when the per-run file is only known at ``open()``, the cut waits for it).
Without ``resume`` the file is appended to. Either way a torn last line (no newline: the process died mid-write) is
cut off at ``open()`` so the next line does not glue onto it.

Rewinding (the optional ``rewind`` verb). ``rewind(step=S)``: the run went back to a checkpoint and every step
``>= S`` is about to be sent again, so the file is cut right after the last complete line of a step ``< S`` and
later writes append after it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from metricbus.adapter import RunInfo, Status, append_whole, is_live_target, run_folder
from metricbus.errors import ConfigError
from metricbus.histogram import Histogram

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_BLOCK = 1 << 16


def _encode_float(value: float) -> float | str:
    value = float(value)
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _encode(value: float) -> float | str | dict[str, Any]:
    if isinstance(value, Histogram):
        return {
            "count": _encode_float(value),
            "edges": [_encode_float(edge) for edge in value.edges],
            "counts": [int(count) for count in value.counts],
            "quantiles": {name: _encode_float(q) for name, q in value.quantiles},
        }
    return _encode_float(value)


def _decode_float(value: Any) -> float:
    if isinstance(value, str):
        return _NON_FINITE[value]
    return float(value)


def _decode(value: Any) -> float:
    if isinstance(value, dict):
        counts = tuple(int(count) for count in value["counts"])
        return Histogram(
            _decode_float(value.get("count", sum(counts))),
            edges=tuple(_decode_float(edge) for edge in value["edges"]),
            counts=counts,
            quantiles=tuple((name, _decode_float(q)) for name, q in value.get("quantiles", {}).items()),
        )
    return _decode_float(value)


def read_jsonl(path: str | os.PathLike[str]) -> list[tuple[int, dict[str, float]]]:
    """Read a file written by :class:`JsonlAdapter` back as ``[(step, {name: value}), ...]``.

    A torn last line (no newline, not valid JSON: its writer died mid-line) is skipped.
    """
    points: list[tuple[int, dict[str, float]]] = []
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                if line.endswith("\n"):
                    raise
                break  # the torn last line
            points.append((int(record["step"]), {k: _decode(v) for k, v in record["metrics"].items()}))
    return points


def _lines_backwards(handle: IO[bytes]) -> Iterator[tuple[int, bytes, bool]]:
    """``(offset, line, complete)`` from the last line to the first; only the last may be incomplete (torn)."""
    end = handle.seek(0, os.SEEK_END)
    pos, buf, first = end, b"", True
    while True:
        read = min(_BLOCK, pos)
        pos -= read
        handle.seek(pos)
        buf = handle.read(read) + buf
        parts = buf.split(b"\n")
        tail_end = pos + len(buf)
        for part in reversed(parts[1:] if pos else parts):
            start = tail_end - len(part)
            yield start, part, not first
            first = False
            tail_end = start - 1
        if not pos:
            return
        buf = parts[0]


def _step_of(line: bytes) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def acknowledged_length(path: Path, after_step: int | None, *, keep_all: bool = False) -> int:
    """Bytes of ``path`` through the last complete line of a step ``<= after_step`` (``keep_all``: of any step)."""
    if not keep_all and after_step is None:
        return 0
    with path.open("rb") as handle:
        for offset, line, complete in _lines_backwards(handle):
            if not complete or not line.strip():
                continue
            step = _step_of(line)
            if keep_all or (step is not None and after_step is not None and step <= after_step):
                return offset + len(line) + 1
    return 0


def _lines_in(path: Path) -> int:
    """How many complete lines the regular file ``path`` holds (0: none, no such file, or not a regular file: reading
    a pipe, FIFO or terminal such as ``/dev/stdout`` would wait for input that never comes)."""
    if not path.is_file():
        return 0
    try:
        with path.open("rb") as handle:
            return sum(block.count(b"\n") for block in iter(lambda: handle.read(_BLOCK), b""))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return 0


def _checked_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path; ConfigError when it is empty or an existing directory."""
    text = os.fspath(path)
    if not text.strip():
        raise ConfigError(
            "jsonl: the path is empty; give a file ('jsonl:out.jsonl', path='out.jsonl') or no path at all ('jsonl') "
            "for runs/<project>/<run id>/metrics.jsonl"
        )
    if os.path.isdir(text):
        example = Path(text) / "metrics.jsonl"
        raise ConfigError(f"jsonl: the path {text!r} is a directory; give a file in it, e.g. '{example}'")
    return Path(text)


class JsonlAdapter:
    """Appends one JSON object per write to ``path`` (None: ``runs/<project>/<run id>/metrics.jsonl``).

    Parent folders are created at open.
    """

    name = "jsonl"

    def __init__(self, *, path: str | os.PathLike[str] | None = None) -> None:
        self._path = None if path is None else _checked_path(path)
        # Fixed here, whether or not the path is known yet, so the delivery cursor is the same before and after
        # open() (the same key adapter_key() gave when the path was always set: the absolute path).
        self.cursor_key = "path=None" if self._path is None else f"path={os.path.abspath(self._path)!r}"
        self._pending_cut: tuple[int | None] | None = None  # a resume() waiting for the per-run path
        self._handle: IO[bytes] | None = None
        self._fsync_error: OSError | None = None  # an fsync of the open file failed: later lines are not durable

    @property
    def path(self) -> Path | None:
        """The file written: as given, or the per-run file once ``open()`` (or ``resume`` identity) decided it."""
        return self._path

    @property
    def identity(self) -> Mapping[str, str]:
        """``{"path": <absolute path>}`` once the file is known (empty before)."""
        return {} if self._path is None else {"path": os.path.abspath(self._path)}

    def resume(self, *, after_step: int | None, identity: Mapping[str, str] | None = None) -> None:
        """Cut the lines after the last acknowledged step ``after_step`` (None: every line); see the module doc."""
        if self._path is None and identity and identity.get("path"):
            self._path = Path(identity["path"])
        if self._path is None:
            self._pending_cut = (after_step,)
            return
        self._cut(after_step, keep_all=False)

    def new_run(self, *, live: Sequence[Mapping[str, str]]) -> None:
        """Before a replay's open: refuse a path that is the live run's file (``live``: its jsonl identities)."""
        if self._path is None:  # the replay's own per-run file
            return
        if is_live_target(self._path, live=live, key="path"):
            raise ConfigError(
                f"jsonl: {str(self._path)!r} is the live run's file (the journal's delivery cursor names it), and a "
                "replay opens a run of its own: it never adds to the live file, where each step would then be "
                "twice; give another path (jsonl:OTHER.jsonl) or none (jsonl: runs/<project>/<replay run "
                "id>/metrics.jsonl); metricbus sync is what writes into the live run"
            )
        lines = _lines_in(self._path)
        if lines:
            raise ConfigError(
                f"jsonl: {str(self._path)!r} already holds {lines} line(s) (an earlier replay's, or another run's), "
                "and a replay opens a run of its own: it never appends to them, where a step replayed twice would "
                "then be twice; give a new path (jsonl:OTHER.jsonl), none (jsonl: runs/<project>/<replay run "
                "id>/metrics.jsonl), or remove the file first to replay into it again"
            )

    def open(self, *, run: RunInfo) -> None:
        """Create (or append to) the file, dropping a torn last line (and what a pending resume cuts)."""
        if self._path is None:
            self._path = Path(run_folder(run), "metrics.jsonl")
        if self._path.is_dir():
            raise IsADirectoryError(f"jsonl: {str(self._path)!r} is a directory; the adapter writes a file")
        if self._pending_cut is not None:
            self._cut(self._pending_cut[0], keep_all=False)
            self._pending_cut = None
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._cut(None, keep_all=True)
        self._handle = self._path.open("ab", buffering=0)
        self._fsync_error = None

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Write one line for ``step``, handed to the operating system before returning."""
        if self._handle is None:
            raise RuntimeError("JsonlAdapter.write() before open()")
        record = {
            "step": int(step),
            "time_unix_ns": time.time_ns(),
            "metrics": {key: _encode(value) for key, value in metrics.items()},
        }
        line = (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")
        fd = self._handle.fileno()
        # unbuffered: a failed write (disk full) leaves nothing behind to be written again with the retry
        append_whole(fd, line, start=os.fstat(fd).st_size, nothing=lambda: OSError(
            errno.ENOSPC, f"jsonl: no byte of step {step}'s line went to {self._path}"
        ))

    def rewind(self, *, step: int) -> None:
        """Cut the file right after the last complete line of a step ``< step``; later writes append there."""
        if self._handle is None:
            raise RuntimeError("JsonlAdapter.rewind() before open()")
        self._cut(int(step) - 1, keep_all=False)

    def flush(self) -> None:
        """Make every written line durable (``fsync``); raise where that is not known (an earlier fsync failed)."""
        if self._handle is not None:
            self._fsync(self._handle)

    def close(self, *, status: Status) -> None:
        """Make every written line durable, as ``flush()`` does, then close the file (even where that raised)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                self._fsync(handle)
            finally:
                handle.close()

    def _fsync(self, handle: IO[bytes]) -> None:
        if self._fsync_error is not None:
            raise OSError(
                self._fsync_error.errno or errno.EIO,
                f"jsonl: an earlier fsync of {str(self._path)!r} failed ({self._fsync_error}), so the lines written "
                "since the last one that succeeded are not known to be on disk; their steps stay unacknowledged and "
                "`metricbus sync` sends them again",
            )
        handle.flush()
        try:
            os.fsync(handle.fileno())
        except OSError as exc:
            self._fsync_error = exc
            raise

    def _cut(self, after_step: int | None, *, keep_all: bool) -> None:
        if self._path is None:
            return
        if self._handle is not None:
            self._handle.flush()
        try:
            size = self._path.stat().st_size
        except FileNotFoundError:
            return
        keep = acknowledged_length(self._path, after_step, keep_all=keep_all)
        if keep < size:
            os.truncate(self._path, keep)
