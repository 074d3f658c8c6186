"""Writing: one rank's commits appended to its file, one ``os.write`` per commit.

A commit is one ``os.write`` of its frames (name table additions first), so when ``commit()`` returns its bytes
are in the operating system and survive SIGKILL. ``fsync`` decides what survives a power loss: ``"commit"``
(fsync every commit), ``"interval"`` (the default: fsync at most every ``FSYNC_INTERVAL_S`` seconds, and at close),
``"never"``.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

from metricbus.adapter import RunInfo
from metricbus.journal.cursors import CursorStore
from metricbus.journal.format import (
    FSYNC_INTERVAL_S,
    MAGIC,
    SUMMARY_FIELDS,
    check_fsync,
    commit_frame,
    entries_layout,
    frame,
    make_header,
    rank_file,
    spec_to_json,
)
from metricbus.partial import Partial
from metricbus.spec import Spec


class JournalWriter:
    """Appends one rank's commits to its file; ``delivered`` keeps the adapters' cursors."""

    def __init__(self, *, path: str | os.PathLike[str], fsync: str, rank: int, header: dict[str, Any]) -> None:
        self._fsync = check_fsync(fsync)
        self.directory = Path(path)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = rank_file(self.directory, rank)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._ids: dict[str, tuple[int, Spec]] = {}
        self._layouts: dict[int, struct.Struct] = {}  # one packing layout per entry count, built once
        self._next_id = 0
        self._last_sync = time.monotonic()
        self._cursors = CursorStore(self.directory)
        start = MAGIC if os.fstat(self._fd).st_size == 0 else b""
        self._write(start + frame(b"H", json.dumps(header).encode()))
        if self._fsync != "never":
            os.fsync(self._fd)

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def append(self, *, step: int, entries: list[tuple[int, Partial]]) -> None:
        """Write one commit (every entry of every partial, in order) in one ``os.write``, before commit() returns."""
        if self._fd is None:
            return
        ids = self._ids
        new: list[list[Any]] = []
        flat: list[float] = [step, 0]
        rests: list[tuple[int, tuple[float, ...]]] = []
        fields = SUMMARY_FIELDS
        n = 0
        for rank, partial in entries:
            for name, spec, summary in partial.entries:
                known = ids.get(name)
                if known is None or (known[1] is not spec and known[1] != spec):
                    known = (self._next_id, spec)
                    self._next_id += 1
                    ids[name] = known
                    new.append([known[0], name, spec_to_json(spec)])
                flat.append(rank)
                flat.append(known[0])
                flat.extend(fields(summary))
                if summary.rest:  # a field read: the common entry has none, and pays no call
                    rests.append((n, summary.rest_flat()))
                n += 1
        flat[1] = n
        layout = self._layouts.get(n)
        if layout is None:
            layout = self._layouts[n] = entries_layout(n)
        data = commit_frame(layout, flat, rests)
        if new:
            data = frame(b"N", json.dumps(new).encode()) + data
        self._write(data)
        if self._fsync == "commit":
            os.fsync(self._fd)
        elif self._fsync == "interval":
            now = time.monotonic()
            if now - self._last_sync >= FSYNC_INTERVAL_S:
                os.fsync(self._fd)
                self._last_sync = now

    def delivered(self, index: int, adapter: Any, step: int) -> None:
        """Advance ``adapter``'s cursor to ``step`` (called from its delivery thread after a successful write)."""
        self._cursors.advance(adapter, step)

    def close(self) -> None:
        """fsync (unless ``fsync="never"``) and close the file."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._fsync != "never":
                os.fsync(fd)
        finally:
            os.close(fd)


def open_journal(
    *,
    path: str | os.PathLike[str],
    fsync: str = "interval",
    rank: int,
    run: RunInfo,
    rules: list[tuple[str, Spec]],
    log_every: int,
) -> JournalWriter:
    """The journal writer of ``rank`` in directory ``path``; its run, rules and log_every go into the header."""
    check_fsync(fsync)
    header = make_header(rank=rank, run=run, rules=rules, log_every=log_every)
    return JournalWriter(path=path, fsync=fsync, rank=int(rank), header=header)
