"""Delivery cursors: per adapter, the last step its backend acknowledged, kept beside the journal's files.

A cursor never runs ahead of the data: it is advanced only after the adapter's ``flush()`` returned. It may lag
behind (a crash between the flush and the advance); an adapter that implements the optional
``resume(after_step=int | None)`` verb is told the cursor before it is opened (:func:`resume_adapter`) and drops
what it holds after that step, so the steps sent again are not duplicated.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any


def adapter_key(adapter: Any) -> str:
    """A file-name-safe key naming ``adapter`` by its name and options, so two adapters never share a cursor.

    An adapter may set ``cursor_key`` itself; otherwise the key is its name plus a hash of the values of its
    constructor options (paths made absolute), read back from same-named attributes (or ``_``-prefixed ones).
    """
    explicit = getattr(adapter, "cursor_key", None)
    name = str(getattr(adapter, "name", type(adapter).__name__))
    if isinstance(explicit, str) and explicit:
        ident = explicit
    else:
        from metricbus.registry import adapter_options

        try:
            options = adapter_options(type(adapter))
        except (TypeError, ValueError):
            options = []
        parts = []
        for option in options:
            value = getattr(adapter, option, getattr(adapter, f"_{option}", None))
            if isinstance(value, os.PathLike):
                value = os.path.abspath(os.fspath(value))
            parts.append(f"{option}={value!r}")
        ident = ";".join(parts)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]
    return f"{safe}-{zlib.crc32(ident.encode()):08x}"


def resume_adapter(adapter: Any, after_step: int | None) -> None:
    """Call ``adapter.resume(after_step=...)`` if the adapter has that optional verb (before its ``open()``)."""
    resume = getattr(adapter, "resume", None)
    if callable(resume):
        resume(after_step=after_step)


class CursorStore:
    """Per adapter, the last step its backend acknowledged, in ``<journal>/cursors/<key>.json``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory) / "cursors"
        self._last: dict[str, int] = {}

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, adapter: Any) -> int | None:
        """The last acknowledged step of ``adapter`` (None: nothing yet)."""
        try:
            data = json.loads(self._path(adapter_key(adapter)).read_text(encoding="utf-8"))
            return int(data["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def resume(self, adapter: Any) -> int | None:
        """Tell ``adapter`` its cursor (see :func:`resume_adapter`) before it is opened; returns the cursor."""
        cursor = self.get(adapter)
        resume_adapter(adapter, cursor)
        return cursor

    def advance(self, adapter: Any, step: int) -> None:
        """Record ``step`` as acknowledged (atomically: tmp file + rename); never moves backwards."""
        key = adapter_key(adapter)
        last = self._last.get(key)
        if last is None:
            last = self.get(adapter)
        if last is not None and step <= last:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self._path(key)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        name = str(getattr(adapter, "name", type(adapter).__name__))
        tmp.write_text(json.dumps({"adapter": name, "key": key, "step": int(step)}), encoding="utf-8")
        os.replace(tmp, target)
        self._last[key] = int(step)

    def _gaps_path(self, adapter: Any) -> Path:
        return self.directory / f"{adapter_key(adapter)}.gaps.jsonl"

    def add_gap(self, adapter: Any, step: int, reason: str) -> None:
        """Record that ``adapter``'s backend rejected ``step`` for good (so a later sync retries it after a fix)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": int(step), "reason": reason[:500]}) + "\n"
        with open(self._gaps_path(adapter), "a", encoding="utf-8") as file:
            file.write(line)

    def gaps(self, adapter: Any) -> set[int]:
        """The steps ``adapter``'s backend rejected and no sync has delivered since."""
        try:
            text = self._gaps_path(adapter).read_text(encoding="utf-8")
        except OSError:
            return set()
        steps = set()
        for line in text.splitlines():
            try:
                steps.add(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line
        return steps

    def clear_gaps(self, adapter: Any, steps: set[int]) -> None:
        """Forget the gaps at ``steps`` (a sync delivered them); atomically, like the cursor."""
        left = self.gaps(adapter) - steps
        path = self._gaps_path(adapter)
        if not left:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        lines = "".join(json.dumps({"step": s, "reason": "retry"}) + "\n" for s in sorted(left))
        tmp.write_text(lines, encoding="utf-8")
        os.replace(tmp, path)
