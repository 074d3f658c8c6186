"""Writing: one rank's commits appended to its file, by one writer at a time.

A commit is one copy of its frames (name table additions first) into the file's stage, a shared mapping whose
batches are written to the file (:mod:`metricbus.journal.stage`; a writer holding its file's lock, on Linux, unless
``fsync="commit"``), else one ``os.write``; either way, when ``commit()`` returns its bytes are in the operating
system and survive SIGKILL. ``fsync`` decides what survives a power loss: ``"commit"`` (fsync every commit),
``"interval"`` (the default: fsync at most every ``FSYNC_INTERVAL_S`` seconds, the file and then its stage, from the
file's own thread so that no commit waits on the disk, :mod:`metricbus.journal.interval_sync`; and at close),
``"never"``.

One writer per file: the writer holds an exclusive ``flock`` on its file for its whole life and leaves its PID in
``rank-NNNNN.mbj.lock``; a second writer (another bus, in this process or another) gets a ``JournalError`` naming
the file and that PID. The kernel releases the lock when its holder dies, so a crashed run never blocks a restart.
(A child forked while the lock is held shares it until the child exits.)

Disk errors: a failed write or fsync raises ``JournalError`` (the file, the OS error and the step), never a raw
``OSError``; an interval fsync's failure is raised by the next commit (or ``close()``), naming the steps it covered.
Names count as written only once the write that carried them succeeded, so the next commit sends them again; what
part of a failed write reached the file is cut again (under the file's lock; unlocked, the reader skips the torn
frame, its CRC failing); and the next write that succeeds starts with a "G" frame naming the steps that are missing,
which the reader reports in ``Journal.gaps``, and "L" frames listing them, which it counts as empty commits where
they were (so ``log_every`` windows stay the live ones). A staged commit cannot fail that way: a batch whose write
fails stays staged (its torn part cut), and only a commit that finds the stage full while a batch still cannot be
written is a failed write as above.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from metricbus.adapter import RunInfo
from metricbus.errors import JournalError, JournalWarning
from metricbus.journal import reserve, stage
from metricbus.journal.appendable import check_appendable
from metricbus.journal.compact import CompactFrame
from metricbus.journal.cursors import CursorStore, identity_of
from metricbus.journal.format import (
    CHECKPOINT_BYTES,
    FSYNC_INTERVAL_S,
    MAGIC,
    STEP,
    SUFFIX,
    SUMMARY_FIELDS,
    SteadyFrame,
    body_frame,
    check_fsync,
    entries_layout,
    frame,
    gap_frame,
    lock_file,
    lost_frame,
    make_header,
    names_frame,
    packed_entries,
    rank_file,
    segment_frame,
    spec_to_json,
    window_frame,
)
from metricbus.journal.interval_sync import IntervalSync
from metricbus.partial import Partial
from metricbus.spec import Spec

Names = dict[str, tuple[int, Spec]]
_FRAMES_KEPT = 64  # commit shapes whose frames are kept for reuse
_STAGED: weakref.WeakSet[JournalWriter] = weakref.WeakSet()  # writers with a stage (for the fork hooks)
_FORK_HOOKED = False


def _register(
    pairs: Iterable[tuple[str, Spec]], ids: Names, next_id: int, new: list[list[Any]]
) -> tuple[Names, int, list[int]]:
    """Each ``(name, spec)``'s id in ``ids``, a new one (appended to ``new``: a row of the name table to write) for a
    name not there or there with another spec. ``ids`` is copied before its first change, and the caller keeps the
    copy only once the commit is written: a failed write sends the names again. Returns ``(ids, next_id, the ids)``."""
    row = []
    for name, spec in pairs:
        known = ids.get(name)
        if known is None or (known[1] is not spec and known[1] != spec):
            if not new:
                ids = dict(ids)
            known = ids[name] = (next_id, spec)
            next_id += 1
            new.append([known[0], name, spec_to_json(spec)])
        row.append(known[0])
    return ids, next_id, row


def _os_error(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "?")
    return f"{exc.strerror or exc} ({name})"


def _holder(path: Path) -> str:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        by = f" ({data['by']})" if isinstance(data.get("by"), str) else ""
        return f"PID {int(data['pid'])} on {data['host']}{by}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose PID is not recorded yet"


@contextlib.contextmanager
def held_for_sync(directory: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the writer's lock of every rank file in ``directory`` (or of the one ``.mbj`` file it names) for the
    ``with`` block, as a writer would: ``metricbus sync`` delivers into the live run's backends, so a bus still
    writing the journal (its adapters delivering the same steps, its jsonl file appended to while sync cuts it) is a
    ``JournalError`` naming the file and that bus, and a bus resuming the journal meanwhile is refused as a second
    writer is. Where the file system has no ``flock``, nothing is held (as for a writer)."""
    path = Path(directory)
    paths = [path] if path.is_file() else sorted(path.glob(f"rank-*{SUFFIX}")) if path.is_dir() else []
    held: list[tuple[int, Path]] = []
    try:
        for file in paths:
            try:
                fd = os.open(file, os.O_RDONLY)
            except OSError:
                continue  # unreadable: the reader reports it
            lock_path = file.with_name(file.name + ".lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise JournalError(
                    f"journal file {file} is still being written by a bus ({_holder(lock_path)}; a process forked "
                    "from it shares its lock until it exits): metricbus sync writes into the live run's backends, "
                    "which that bus is delivering to as well, so both would write (and cut) the same steps; sync once "
                    "that bus has closed or its process has ended"
                ) from None
            except OSError:  # a file system without flock: unguarded, as the writer is
                os.close(fd)
                continue
            held.append((fd, lock_path))
            with contextlib.suppress(OSError):  # for the message a bus resuming meanwhile gets
                owner = {"pid": os.getpid(), "host": socket.gethostname(), "time_unix_ns": time.time_ns()}
                lock_path.write_text(json.dumps({**owner, "by": "metricbus sync"}), encoding="utf-8")
        yield
    finally:
        for fd, lock_path in held:
            with contextlib.suppress(OSError):  # while locked: a next writer's PID is never removed
                lock_path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                os.close(fd)


