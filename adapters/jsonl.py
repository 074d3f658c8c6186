"""The JSON Lines adapter: one line per emitted step, readable back exactly with :func:`read_jsonl`.

Each line is ``{"step": 7, "time_unix_ns": 1700000000000000000, "metrics": {"loss": 0.25}}``. Finite floats use
Python's ``repr`` (shortest round-trip form), so they read back bit for bit. Non-finite values are written as the
JSON *strings* ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` — the file stays strict JSON that any parser
accepts — and :func:`read_jsonl` turns them back into floats. The spec form is ``"jsonl:out.jsonl"``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from metricbus.adapter import RunInfo, Status

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode(value: float) -> float | str:
    value = float(value)
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _decode(value: Any) -> float:
    if isinstance(value, str):
        return _NON_FINITE[value]
    return float(value)


def read_jsonl(path: str | os.PathLike[str]) -> list[tuple[int, dict[str, float]]]:
    """Read a file written by :class:`JsonlAdapter` back as ``[(step, {name: value}), ...]``."""
    points: list[tuple[int, dict[str, float]]] = []
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            record = json.loads(line)
            points.append((int(record["step"]), {k: _decode(v) for k, v in record["metrics"].items()}))
    return points


class JsonlAdapter:
    """Appends one JSON object per step to ``path`` (parent folders are created at open)."""

    name = "jsonl"

    def __init__(self, *, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._handle: IO[str] | None = None

    @property
    def path(self) -> Path:
        """The file written."""
        return self._path

    def open(self, *, run: RunInfo) -> None:
        """Create (or append to) the file."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self._path.open("a", encoding="utf-8")

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Write one line for ``step``."""
        if self._handle is None:
            raise RuntimeError("JsonlAdapter.write() before open()")
        record = {
            "step": int(step),
            "time_unix_ns": time.time_ns(),
            "metrics": {key: _encode(value) for key, value in metrics.items()},
        }
        self._handle.write(json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        """Flush the file to the operating system."""
        if self._handle is not None:
            self._handle.flush()

    def close(self, *, status: Status) -> None:
        """Close the file."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
