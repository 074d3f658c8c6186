"""The stage: a journal file's newest commits, copied into a small shared mapping and written to the file in batches.

Why: a commit's own ``os.write`` of ~3 KB costs the training loop ~7% of a 50-metric step on this machine, most of it
the kernel's work for a write that grows a file, not the copy (``benchmarks/bench_journal.py``). A copy into pages
that are mapped and reused costs no system call and no fresh memory; one ``os.write`` of the staged commits every
``STAGE_BYTES // 2`` bytes (~180 commits of 2.9 KB) moves them to the file.

Nothing is lost that a per-commit write would keep: the staged bytes are the stage file's page cache, the kernel's, so
a commit that returned survives SIGKILL as a written one does; the interval fsync thread fsyncs the stage file with
the journal file (``fsync="interval"``), so a power loss keeps what it kept before. Readers see staged commits as if
written: :func:`staged` gives them, and the journal's reader reads them after the file's bytes (a live journal, or
one whose writer died); the next writer of the file first appends them to it (:func:`unwritten`).

The stage file is ``rank-NNNNN.mbj.stage`` beside its rank file, ``STAGE_BYTES`` long, only while a writer holds the
rank file's lock (unlocked writers, ``fsync="commit"``, and platforms without ``posix_fallocate`` write each commit).
Layout: a header (``HEADER``: magic, the rank file's identity (the head of its first frame), the file offset where
the staged bytes go, a round counter moved on by every change of the header), then the staged bytes: whole frames,
exactly as the file will hold them, each commit's copied (a steady commit's "P" frame built in place instead:
:meth:`Stage.put_compact`) with its first eight bytes (a frame head) last, and zeros after them (a zero frame head
ends them; a torn copy leaves one). A batch written, the staged bytes are zeroed; a reader that saw the counter move
while it read reads again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
from io import FileIO
from pathlib import Path
from typing import Any

from metricbus.journal.checksum import crc32
from metricbus.journal.compact import CompactFrame
from metricbus.journal.format import FRAME, MAX_FRAME
from metricbus.journal.format import MAGIC as MAGIC_FILE

STAGE_BYTES = 1 << 20
# magic, the rank file's identity (the head of its first frame: its first header's length and CRC, which a file made
# anew has its own of, and a copy of the file keeps), base (the file offset where the staged bytes go: the file's
# size when the first of them was staged), and a round counter moved on by every change of the header
HEADER = struct.Struct("<8s8sQQ")
MAGIC = b"MBSTAGE1"
_DATA = 64  # the staged bytes start here
_HEAD = FRAME.size

STAGED = sys.platform.startswith("linux") and hasattr(os, "posix_fallocate")  # tests switch it off


def stage_path(rank_path: Path) -> Path:
    """The stage file of a rank file."""
    return rank_path.with_name(rank_path.name + ".stage")


class Stage:
    """The stage of one rank file (descriptor ``fd``, whose writer holds its lock), made empty. Raise OSError where
    it cannot be made (then the writer writes each commit)."""

    def __init__(self, *, path: Path, fd: int) -> None:
        self.path = path
        self._identity = _identity(fd)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(self._fd, 0, STAGE_BYTES)  # allocated: a copy never meets a full disk (no SIGBUS)
            self._map = mmap.mmap(self._fd, STAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        self._map[:] = bytes(STAGE_BYTES)  # every page touched once, so the copies fault no more
        self._round = 0
        self._used = 0  # staged bytes
        self.base = 0  # the file's size when the first of them was staged: where they go
        self._header(base=0)

    @property
    def fd(self) -> int:
        """The stage file's descriptor (for the interval fsync)."""
        return self._fd

    @property
    def used(self) -> int:
        """How many bytes are staged."""
        return self._used

    @property
    def full(self) -> bool:
        """Half of the stage or more is staged: time to write a batch."""
        return 2 * (_DATA + self._used) >= STAGE_BYTES

    def put(self, data: bytes | bytearray, *, end: int) -> bool:
        """Stage ``data`` (whole frames, the file's next bytes after those staged; ``end``: the file's size, read
        where nothing is staged); False where it does not fit."""
        n = len(data)
        where = _DATA + self._used
        if where + n > STAGE_BYTES:
            return False
        if not self._used:
            self.base = end
            self._header(base=end)
        view = memoryview(data)
        held = self._map
        held[where + _HEAD : where + n] = view[_HEAD:]
        held[where : where + _HEAD] = view[:_HEAD]
        self._used += n
        return True

    def put_compact(self, compact: CompactFrame, *, step: int, fields: Any) -> int:
        """Stage the "P" frame of ``step`` of ``fields``, built by ``compact`` straight into the mapping (no copy):
        its size, or 0 where it was not staged (nothing staged yet: :meth:`put` sets the header; no room; a commit
        :meth:`CompactFrame.frame` must build; no compiled module)."""
        used = self._used
        if not used:
            return 0
        n = compact.frame_into(self._map, _DATA + used, step, fields)
        self._used = used + n
        return n

    def take(self) -> memoryview:
        """The staged bytes (a view of the mapping, to release before :meth:`close`)."""
        return memoryview(self._map)[_DATA : _DATA + self._used]

    def emptied(self) -> None:
        """The batch is in the file: the staged bytes are zeroed (first: the bytes past those staged are zeros)."""
        self._map[_DATA : _DATA + self._used] = bytes(self._used)
        self._used = 0
        self._header(base=0)

    def close(self, *, remove: bool) -> None:
        """Unmap and close; ``remove``: the stage file too (nothing staged is left)."""
        with contextlib.suppress(BufferError):  # (a view still held: the mapping goes with it)
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _header(self, *, base: int) -> None:
        self._round += 1
        self._map[: HEADER.size] = HEADER.pack(MAGIC, self._identity, base, self._round)