class JournalWriter:
    """Appends one rank's commits to its file; ``delivered`` keeps the adapters' cursors."""

    def __init__(self, *, path: str | os.PathLike[str], fsync: str, rank: int, header: dict[str, Any]) -> None:
        self._fsync = check_fsync(fsync)
        self.directory = Path(path)
        self.path = rank_file(self.directory, rank)
        self._lock_path = lock_file(self.directory, rank)
        self._ids: Names = {}
        self._layouts: dict[int, struct.Struct] = {}  # one packing layout per entry count, built once
        self._layout_ids: dict[bytes, Any] = {}  # a packed partial's layout -> its names' ids (uint32 array)
        self._frames: dict[tuple[tuple[bytes, int], ...], SteadyFrame] = {}  # ((layout, rank), ...) -> its frame
        self._compacts: dict[tuple[bytes, int], CompactFrame] = {}  # (layout, rank) -> its "P" frame writer
        self._compact: CompactFrame | None = None  # the last one used
        self._next_id = 0
        self._unchecked = 0  # bytes written since the whole name table was
        self._table: tuple[Names, bytes] | None = None  # a whole name table and its "N" frame, for the checkpoints
        self._gap: tuple[int, int] | None = None  # steps not journaled or not fsynced, marked by the next write
        self._lost: list[tuple[int, int]] = []  # the same, as "L" ranges: one failed commit at each step of each
        # windows that ended with a failed commit: each one's "L" and "W" frames, in order (``_lost`` then holds
        # the failed commits of the open window only), so a reader counts each window's commits apart
        self._windows_due = b""
        self._failed = False  # ``_lost`` or ``_windows_due`` is pending
        self._segment: int | None = None  # the step of this writer's first commit, marked ("K") until written
        self._segment_written = False
        # log_every > 1: the steps of the open window's commits, written whole ("W") after its last one
        self._window = int(header.get("log_every", 1))
        self._window_steps: list[int] = []
        self._locked = False
        self._syncer: IntervalSync | None = None  # fsync="interval": the file's fsync thread
        self._reserve = reserve.reserver()
        self._end = 0
        self._reserved = 0  # blocks are reserved up to this offset (reserve.py)
        self._torn = 0  # how many bytes of a failed write reached the file (cut again by _cut)
        self._stage: stage.Stage | None = None  # the file's stage (stage.py), else each commit is written
        self._staging = threading.Lock()  # held while the stage changes (a fork's hook writes its batch: _watch_forks)
        self.cursors = CursorStore(self.directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)  # read: check_appendable
        except OSError as exc:
            raise JournalError(f"cannot open journal file {self.path}: {_os_error(exc)}") from exc
        self._fd: int | None = fd
        try:
            self._lock(fd)
            if not self._locked:  # nothing reserved: close() could not free it (reserve.trim needs the lock)
                self._reserve = None
            start = b""
            size = os.fstat(fd).st_size
            if size < len(MAGIC):  # new, or a torn magic (only its writer could have cut it)
                os.ftruncate(fd, 0)
                start = MAGIC
            else:  # never append to bytes no reader would read back (a foreign file, a newer format)
                check_appendable(fd, self.path, size)
            if self._locked:  # what a writer that died staged (stage.py) comes first, on the disk before it goes
                missing = stage.unwritten(self.path, fd)
                if missing:
                    self._write(missing)
                    os.fsync(fd)
                stage.discard(self.path)
            head = frame(b"H", json.dumps(header).encode())
            self._write(start + head + head)
            if self._fsync != "never":
                os.fsync(fd)
            self._end = os.fstat(fd).st_size  # where the last commit ends (staged ones included), kept as they are
            if self._locked and self._fsync != "commit" and stage.STAGED:
                self._open_stage(fd)
            if self._fsync == "interval":
                self._syncer = IntervalSync(
                    fd=fd, also=None if self._stage is None else self._stage.fd, interval=FSYNC_INTERVAL_S,
                    name=f"metricbus-journal-{rank}",
                )
        except BaseException as exc:
            self._fd = None
            if isinstance(exc, OSError):  # what part of the header reached the file is cut again (locked only)
                self._cut(fd)
            if self._locked:
                with contextlib.suppress(OSError):
                    self._lock_path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                os.close(fd)
            if isinstance(exc, OSError):
                raise JournalError(f"cannot write journal file {self.path}: {_os_error(exc)}") from exc
            raise

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalError(
                f"journal file {self.path} is already written by another bus ({_holder(self._lock_path)}); "
                "one writer per rank file: close that bus first, or give this one its own journal directory"
            ) from None
        except OSError as exc:  # a file system without flock (some network mounts): go on, unguarded
            warnings.warn(
                f"journal {self.path}: cannot lock it ({_os_error(exc)}); a second writer would not be refused",
                JournalWarning,
                stacklevel=4,
            )
            return
        self._locked = True
        try:
            owner = {"pid": os.getpid(), "host": socket.gethostname(), "time_unix_ns": time.time_ns()}
            self._lock_path.write_text(json.dumps(owner), encoding="utf-8")
        except OSError:
            pass  # only the message a second writer gets is poorer; the lock itself holds

    def _open_stage(self, fd: int) -> None:
        """Stage the commits (stage.py); where the stage cannot be made (a file system without ``fallocate`` or
        shared mappings, a full disk), every commit is written instead."""
        path = stage.stage_path(self.path)
        try:
            self._stage = stage.Stage(path=path, fd=fd)
        except (OSError, ValueError):  # (mmap's ValueError: a length it takes for invalid)
            with contextlib.suppress(OSError):
                path.unlink()
            return
        self._reserve = None  # a batch allocates its blocks at once
        _watch_forks(self)

    def _flush(self, held: stage.Stage) -> None:
        """Write the staged bytes to the file (a batch) and empty the stage. Where that fails, what part of them
        reached the file is cut again and they stay staged (the next batch, or the next writer, writes them); raise
        OSError."""
        fd = self._fd
        assert fd is not None
        view = held.take()
        try:
            size = os.fstat(fd).st_size
            offset = stage.after(fd, base=held.base, size=size, data=view)
            if offset is not None:  # (None: written already, by a batch cut short by an exception after its write)
                self._write(view, size - offset)  # (from what part of it the file holds, if any)
        except OSError:
            self._cut(fd)
            raise
        finally:
            view.release()
        held.emptied()

    def _append(self, data: bytes | bytearray) -> None:
        """Stage ``data`` (a batch written first where it does not fit: then a stage that cannot take it is written
        to, and ``data`` after it), or write it. Raise OSError: ``data`` is neither staged nor written."""
        held = self._stage
        if held is None:
            self._write(data)
        elif not held.put(data, end=self._file_end(held)):
            if held.used:
                self._flush(held)
            if not held.put(data, end=self._file_end(held)):  # longer than the stage
                self._write(data)

    def _file_end(self, held: stage.Stage) -> int:
        """The file's size where nothing is staged (where the staged bytes will go), else 0 (not read)."""
        if held.used or self._fd is None:
            return 0
        return os.fstat(self._fd).st_size

    def _write(self, data: bytes | bytearray | memoryview, written: int = 0) -> None:
        """Write ``data`` from byte ``written`` on (the bytes before it were written); where it fails, ``_torn`` says
        how many of ``data``'s bytes reached the file (for :meth:`_cut`). A write that makes no progress (0 bytes,
        as some FUSE file systems answer) is an OSError, not a loop."""
        assert self._fd is not None
        view = memoryview(data)[written:]
        try:
            while view:  # more than one write only when one was short (a signal, a nearly full disk)
                done = os.write(self._fd, view)
                if done <= 0:
                    raise OSError(errno.EIO, f"write made no progress ({done} bytes)")
                written += done
                view = view[done:]
        except OSError:
            self._torn = written
            raise

    def append(self, *, step: int, entries: list[tuple[int, Partial]]) -> None:
        """Write one commit (every entry of every partial, in order) in one ``os.write``, before commit() returns.

        Raise JournalError if the write or its fsync fails: the step is then missing from the journal, or not known
        to be on disk (a "G" frame says so with the next write that succeeds), and every later commit is still
        readable. With fsync="interval" the fsync runs on its own thread: a failure of it is raised by a later
        commit (:mod:`metricbus.journal.interval_sync`).
        """
        if self._fd is None:
            return
        if len(entries) == 1:  # one worker's commit (the usual one): a "P" frame where its scheme holds
            rank, partial = entries[0]
            packed = partial.packed_form
            if packed is not None and not packed.rests and not packed.sketches:
                compact = self._compact
                if compact is None or compact.layout != packed.layout or compact.rank != rank:
                    compact = self._compact_of(packed.layout, rank)
                if compact is not None:
                    data = compact.frame(step, packed.fields)
                    if data is not None:
                        self._send(step, data, self._ids)
                        return
        steady = self._steady(entries)
        if steady is None:
            self._append_entries(step, entries)
        else:
            self._send(step, steady.fill(step, entries), self._ids)

    def append_columns(self, *, step: int, rank: int, layout: bytes, fields: Any) -> bool:
        """:meth:`append` of one worker's commit held in columns, without a Partial: ``fields`` (a (N_FIELDS, n)
        array, no rests or sketches) of the packed partial whose layout is ``layout``. Written, the same bytes, where
        the last "P" frame was of that layout and rank and its scheme holds (a steady commit); else nothing is
        written and this returns False (then :meth:`append` writes it)."""
        compact = self._compact
        fd = self._fd
        if compact is None or compact.layout != layout or compact.rank != rank or fd is None:
            return False
        held = self._stage
        if held is not None and self._steady_only():  # built straight into the stage, where it can be
            with self._staging:
                size = held.put_compact(compact, step=step, fields=fields)
            if size:
                end = self._end + size
                if end > self._reserved:
                    self._reserve_ahead(fd, end)
                self._end = end
                self._unchecked += size
                self._sent(step)
                return True
        data = compact.frame(step, fields)
        if data is None:
            return False
        self._send(step, data, self._ids)
        return True

    def _steady_only(self) -> bool:
        """True where a commit's frame is all :meth:`_send` would write (no gap, failure, segment, window or name
        table due with it)."""
        return (
            self._gap is None and not self._failed and self._segment_written and self._window <= 1
            and self._unchecked < CHECKPOINT_BYTES
        )

    def _compact_of(self, layout: bytes, rank: int) -> CompactFrame | None:
        """The "P" frame writer of ``layout`` from ``rank`` when its names are registered (else None), kept as the
        last one used."""
        key = (layout, rank)
        held = self._compacts.get(key)
        if held is None:
            ids = self._layout_ids.get(layout)
            if ids is None:
                return None
            if len(self._compacts) >= _FRAMES_KEPT:
                self._compacts.clear()
            held = self._compacts[key] = CompactFrame(layout=layout, rank=rank, ids=ids)
        self._compact = held
        return held

    def _steady(self, entries: list[tuple[int, Partial]]) -> SteadyFrame | None:
        """The preallocated frame of this commit's shape, when every part is a packed partial without rests or
        sketches whose names are registered (every commit after a layout's first, usually); else None."""
        shape = []
        for rank, partial in entries:
            packed = partial.packed_form
            if packed is None or packed.rests or packed.sketches:
                return None
            shape.append((packed.layout, rank))
        key = tuple(shape)
        held = self._frames.get(key)
        if held is None:
            parts = []
            for layout, rank in key:
                ids = self._layout_ids.get(layout)
                if ids is None:  # names not registered yet: the general path writes them
                    return None
                parts.append((rank, ids))
            if len(self._frames) >= _FRAMES_KEPT:
                self._frames.clear()
            held = self._frames[key] = SteadyFrame(parts)
        return held

    def _append_entries(self, step: int, entries: list[tuple[int, Partial]]) -> None:
        """:meth:`append`, for any partials: registers new names and writes rests and sketches in an "R" frame."""
        ids = self._ids
        next_id = self._next_id
        new: list[list[Any]] = []
        learned: dict[bytes, Any] = {}  # layouts whose ids this commit found: kept once the write succeeded
        data: bytes | bytearray | None = None
        if len(entries) == 1:  # one worker's commit: the "P" frame the steady path writes, where its scheme holds
            rank, partial = entries[0]
            packed = partial.packed
            if not packed.rests and not packed.sketches:
                known_ids = self._layout_ids.get(packed.layout)
                if known_ids is None:
                    ids, next_id, row = _register(zip(packed.names, packed.specs, strict=True), ids, next_id, new)
                    known_ids = learned[packed.layout] = np.array(row, dtype=np.uint32)
                data = CompactFrame(layout=packed.layout, rank=rank, ids=known_ids).frame(step, packed.fields)
        if data is None:
            data, ids, next_id = self._commit_frame(step, entries, ids=ids, next_id=next_id, new=new, learned=learned)
        if new:
            table = names_frame(new)
            data = table + table + data  # two copies: losing one frame never loses a name
        self._send(step, data, ids)
        if new:  # a name (re)registered: ids of layouts seen before may have changed
            self._layout_ids.clear()
            self._frames.clear()
            self._compacts.clear()
            self._compact = None
        self._layout_ids.update(learned)
        self._ids = ids
        self._next_id = next_id

    def _commit_frame(
        self, step: int, entries: list[tuple[int, Partial]], *, ids: Names, next_id: int, new: list[list[Any]],
        learned: dict[bytes, Any],
    ) -> tuple[bytes, Names, int]:
        """The "S" (or, with rests or sketches, "R") frame of a commit, registering its names as :func:`_register`
        says; returns ``(frame, ids, next_id)``."""
        pieces: list[bytes] = []
        rests: list[tuple[int, tuple[float, ...]]] = []
        fields = SUMMARY_FIELDS
        n = 0
        for rank, partial in entries:
            packed = partial.packed_form
            if packed is not None and not packed.rests and not packed.sketches:
                known_ids = self._layout_ids.get(packed.layout)
                if known_ids is None:
                    ids, next_id, row = _register(zip(packed.names, packed.specs, strict=True), ids, next_id, new)
                    known_ids = learned[packed.layout] = np.array(row, dtype=np.uint32)
                rows = packed_entries(rank, known_ids)
                rows["fields"] = packed.fields.T
                pieces.append(rows.tobytes())
                n += len(known_ids)
                continue
            flat: list[float] = []
            start = n
            listed = partial.entries
            ids, next_id, row = _register(((name, spec) for name, spec, _ in listed), ids, next_id, new)
            for (_, _, summary), ident in zip(listed, row, strict=True):
                flat.append(rank)
                flat.append(ident)
                flat.extend(fields(summary))
                if summary.rest or summary.sketch is not None:  # field reads: the common entry has neither
                    rests.append((n, summary.rest_flat()))
                n += 1
            layout = self._layouts.get(n - start)
            if layout is None:
                layout = self._layouts[n - start] = entries_layout(n - start)
            pieces.append(layout.pack(*flat))
        return body_frame(STEP.pack(step, n) + b"".join(pieces), rests), ids, next_id

    def _send(self, step: int, data: bytes | bytearray, ids: Names) -> None:
        """Write a commit's ``data``, after a pending gap marker and, when one is due, the whole name table
        (``ids``: the table once this commit is written); then fsync as the policy says ("interval": a failure of
        the fsync thread's since the last commit is raised once this write succeeded, its steps marked as a gap
        with the next write)."""
        checkpoint = self._unchecked >= CHECKPOINT_BYTES
        closing = b""
        if self._window > 1:  # counted whether or not the write succeeds: the live window counts it
            window = self._window_steps
            window.append(step)
            if len(window) >= self._window:
                closing = window_frame(window)
                data = data + closing
                self._window_steps = []
        if self._failed:  # the commits whose write failed, counted by the reader where they were
            data = self._failures() + data
        if not self._segment_written:  # the first write of this writer's commits says where its segment starts
            if self._segment is None:
                self._segment = step
            data = segment_frame(self._segment) + data
        if checkpoint:
            data = self._table_frame(ids) + data
        if self._gap is not None:
            data = gap_frame(*self._gap) + data
        fd = self._fd
        assert fd is not None
        size = len(data)
        end = self._end + size
        if end > self._reserved:
            self._reserve_ahead(fd, end)
        self._torn = 0
        try:
            held = self._stage
            if held is not None:
                with self._staging:
                    self._append(data)
            else:
                written = os.write(fd, data)
                if written < size:
                    self._write(data, written)
        except OSError as exc:
            self._gap = (step, step) if self._gap is None else (self._gap[0], step)
            lost = self._lost
            if lost and lost[-1][1] == step - 1:
                lost[-1] = (lost[-1][0], step)
            else:
                lost.append((step, step))
            if closing:  # the window ended with this commit: its "L" piece, then its "W"
                self._windows_due += lost_frame(lost) + closing
                self._lost = []
            self._failed = True
            self._cut(fd)
            raise self._error("write", exc, step) from exc
        self._end = end
        self._gap = None
        self._segment_written = True
        if self._failed:
            self._lost, self._windows_due, self._failed = [], b"", False
        self._unchecked = 0 if checkpoint else self._unchecked + size
        self._sent(step)

    def _sent(self, step: int) -> None:
        """After a commit of ``step`` was written or staged: a batch when the stage is half full, then the fsync the
        policy says ("interval": a failure of the fsync thread's since the last commit is raised, its steps marked as
        a gap with the next write)."""
        held = self._stage
        if held is not None and held.full:  # a batch: where it fails, the commits stay staged (the next one tries)
            with self._staging, contextlib.suppress(OSError):
                self._flush(held)
        syncer = self._syncer
        if syncer is not None:  # "interval": fsynced by its thread
            syncer.wrote(step)
            if syncer.failed:
                unsynced = syncer.failure()
                if unsynced is not None:
                    self._gap = _merged(self._gap, unsynced[1], unsynced[2])
                    raise self._unsynced(unsynced)
        elif self._fsync == "commit":
            fd = self._fd
            assert fd is not None
            try:
                os.fsync(fd)
            except OSError as exc:  # the bytes may never reach the disk: say so, and send the names again
                self._gap = (step, step)
                raise self._unsynced((exc, step, step)) from exc

    def _failures(self) -> bytes:
        """The pending failed commits' frames: each window that ended with one ("L", "W"), then the open one's."""
        return self._windows_due + (lost_frame(self._lost) if self._lost else b"")

    def _cut(self, fd: int) -> None:
        """After a failed write: remove what part of it reached the file (``_torn`` bytes, a short write before the
        error: the file's last bytes, as it is appended to), so none of its frames is read and counted again with
        the next write, which carries them whole. Only those bytes: a child forked from this process shares the
        file and its lock, and what it appended stays. Unlocked (another writer may be appending), or where that
        fails, the file's size is taken as it is (the reader skips a torn frame)."""
        torn, self._torn = self._torn, 0
        with contextlib.suppress(OSError):
            size = os.fstat(fd).st_size
            if self._locked and 0 < torn <= size:
                os.ftruncate(fd, size - torn)  # (frees the blocks reserved past it too: reserved again)
                self._reserved = size - torn
        if self._stage is not None:  # the file ends where the staged bytes go: the end is theirs
            return
        with contextlib.suppress(OSError):
            self._end = os.fstat(fd).st_size

    def _reserve_ahead(self, fd: int, end: int) -> None:
        """Reserve the blocks from the file's end to at least ``end`` and a chunk beyond (reserve.py); where that
        fails (a full disk, a file system without it), the writes allocate them, and the next chunk tries again."""
        length = max(reserve.CHUNK_BYTES, end - self._end)
        held = self._reserve
        if held is not None:
            held(fd, self._end, length)
        self._reserved = self._end + length

    def _table_frame(self, ids: Names) -> bytes:
        """The "N" frame of the whole name table ``ids``, kept while it is the table (a table is never changed: a
        name registered makes a new one)."""
        held = self._table
        if held is None or held[0] is not ids:
            held = self._table = (ids, names_frame([[i, name, spec_to_json(s)] for name, (i, s) in ids.items()]))
        return held[1]

    def _error(self, what: str, exc: OSError, step: int) -> JournalError:
        return JournalError(
            f"cannot {what} journal file {self.path}: {_os_error(exc)}; step {step} is not journaled "
            "(the journal records the gap with its next successful write)"
        )

    def _unsynced(self, failed: tuple[OSError, int, int]) -> JournalError:
        exc, first, last = failed
        steps = f"step {first}" if first == last else f"steps {first} to {last}"
        error = JournalError(
            f"cannot fsync journal file {self.path}: {_os_error(exc)}; {steps} may not survive a power loss "
            "(written, never known to be on disk: the journal marks them as a gap)"
        )
        error.__cause__ = exc
        return error

    def delivered(self, index: int, adapter: Any, step: int) -> None:
        """Advance ``adapter``'s cursor to ``step`` (called from its delivery thread once the step is durable)."""
        self.cursors.advance(adapter, step)

    def skipped(self, index: int, adapter: Any, step: int, reason: str) -> None:
        """``adapter``'s backend rejected ``step`` for good: keep the gap so a later ``metricbus sync`` retries it
        (once the bus closed: nothing, see :meth:`release_cursors`)."""
        if not self.cursors.shared:
            self.cursors.add_gap(adapter, step, reason)

    def release_cursors(self) -> None:
        """The bus closed: a delivery thread it abandoned (a call stuck past ``close()``'s timeout) that returns
        later may still acknowledge what it wrote, but only past what the cursor records hold by then (a `metricbus
        sync` may have moved them since), and records no gap (its cursor stays below that step, which the next sync
        sends anyway)."""
        self.cursors.shared = True

    def opened(self, index: int, adapter: Any) -> None:
        """Keep what names ``adapter``'s backend run (its optional ``identity``), so a resume or a sync reopens it."""
        self.cursors.set_identity(adapter, identity_of(adapter))

    def rewound(self, index: int, adapter: Any, step: int) -> None:
        """``adapter``'s cursor goes back to ``step`` (a second commit at a step it had acknowledged)."""
        self.cursors.rewind(adapter, step)

    def close(self) -> None:
        """Write a pending gap marker and the failed commits' "L" frame (best effort), fsync (unless
        ``fsync="never"``), close and unlock the file.

        Raise JournalError if the final fsync fails; the file is closed and unlocked either way.
        """
        if self._fd is None:
            return
        fd = self._fd
        syncer = self._syncer
        unsynced = None
        closing: OSError | None = None
        staged: OSError | None = None  # the last batch could not be written
        try:
            if syncer is not None:  # its thread ends first (after an fsync under way), so its failure is marked
                syncer.stop()
                syncer.join()
                unsynced = syncer.failure()
                if unsynced is not None:
                    self._gap = _merged(self._gap, unsynced[1], unsynced[2])
            tail = b"" if self._gap is None else gap_frame(*self._gap)
            if self._failed:  # the failed commits, counted where they were (after the segment's start)
                if not self._segment_written and self._segment is not None:
                    tail += segment_frame(self._segment)
                tail += self._failures()
            if self._window_steps:  # the open window's steps, so a reader that lost its last commit still ends it
                tail += window_frame(self._window_steps)
            if tail:
                try:
                    self._append(tail)
                    self._end += len(tail)
                    self._gap, self._lost, self._windows_due, self._window_steps = None, [], b"", []
                    self._failed = False
                except OSError:  # already reported by the commit that failed; what part reached the file is cut
                    self._cut(fd)
            # the stage's last batch written now (where that fails the stage file keeps it); fsynced with any batch
            # that no fsync since covered (one a fork's hook wrote), before the stage goes
            batch = self._stage is not None
            if self._stage is not None and self._stage.used:
                with self._staging:
                    try:
                        self._flush(self._stage)
                    except OSError as exc:
                        staged = exc
                        with contextlib.suppress(OSError):  # what stays staged, on the disk as far as it can be
                            os.fsync(self._stage.fd)
            if self._reserve is not None:  # (only a locked writer reserves: unlocked, another may be appending)
                reserve.trim(fd)
            # fsync, unless the thread's last fsync began after the last write and succeeded
            if self._fsync != "never" and (syncer is None or tail or batch or syncer.dirty or unsynced is not None):
                try:
                    os.fsync(fd)
                except OSError as exc:
                    also = "" if unsynced is None else f" (and before: {self._unsynced(unsynced)})"
                    raise JournalError(f"cannot fsync journal file {self.path}: {_os_error(exc)}{also}") from exc
            held, self._stage = self._stage, None
            if held is not None:  # emptied into the file, and that on the disk: the stage file goes
                held.close(remove=staged is None)
        finally:
            self._fd = None
            if self._stage is not None:  # (close failed before its last batch: the stage file keeps it)
                self._stage.close(remove=False)
                self._stage = None
            if self._locked:
                with contextlib.suppress(OSError):  # while locked: a next writer's PID is never removed
                    self._lock_path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # (the thread's descriptor, if it still runs, shares the lock)
                    fcntl.flock(fd, fcntl.LOCK_UN)
            try:
                os.close(fd)
            except OSError as exc:  # (a network file system reports a failed write-back here)
                closing = exc
        if unsynced is not None:
            raise self._unsynced(unsynced)
        if staged is not None:
            raise JournalError(
                f"cannot write journal file {self.path}: {_os_error(staged)}; its last commits stay in "
                f"{stage.stage_path(self.path)}, which readers read with it and its next writer writes into it"
            ) from staged
        if closing is not None:
            raise JournalError(
                f"cannot close journal file {self.path}: {_os_error(closing)}; what was written since its last "
                "fsync may not be on disk"
            ) from closing


