"""Reading one rank file's frames: a chunk at a time, each CRC checked once, and a writer's commits of one shape (a
*run*) as one numpy array (:class:`FrameSource`, :func:`run_of`, :func:`run_array`). The reader's passes over a file
(:mod:`metricbus.journal.scan`) build on it."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence
from io import FileIO
from typing import Any

import numpy as np

from metricbus.errors import JournalError
from metricbus.journal.checksum import crc32
from metricbus.journal.compact import compact_run, compact_steps
from metricbus.journal.format import ENTRY, FRAME, FRAME_TYPES, MAGIC, MAX_FRAME, STEP
from metricbus.summary import N_FIELDS

# One entry of a commit frame, as numpy reads it (ENTRY's layout "<II12d").
ENTRY_DTYPE = np.dtype([("rank", "<u4"), ("id", "<u4"), ("fields", "<f8", (N_FIELDS,))])
CHUNK = 1 << 22  # a file is read this many bytes at a time
WHOLE = 1 << 24  # a frame up to this long is read whole before its CRC is checked (a longer one, a chunk at a time:
# a damaged length field costs at most this much memory)
S_FRAME = b"S"[0]
RUNS = b"SP"  # the commit frames read a run at a time
RUN = 1 << 20  # a run of frames spans at most this many bytes (the second pass copies it: memory it holds)
_HEAD = np.dtype([("length", "<u4"), ("crc", "<u4"), ("kind", "u1")])  # a frame's header and type byte


class Overlaid:
    """A rank file read with what its stage holds (:func:`metricbus.journal.stage.staged`): its bytes up to ``base``,
    then ``data`` (the staged frames) in place of whatever follows; the few file methods :class:`FrameSource` uses."""

    def __init__(self, file: FileIO, base: int, data: bytes) -> None:
        self._file, self._base, self._data = file, base, data
        self._pos = 0
        self.name = file.name

    def seek(self, pos: int) -> None:
        self._pos = pos

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        return bytes(out[: self.readinto(memoryview(out))])

    def readinto(self, buf: memoryview) -> int:
        pos, n, base = self._pos, len(buf), self._base
        got = 0
        if pos < base:
            want = min(n, base - pos)
            self._file.seek(pos)
            got = self._file.readinto(buf[:want]) or 0
            if got < want:  # (the file is shorter than where the stage starts: read no further)
                self._pos = pos + got
                return got
        start = pos + got - base
        piece = self._data[start : start + n - got]
        buf[got : got + len(piece)] = piece
        got += len(piece)
        self._pos = pos + got
        return got


class FrameSource:
    """The first ``size`` bytes of a file, read a chunk at a time (never the whole file).

    ``reuse``: every read goes into one buffer (grown when a frame needs it), for a reader that copies whatever it
    keeps of a frame before asking for the next one (the first pass): no fresh memory to fault in per chunk."""

    def __init__(self, file: FileIO | Overlaid, size: int, *, reuse: bool = False) -> None:
        self._file, self.size = file, size
        self._buf: bytes | memoryview = b""
        self._base = 0
        self._spare = bytearray() if reuse else None

    def view(self, pos: int, n: int) -> memoryview:
        """Bytes ``pos .. pos + n`` (``pos + n <= size``); valid until released (a later read replaces the chunk;
        with ``reuse``, until the next read)."""
        off = pos - self._base
        if off < 0 or off + n > len(self._buf):
            self._file.seek(pos)
            want = min(max(n, CHUNK), self.size - pos)
            if self._spare is None:
                self._buf = self._file.read(want)
            else:
                if len(self._spare) < want:
                    self._spare = bytearray(want)  # a new one: views of the old one may still be held
                got = self._file.readinto(memoryview(self._spare)[:want])
                self._buf = memoryview(self._spare)[: got or 0]
            self._base, off = pos, 0
            if len(self._buf) < n:
                raise JournalError(f"{getattr(self._file, 'name', 'a journal file')} shrank while it was read")
        return memoryview(self._buf)[off : off + n]

    def keep(self, payload: memoryview) -> memoryview | bytes:
        """Bytes of this source to keep past the next read: a copy (a kept commit never holds a whole chunk, and a
        reused buffer is read into again), unless they are most of the buffer (a long frame read alone): then the
        buffer is theirs, and the next read takes a new one."""
        if 2 * payload.nbytes < memoryview(payload.obj).nbytes:
            return bytes(payload)
        if self._spare is not None:
            self._spare = bytearray()
        return payload.toreadonly()  # read-only, as a copy would be

    def crc(self, pos: int, n: int) -> int:
        value = 0
        while n > 0:  # a long (or a bogus) length is checked a chunk at a time
            k = min(n, CHUNK)
            value = crc32(self.view(pos, k), value)
            pos, n = pos + k, n - k
        return value

    def frames(
        self,
        report: Callable[[int, int | None], None] | None,
        whole: Container[int] = (),
        *,
        runs: bool = False,
        sound: Sequence[tuple[int, int]] = (),
    ) -> Iterator[tuple[int, memoryview, int]]:
        """``(offset, payload, 1)`` of each valid frame; ``report(offset, resume or None)`` at each damaged stretch.
        ``whole``: offsets of long frames found valid before (by the first pass), read at once like short ones.

        ``runs``: a short "S" or "P" frame comes with the frames right after it, in the chunk already read and up to
        ``RUN`` bytes in all, that have its length and type and a valid CRC: ``(offset, span, k)`` for ``k`` frames,
        ``span`` from the first payload to the end of the last (:func:`run_of`, :func:`_split` read it). A writer's
        commits of one shape then cost one step of this loop, not one each; each frame is checked as it would be
        alone, so the frames and the damage found are the same.

        ``sound``: the ``(start, stop)`` stretches of this file the first pass read as a chain of valid frames (the
        second pass), whose CRCs are not computed again. That is safe because bytes a reader saw never change: a
        writer only appends (``O_APPEND``, one writer per file under its ``flock``), and the only truncation, of a
        file shorter than its magic, leaves no frame. So the second pass follows the first one's chain through these
        bytes; a frame outside them (damage, or what was appended after the first pass) is checked as always. (One
        more truncation exists: a writer cuts the bytes a failed write left at the end of its file, and the next
        write fills those offsets again. A reader whose first pass ran between the two can trust new bytes there:
        whole frames the writer wrote, unless its second pass meets that next write half done. Left as it is: it
        needs a full disk and a concurrent reader at that moment, and that reader's next run reads the file.)"""
        pos, end = len(MAGIC), self.size
        stretches, trusted = iter(sound), (0, 0)
        while pos < end:
            while trusted[1] <= pos and trusted[1] >= 0:
                trusted = next(stretches, (-1, -1))
            if pos + FRAME.size <= end:
                length, crc = FRAME.unpack(self.view(pos, FRAME.size))
                stop = pos + FRAME.size + length
                if 0 < length <= MAX_FRAME and stop <= end:
                    sure = trusted[0] <= pos and stop <= trusted[1]
                    if sure or length <= WHOLE or pos in whole or self._sized(pos, length):  # read once, then checked
                        payload = self.view(pos + FRAME.size, length)
                        if sure or crc32(payload) == crc:
                            k = 1
                            if runs and payload[0] in RUNS and length <= WHOLE:
                                k = self._run(pos, length, trusted[1] if sure else 0)
                            if k > 1:  # within the chunk read: no read
                                stop = pos + k * (FRAME.size + length)
                                payload = self.view(pos + FRAME.size, stop - pos - FRAME.size)
                            yield pos, payload, k
                            pos = stop
                            continue
                    elif self.crc(pos + FRAME.size, length) == crc:
                        yield pos, self.view(pos + FRAME.size, length), 1
                        pos = stop
                        continue
            resume = self._resync(pos + 1)
            if report is not None:
                report(pos, resume)
            if resume is None:
                return
            pos = resume

    def _run(self, pos: int, length: int, sound: int) -> int:
        """How many frames from ``pos`` (a valid "S" or "P" frame of ``length`` bytes) on, one after the other and all
        in the chunk read, have that length, its type and a valid CRC (at least 1): their headers compared at once,
        then one CRC each for those that end after ``sound`` (the CRCs before it hold: :meth:`frames`)."""
        stride = FRAME.size + length
        off = pos - self._base
        buf = memoryview(self._buf)
        fit = min(len(buf) - off, RUN) // stride
        if off < 0 or fit < 2:  # its payload was read alone (its header ended a chunk), or ends the chunk
            return 1
        heads = np.ndarray((fit,), _HEAD, buf, off, (stride,))
        same = (heads["length"] == length) & (heads["kind"] == buf[off + FRAME.size])
        k = fit if same.all() else int(same.argmin())
        checked = max(1, min(k, (sound - pos) // stride))  # the first frames, inside what is sound
        at = off + checked * stride + FRAME.size
        for i, crc in enumerate(heads["crc"][checked:k].tolist(), checked):
            if crc32(buf[at : at + length]) != crc:
                return i
            at += stride
        return k

    def _sized(self, pos: int, length: int) -> bool:
        """True when a long frame is a commit whose own entry count says its length: it is read at once (a damaged
        length field is read a chunk at a time, unless the count beside it was damaged to agree)."""
        head = self.view(pos + FRAME.size, 1 + STEP.size)
        return bytes(head[:1]) == b"S" and length == 1 + STEP.size + STEP.unpack_from(head, 1)[1] * ENTRY.size

    def _resync(self, pos: int) -> int | None:
        """The next offset where a whole frame with a valid CRC starts."""
        end = self.size
        while pos + FRAME.size < end:
            head = self.view(pos, FRAME.size + 1)
            length, crc = FRAME.unpack(head[: FRAME.size])
            stop = pos + FRAME.size + length
            if (
                0 < length <= MAX_FRAME
                and stop <= end
                and head[FRAME.size] in FRAME_TYPES
                and self.crc(pos + FRAME.size, length) == crc
            ):
                return pos
            pos += 1
        return None


def run_of(span: memoryview | bytes, k: int) -> Any:
    """The ``k`` "S" frames of a run (:meth:`FrameSource.frames`) as one array, one element a commit (``step``, ``n``
    and its ``rows``, each of ENTRY_DTYPE), viewing ``span``; None when they are not each the ``n`` entries their
    length says (damage: read frame by frame)."""
    stride = (len(span) + FRAME.size) // k
    if stride - FRAME.size < 1 + STEP.size:  # shorter than an "S" head (damage): read frame by frame
        return None
    n = STEP.unpack_from(span, 1)[1]
    if 1 + STEP.size + n * ENTRY.size != stride - FRAME.size:
        return None
    dtype = _RUN_DTYPES.get(n)
    if dtype is None:
        if len(_RUN_DTYPES) >= _RUN_DTYPES_KEPT:
            _RUN_DTYPES.clear()
        dtype = _RUN_DTYPES[n] = np.dtype([("kind", "u1"), ("step", "<i8"), ("n", "<u4"), ("rows", ENTRY_DTYPE, (n,))])
    run = np.ndarray((k,), dtype, span, 0, (stride,))
    return run if bool((run["n"] == n).all()) else None


_RUN_DTYPES: dict[int, np.dtype[Any]] = {}
_RUN_DTYPES_KEPT = 256


def run_array(span: memoryview | bytes, k: int) -> Any:
    """:func:`run_of` a run of "S" frames, :func:`~metricbus.journal.compact.compact_run` of "P" frames."""
    return run_of(span, k) if span[0] == S_FRAME else compact_run(span, k)


def run_steps(span: memoryview | bytes, k: int) -> Any:
    """The steps of :func:`run_array`'s commits (a (k,) int64 array: of "S" frames a view of ``span``, of "P" frames a
    copy), where it gives an array whose counts are all finite; else None. "P" frames are not decoded past their
    steps and counts (:func:`compact_steps`)."""
    if span[0] != S_FRAME:
        return compact_steps(span, k)
    run = run_of(span, k)
    if run is None:
        return None
    counts = run["rows"]["fields"][..., 0]
    if not np.isfinite(counts).all():
        return None
    return run["step"]


def split_run(pos: int, span: memoryview, k: int) -> Sequence[tuple[int, memoryview]]:
    """``(offset, payload)`` of each frame of what :meth:`FrameSource.frames` yielded (a run: each of its ``k``)."""
    if k == 1:
        return ((pos, span),)
    stride = (len(span) + FRAME.size) // k
    return [(pos + i * stride, span[i * stride : (i + 1) * stride - FRAME.size]) for i in range(k)]