def _identity(fd: int) -> bytes:
    """What tells the rank file open as ``fd`` from another (see ``HEADER``)."""
    return os.pread(fd, FRAME.size, len(MAGIC_FILE)).ljust(FRAME.size, b"\0")


def staged(rank_path: Path, fd: int) -> tuple[int, bytes] | None:
    """``(offset, bytes)``: what the stage of ``rank_path`` (open as ``fd``) holds that the file does not: the file
    is to be read as its bytes up to ``offset``, then ``bytes``. None where there is no such stage (none, another
    file's, nothing staged, or a batch already written)."""
    try:
        with open(stage_path(rank_path), "rb", buffering=0) as file:
            snapshot = _snapshot(file, fd)
    except OSError:
        return None
    if snapshot is None or not snapshot[2]:
        return None
    base, size, data = snapshot
    offset = after(fd, base=base, size=size, data=data)
    return None if offset is None else (offset, data)


def after(fd: int, *, base: int, size: int, data: bytes | memoryview) -> int | None:
    """Where staged ``data`` bound for offset ``base`` goes in the file open as ``fd`` (``size`` bytes): an offset
    from which the file's bytes to its end are a prefix of ``data`` (none of it written, or a batch under way or cut
    short: ``base``; the file holding other bytes there, a forked child's appends: after them, ``size``), or None
    where the file holds all of it at ``base`` (written) or is shorter than ``base`` (not this stage's file)."""
    if size < base:
        return None
    have = os.pread(fd, min(size - base, len(data)), base) if size > base else b""
    if have and bytes(data[: len(have)]) != have:  # other bytes where the batch goes: it goes after them
        return size
    return None if len(have) == len(data) else base


def _snapshot(file: FileIO, fd: int) -> tuple[int, int, bytes] | None:
    """``(base, the rank file's size, the staged frames)`` as one consistent reading (a live writer may change the
    stage meanwhile: read again while its round moved), or None (not this file's stage)."""
    identity = _identity(fd)
    for _ in range(16):
        file.seek(0)
        head = file.read(HEADER.size)
        if len(head) < HEADER.size:
            return None
        magic, first, base, round_ = HEADER.unpack(head)
        if magic != MAGIC or first != identity:
            return None
        body = file.read(STAGE_BYTES)[_DATA - HEADER.size :]
        size = os.fstat(fd).st_size
        file.seek(0)
        again = file.read(HEADER.size)
        if len(again) == HEADER.size and HEADER.unpack(again)[3] == round_:
            return base, size, body[: _frames_end(body)]
    return None


def _frames_end(body: bytes) -> int:
    """Where the whole, valid frames at the start of ``body`` end."""
    pos = 0
    view = memoryview(body)
    while pos + _HEAD < len(body):
        length, crc = FRAME.unpack_from(body, pos)
        stop = pos + _HEAD + length
        if not 0 < length <= MAX_FRAME or stop > len(body) or crc32(view[pos + _HEAD : stop]) != crc:
            break
        pos = stop
    return pos


def unwritten(rank_path: Path, fd: int) -> memoryview | None:
    """Before a writer appends to ``rank_path`` (open as ``fd``, its lock held): what a writer that died staged and
    the file lacks (of a batch cut short, only the rest of it), for the writer to append first; then
    :func:`discard` the stage."""
    found = staged(rank_path, fd)
    if found is None:
        return None
    offset, data = found
    return memoryview(data)[os.fstat(fd).st_size - offset :]


def discard(rank_path: Path) -> None:
    """Remove the stage file of ``rank_path`` (none: nothing to do)."""
    with contextlib.suppress(FileNotFoundError):
        stage_path(rank_path).unlink()