def open_journal(
    *,
    path: str | os.PathLike[str],
    fsync: str = "interval",
    rank: int,
    run: RunInfo,
    rules: list[tuple[str, Spec]],
    log_every: int,
    world: int = 1,
    opened_unix_ns: int | None = None,
) -> JournalWriter:
    """The journal writer of ``rank`` in directory ``path``; its run, rules, log_every and ``world`` (how many ranks
    journal a file each: a torch.distributed group's size) go into the header, with ``opened_unix_ns``: when this run
    (or resume) began, one value for every rank's file (the writer rank's clock, agreed when the bus was built, so
    hosts whose clocks differ still mark one run alike: :func:`metricbus.journal.reader.sessions`); None: this
    writer's clock now, as it opens the file."""
    check_fsync(fsync)
    header = make_header(rank=rank, run=run, rules=rules, log_every=log_every, world=world)
    header["opened_unix_ns"] = time.time_ns() if opened_unix_ns is None else int(opened_unix_ns)
    return JournalWriter(path=path, fsync=fsync, rank=int(rank), header=header)


def _merged(gap: tuple[int, int] | None, first: int, last: int) -> tuple[int, int]:
    """A pending gap marker's steps, widened to cover ``first .. last``."""
    return (first, last) if gap is None else (min(gap[0], first), max(gap[1], last))


def _watch_forks(writer: JournalWriter) -> None:
    """A process forked while ``writer`` stages: the parent writes its batch first, so what a child appends comes
    after the commits staged before the fork; the child drops its copy of the stage (shared with the parent's) and
    writes each commit it makes (a bus's copy in a child is closed, but a writer may be used there directly)."""
    global _FORK_HOOKED
    _STAGED.add(writer)
    if not _FORK_HOOKED and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_parent=_in_parent, after_in_child=_in_child)
        _FORK_HOOKED = True


_HELD: list[JournalWriter] = []  # the writers whose lock the fork's hook holds


def _before_fork() -> None:
    """Each stage's batch written, its lock held over the fork (no other thread changes a stage meanwhile)."""
    for writer in list(_STAGED):
        writer._staging.acquire()
        _HELD.append(writer)
        held = writer._stage
        if held is not None and held.used and writer._fd is not None:
            with contextlib.suppress(OSError):  # (the batch stays staged: the child's appends come first)
                writer._flush(held)


def _in_parent() -> None:
    while _HELD:
        _HELD.pop()._staging.release()


def _in_child() -> None:
    _HELD.clear()
    for writer in list(_STAGED):
        writer._staging = threading.Lock()  # (the parent's thread held it over the fork)
        held, writer._stage = writer._stage, None
        if held is not None:
            held.close(remove=False)
        if writer._syncer is not None:
            writer._syncer.forget_also()
    _STAGED.clear()
