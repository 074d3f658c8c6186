"""The reader's two passes over one rank file, a chunk at a time (see :mod:`metricbus.journal.reader`).

:func:`index_file` (the first pass) checks every frame, warns about damage, and keeps the headers, the gaps and
the *resets* (commits that replace the file's later steps); :func:`file_commits` (the second pass) yields the
commits that stay in the timeline, each as a :class:`RawPart`, decoded into Summaries only when asked
(:func:`entries_of`).

Both passes read a writer's commits of one shape (same length, ranks and name ids) a run at a time, as one numpy
array over the bytes read (:meth:`_Source.frames`, :func:`run_of`; "P" frames decoded together by
:func:`~metricbus.journal.compact.compact_run`): one CRC per frame and no Python per frame beyond it; the second
pass does not compute again the CRCs the first one checked (why that is safe: ``frames``).
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
import zlib
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from io import FileIO
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, cast

import numpy as np

from metricbus.errors import JournalError, JournalWarning
from metricbus.journal.compact import compact_rows, compact_run
from metricbus.journal.format import (
    ENTRY,
    FORMAT_VERSION,
    FRAME,
    FRAME_TYPES,
    GAP,
    MAGIC,
    MAX_FRAME,
    STEP,
    spec_from_json,
    unpack_commit,
)
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, Summary, rest_layout

Entry = tuple[str, Spec, Summary]
Names = Mapping[int, tuple[str, Spec]]
# One entry of a commit frame, as numpy reads it (ENTRY's layout "<II12d").
ENTRY_DTYPE = np.dtype([("rank", "<u4"), ("id", "<u4"), ("fields", "<f8", (N_FIELDS,))])
_MAGIC_SLACK = 2  # a magic with at most this many wrong bytes is damage, not a foreign file
_CHUNK = 1 << 22  # a file is read this many bytes at a time
_WHOLE = 1 << 24  # a frame up to this long is read whole before its CRC is checked (a longer one, a chunk at a time:
# a damaged length field costs at most this much memory)
_COMMITS = (b"S", b"R", b"P")
_COUNT_AT = 8  # an entry's count (its first field) follows its rank and id (<II)
_SMALL = 1 << 10  # a commit of at most this many entries compares its ids with the commit before's
_S = b"S"[0]
_RUNS = b"SP"  # the commit frames read a run at a time
_RUN = 1 << 20  # a run of frames spans at most this many bytes (the second pass copies it: memory it holds)
_HEAD = np.dtype([("length", "<u4"), ("crc", "<u4"), ("kind", "u1")])  # a frame's header and type byte
_NO_RESTS: Mapping[int, tuple[float, ...]] = MappingProxyType({})
_new = tuple.__new__
_DAMAGE = (ValueError, KeyError, TypeError, struct.error)


class UnreadableError(JournalError):
    """A rank file with nothing to read in it (a directory skips it; a single path raises it)."""


@dataclass(frozen=True, slots=True)
class Gap:
    """Commits of writer rank ``rank`` with ``first_step <= step <= last_step`` that it failed to journal."""

    rank: int
    first_step: int
    last_step: int


@dataclass(slots=True)
class FileCommit:
    """One commit of a rank file: its step, each rank's entries (in order), and whether it starts a segment."""

    step: int
    ranks: dict[int, list[Entry]]
    starts_segment: bool


@dataclass
class RankFile:
    """What one journal file holds: its headers, damage, gaps and (:func:`read_rank_file` only) its commits."""

    path: Path
    headers: list[dict[str, Any]] = field(default_factory=list)
    commits: list[FileCommit] = field(default_factory=list)
    damaged: int = 0
    gaps: list[Gap] = field(default_factory=list)


class RawPart(NamedTuple):
    """One rank file's share of a commit, not decoded into Summary objects (for a vectorized consumer).

    ``rows``: a read-only numpy array of :data:`ENTRY_DTYPE` (``rank``, name ``id``, the 12 ``fields`` of
    ``Summary.as_tuple()``, ``count`` as a double), one row per entry in journal order; ``rests``: entry index ->
    ``Summary.rest_flat()`` for the (rare) entries with exact-sum rests; ``names``: the file's name table when the
    commit was read (id -> (name, spec); never changed afterwards). A row whose id is missing from ``names`` lost its
    name-table record and is skipped by :attr:`Commit.partials`. ``shape``: :func:`shape_bytes` of ``rows`` where
    the reader has it already (one bytes object shared by the commits of a run of one shape), else None.
    """

    rows: Any  # np.ndarray of ENTRY_DTYPE (numpy's stubs do not type structured arrays usefully)
    rests: Mapping[int, tuple[float, ...]]
    names: Names
    shape: bytes | None = None


def shape_bytes(rows: Any) -> bytes:
    """The ranks and name ids of a commit's rows, as bytes: two commits with equal ones (and one name table) log
    the same names in the same order."""
    return bytes(rows["rank"].tobytes() + rows["id"].tobytes())


def entries_of(part: RawPart) -> dict[int, list[Entry]]:
    """``rank -> [(name, spec, Summary)]`` of one part, in journal order (a rank with only unknown names: [])."""
    rows, names, rests = part.rows, part.names, part.rests
    out: dict[int, list[Entry]] = {}
    get = names.get
    for k, (rank, ident, fields) in enumerate(
        zip(rows["rank"].tolist(), rows["id"].tolist(), rows["fields"].tolist(), strict=True)
    ):
        entries = out.get(rank)
        if entries is None:
            entries = out[rank] = []
        known = get(ident)
        if known is None:
            continue
        if rests and k in rests:
            summary = Summary.from_tuple(fields, rests[k])
        else:  # Summary.from_tuple without its checks: the fields list becomes the tuple (count back to int)
            fields[0] = int(fields[0])
            fields.append(())
            fields.append(None)
            summary = _new(Summary, fields)
        entries.append((known[0], known[1], summary))
    return out


# -- bytes -----------------------------------------------------------------------------------------------------------


class _Source:
    """The first ``size`` bytes of a file, read a chunk at a time (never the whole file).

    ``reuse``: every read goes into one buffer (grown when a frame needs it), for a reader that copies whatever it
    keeps of a frame before asking for the next one (the first pass): no fresh memory to fault in per chunk."""

    def __init__(self, file: FileIO, size: int, *, reuse: bool = False) -> None:
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
            want = min(max(n, _CHUNK), self.size - pos)
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
            k = min(n, _CHUNK)
            value = zlib.crc32(self.view(pos, k), value)
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
        ``_RUN`` bytes in all, that have its length and type and a valid CRC: ``(offset, span, k)`` for ``k`` frames,
        ``span`` from the first payload to the end of the last (:func:`run_of`, :func:`_split` read it). A writer's
        commits of one shape then cost one step of this loop, not one each; each frame is checked as it would be
        alone, so the frames and the damage found are the same.

        ``sound``: the ``(start, stop)`` stretches of this file the first pass read as a chain of valid frames (the
        second pass), whose CRCs are not computed again. That is safe because bytes a reader saw never change: a
        writer only appends (``O_APPEND``, one writer per file under its ``flock``), and the only truncation, of a
        file shorter than its magic, leaves no frame. So the second pass follows the first one's chain through these
        bytes; a frame outside them (damage, or what was appended after the first pass) is checked as always."""
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
                    if sure or length <= _WHOLE or pos in whole or self._sized(pos, length):  # read once, then checked
                        payload = self.view(pos + FRAME.size, length)
                        if sure or zlib.crc32(payload) == crc:
                            k = 1
                            if runs and payload[0] in _RUNS and length <= _WHOLE:
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
        fit = min(len(buf) - off, _RUN) // stride
        if off < 0 or fit < 2:  # its payload was read alone (its header ended a chunk), or ends the chunk
            return 1
        heads = np.ndarray((fit,), _HEAD, buf, off, (stride,))
        same = (heads["length"] == length) & (heads["kind"] == buf[off + FRAME.size])
        k = fit if same.all() else int(same.argmin())
        checked = max(1, min(k, (sound - pos) // stride))  # the first frames, inside what is sound
        at = off + checked * stride + FRAME.size
        for i, crc in enumerate(heads["crc"][checked:k].tolist(), checked):
            if zlib.crc32(buf[at : at + length]) != crc:
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


def _warn(path: Path, what: str) -> None:
    warnings.warn(f"journal {path}: {what}", JournalWarning, stacklevel=3)


def _check_header(path: Path, header: Any) -> dict[str, Any]:
    if not isinstance(header, dict):
        raise TypeError(f"a header is a JSON object, not {type(header).__name__}")
    fmt = header.get("format")
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise JournalError(
            f"{path} has journal format {fmt!r}, newer than this metricbus reads ({FORMAT_VERSION}); upgrade metricbus"
        )
    return dict(header)


def _check_magic(path: Path, head: bytes) -> None:
    if head.startswith(MAGIC):
        return
    if not head:
        raise UnreadableError(f"{path} is empty (not a metricbus journal file)")
    wrong = sum(a != b for a, b in zip(head[: len(MAGIC)], MAGIC, strict=False)) + max(0, len(MAGIC) - len(head))
    if wrong > _MAGIC_SLACK:
        raise UnreadableError(f"{path} is not a metricbus journal file (bad magic)")
    _warn(path, f"damaged magic ({wrong} bytes); read as a journal")


def _names(body: memoryview, names: Names) -> tuple[dict[int, tuple[str, Spec]], Exception | None]:
    """``names`` plus an "N" frame's rows, as a new dict (a commit read before keeps its table), and the error that
    stopped the rows (None: all read); the rows before a bad one count, as they always did."""
    out = dict(names)
    try:
        for ident, name, spec, *_ in json.loads(bytes(body)):  # later versions may add per-name fields
            out[int(ident)] = (str(name), spec_from_json(spec))
    except (*_DAMAGE, JournalError) as exc:
        return out, exc
    return out, None


def _commit_step(kind: bytes, body: memoryview) -> int:
    """The step of an "S", "R" or "P" body; ValueError or struct.error if it is inconsistent (nothing is decoded,
    but a "P" body: as the second pass will)."""
    if kind == b"P":
        return compact_rows(body)[0]
    step, n = STEP.unpack_from(body, 0)
    end = STEP.size + n * ENTRY.size
    if kind == b"R":  # rare: checked by decoding it
        for _, _, _, rest in unpack_commit(kind, bytes(body))[1]:
            if rest:
                rest_layout(rest)  # the lengths only: the summaries are built in the second pass
    elif len(body) != end:
        raise ValueError(f"a commit of {n} entries cannot be {len(body)} bytes long")
    if n:
        counts = np.ndarray((n,), "<f8", body, STEP.size + _COUNT_AT, (ENTRY.size,))
        # one reduction: a finite sum says every count is finite; else the rare check of each (a sum of huge
        # finite counts may overflow)
        if not math.isfinite(float(np.add.reduce(counts))) and not np.isfinite(counts).all():
            raise ValueError("a summary count that is not finite")
    return int(step)


def run_of(span: memoryview | bytes, k: int) -> Any:
    """The ``k`` "S" frames of a run (:meth:`_Source.frames`) as one array, one element a commit (``step``, ``n``
    and its ``rows``, each of ENTRY_DTYPE), viewing ``span``; None when they are not each the ``n`` entries their
    length says (damage: read frame by frame)."""
    stride = (len(span) + FRAME.size) // k
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


def _run_array(span: memoryview | bytes, k: int) -> Any:
    """:func:`run_of` a run of "S" frames, :func:`~metricbus.journal.compact.compact_run` of "P" frames."""
    return run_of(span, k) if span[0] == _S else compact_run(span, k)


def _run_steps(span: memoryview, k: int) -> Any:
    """The steps of a run's commits when each is one :func:`_commit_step` accepts and they do not go back (so only
    the first may reset the file); else None (the run is read frame by frame, with the warnings)."""
    run = _run_array(span, k)
    if run is None:
        return None
    steps, counts = run["step"], run["rows"]["fields"][..., 0]
    if not math.isfinite(float(np.add.reduce(counts, axis=None))) and not np.isfinite(counts).all():
        return None
    return steps if bool((steps[1:] >= steps[:-1]).all()) else None


def _split(pos: int, span: memoryview, k: int) -> Sequence[tuple[int, memoryview]]:
    """``(offset, payload)`` of each frame of what :meth:`_Source.frames` yielded (a run: each of its ``k``)."""
    if k == 1:
        return ((pos, span),)
    stride = (len(span) + FRAME.size) // k
    return [(pos + i * stride, span[i * stride : (i + 1) * stride - FRAME.size]) for i in range(k)]


# -- one file ----------------------------------------------------------------------------------------------------


@dataclass
class FileIndex:
    """What the first pass over one file learnt: its RankFile (headers, damage, gaps), and for the second pass the
    frames it could not read (``bad``, skipped again silently) and ``limits``: ``(ordinal, step)``, the commit with
    that ordinal resets the file, and every commit before it must have a step below ``step`` to be kept."""

    file: RankFile
    size: int
    bad: set[int]
    limits: list[tuple[int, int]]
    last_step: int | None
    warned: bool = False
    long: set[int] = field(default_factory=set)  # offsets of the valid frames over _WHOLE bytes (one per 16 MiB)
    sound: list[tuple[int, int]] = field(default_factory=list)  # stretches read as valid frames (_Source.frames)


def index_file(path: Path) -> FileIndex:
    """First pass over one file: warnings for damage, headers, gaps, resets. Raise UnreadableError or
    JournalError (a newer format)."""
    try:
        file = path.open("rb", buffering=0)
    except OSError as exc:
        raise UnreadableError(f"cannot read journal file {path}: {exc.strerror or exc}") from exc
    rf = RankFile(path)
    bad: set[int] = set()
    long: set[int] = set()
    resets: list[tuple[int, int]] = []
    sound: list[tuple[int, int]] = []
    start: int | None = len(MAGIC)

    def damage(pos: int, resume: int | None) -> None:
        nonlocal start
        if start is not None and start < pos:
            sound.append((start, pos))
        start = resume
        rf.damaged += 1
        if resume is None:
            _warn(path, f"torn or damaged record at byte {pos}; skipped the last {size - pos} bytes")
        else:
            _warn(path, f"damaged record at byte {pos}; skipped {resume - pos} bytes")

    with file:
        size = os.fstat(file.fileno()).st_size
        _check_magic(path, file.read(len(MAGIC)))
        ordinal, last, new_segment, prior, checked = 0, None, False, b"", b""
        for at, span, k in _Source(file, size, reuse=True).frames(damage, runs=True):
            steps = _run_steps(span, k) if k > 1 else None
            if steps is not None:  # a run of whole commits, steps not going back: only its first may reset the file
                first = int(steps[0])
                if last is not None and first <= last and (new_segment or first < last):
                    resets.append((ordinal, first))
                    rf.gaps = [g for g in (_clip(g, first) for g in rf.gaps) if g is not None]
                ordinal, last, new_segment, prior = ordinal + k, int(steps[-1]), False, b""
                continue
            for pos, payload in _split(at, span, k):
                if len(payload) > _WHOLE:
                    long.add(pos)
                kind = bytes(payload[:1])
                header, prior = prior, (bytes(payload) if kind == b"H" else b"")
                try:
                    if kind == b"H":
                        if prior == header:
                            continue  # the second copy of the header just read
                        rf.headers.append(_check_header(path, json.loads(bytes(payload[1:]))))
                        new_segment = True
                    elif kind == b"N":
                        if payload != checked:  # a checkpoint repeating the table just checked is not decoded again
                            error = _names(payload[1:], {})[1]
                            if error is not None:
                                raise error
                            checked = bytes(payload)
                    elif kind in _COMMITS:
                        step = _commit_step(kind, payload[1:])
                        if last is not None and step <= last and (new_segment or step < last):  # drops steps >= step
                            resets.append((ordinal, step))
                            rf.gaps = [g for g in (_clip(g, step) for g in rf.gaps) if g is not None]
                        ordinal, last, new_segment = ordinal + 1, step, False
                    elif kind == b"G":
                        first, final = GAP.unpack(payload[1:])
                        rank = int(rf.headers[-1].get("rank", -1)) if rf.headers else -1
                        rf.gaps.append(Gap(rank, first, final))
                    # other frame types: written by a newer minor version; skipped
                except JournalError:
                    raise
                except (*_DAMAGE, OverflowError) as exc:
                    bad.add(pos)
                    rf.damaged += 1
                    _warn(path, f"unreadable record at byte {pos} ({exc}); skipped")
    if not rf.headers:
        raise UnreadableError(f"{path} has no readable journal header")
    if start is not None and start < size:
        sound.append((start, size))
    limits, lowest = [], math.inf
    for ordinal, step in reversed(resets):
        lowest = min(lowest, step)
        limits.append((ordinal, int(lowest)))
    return FileIndex(rf, size, bad, limits[::-1], last, long=long, sound=sound)


def _clip(gap: Gap, step: int) -> Gap | None:
    """``gap`` without its steps ``>= step`` (None: nothing left)."""
    if gap.first_step >= step:
        return None
    return Gap(gap.rank, gap.first_step, min(gap.last_step, step - 1))


FileItem = tuple[int, int, bool, RawPart | None]  # step, n-th commit of that step in the file, starts a segment, part


class RunItem(NamedTuple):
    """The kept commits of a run of one shape, together (:func:`file_runs`): each one's step, whether the first
    starts a segment, and their rows as one ``(len(steps), n)`` array (``part.rows``)."""

    steps: list[int]
    starts: bool
    part: RawPart


def file_commits(index: FileIndex, *, decode: bool) -> Iterator[FileItem]:
    """Second pass over one file: its kept commits in order (``decode`` False: steps only, no part)."""
    return cast(Iterator[FileItem], _items(index, decode=decode, runs=False))


def file_runs(index: FileIndex) -> Iterator[FileItem | RunItem]:
    """:func:`file_commits`, except that the kept commits of a run of one shape come together, as a
    :class:`RunItem` (for a reader of one file: no ``nth``)."""
    return _items(index, decode=True, runs=True)


def _items(index: FileIndex, *, decode: bool, runs: bool) -> Iterator[FileItem | RunItem]:
    """The second pass. A run of commits of one shape (:func:`_alike`) is read as one array: its rows' names checked
    once, each commit's part a view of it (the run copied once, as one commit is: :meth:`_Source.keep`)."""
    path, bad = index.file.path, index.bad
    timeline = _Timeline(index.limits)
    names: Names = {}
    table, body = names, b""  # the last table read from an "N" frame, and that frame
    sized, dense = names, 0  # a table and its _dense count
    known_in, known_ids = names, b""  # a table and a small commit's ids found in it (the next commit's, likely)
    prior, unknown = b"", 0
    with path.open("rb", buffering=0) as file:
        source = _Source(file, index.size, reuse=True)  # what is kept of it is copied (keep)
        for start, span, k in source.frames(None, index.long, runs=True, sound=index.sound):
            run = _alike(start, span, k, bad) if k > 1 else None
            if run is not None:
                prior, missing, shape, rows = b"", 0, None, None
                if decode:
                    if span[0] == _S:  # a view of the span read: copied ("P" rows are decoded already)
                        run = run_of(source.keep(span), k)
                    rows = run["rows"]
                    if names is not sized:
                        sized, dense = names, _dense(names)
                    missing, shape = _missing(rows[0]["id"], names, dense), shape_bytes(rows[0])
                kept: list[int] = []
                first, steps = timeline.new_segment, run["step"].tolist()
                for i, step in enumerate(steps):
                    taken = timeline.take(step)
                    if taken is None:
                        continue
                    nth, starts = taken
                    unknown += missing
                    if rows is None:
                        yield step, nth, starts, None
                    elif runs:
                        kept.append(i)
                    else:
                        yield step, nth, starts, RawPart(rows[i], _NO_RESTS, names, shape)
                if kept and rows is not None:
                    every = len(kept) == k
                    yield RunItem(steps if every else [steps[i] for i in kept], first and kept[0] == 0,
                                  RawPart(rows if every else rows[kept], _NO_RESTS, names, shape))
                continue
            for pos, payload in _split(start, span, k):
                kind = bytes(payload[:1])
                header, prior = prior, (bytes(payload) if kind == b"H" else b"")
                if kind == b"H":
                    if prior != header and pos not in bad:
                        names, timeline.new_segment = {}, True
                elif kind == b"N" and decode:
                    if names is not table or payload != body:  # a checkpoint repeating the table keeps it (and its id)
                        names = _names(payload[1:], names)[0]  # an error was reported by the first pass
                        table, body = names, bytes(payload)
                elif kind in _COMMITS and pos not in bad:
                    step, n = STEP.unpack_from(payload, 1)
                    taken = timeline.take(step)
                    if taken is None:
                        continue
                    nth, starts = taken
                    if not decode:
                        yield step, nth, starts, None
                        continue
                    if kind == b"P":
                        rows = compact_rows(payload[1:])[1]
                    else:
                        rows = np.frombuffer(source.keep(payload), ENTRY_DTYPE, count=n, offset=1 + STEP.size)
                    if names is not sized:
                        sized, dense = names, _dense(names)
                    ids, small = rows["id"], n <= _SMALL
                    if not (small and names is known_in and ids.tobytes() == known_ids):  # else the ids just checked
                        missing = _missing(ids, names, dense)
                        unknown += missing
                        if small and not missing:
                            known_in, known_ids = names, ids.tobytes()
                    rests: Mapping[int, tuple[float, ...]] = _NO_RESTS
                    if kind == b"R":
                        rests = {k: rest for k, (_, _, _, rest) in enumerate(unpack_commit(kind, bytes(payload[1:]))[1])
                                 if rest}
                    yield step, nth, starts, RawPart(rows, rests, names)
    if unknown and not index.warned:
        index.warned = True
        _warn(path, f"{unknown} entries refer to a lost name table record; skipped")


class _Timeline:
    """Which commits of a file the second pass keeps, in file order: a commit a later segment replaces (the first
    pass's ``limits``: from which commit ordinal on, which steps) is dropped; the others get their ``nth`` (commits
    at the same step so far) and whether a new segment (a new header) starts with them."""

    __slots__ = ("_at", "_last", "_limits", "_nth", "_ordinal", "new_segment")

    def __init__(self, limits: list[tuple[int, int]]) -> None:
        self._limits = limits
        self._at = 0
        self._ordinal = 0
        self._last: int | None = None
        self._nth = 0
        self.new_segment = False

    def take(self, step: int) -> tuple[int, bool] | None:
        """The next commit, at ``step``: ``(nth, starts a segment)``, or None where a later segment (or a step
        going back) replaces it."""
        limits, at = self._limits, self._at
        while at < len(limits) and limits[at][0] <= self._ordinal:
            at += 1
        self._at = at
        starts, self.new_segment = self.new_segment, False
        self._ordinal += 1
        if at < len(limits) and step >= limits[at][1]:
            return None
        self._nth = self._nth + 1 if step == self._last else 0
        self._last = step
        return self._nth, starts


def _alike(start: int, span: memoryview, k: int, bad: Container[int]) -> Any:
    """:func:`run_of` a run whose commits all have the same ranks and name ids and none unreadable; else None."""
    stride = (len(span) + FRAME.size) // k
    if bad and any(start + i * stride in bad for i in range(k)):
        return None
    run = _run_array(span, k)
    if run is None:
        return None
    rows = run["rows"]
    same = (rows["id"] == rows["id"][0]).all() and (rows["rank"] == rows["rank"][0]).all()
    return run if same else None


def _missing(ids: Any, names: Names, dense: int) -> int:
    """How many of a commit's name ``ids`` are not in ``names`` (``dense``: its :func:`_dense` count)."""
    if not len(ids) or int(ids.max()) < dense:  # every id in the table: no per-entry lookup
        return 0
    listed = ids.tolist()
    return 0 if names.keys() >= set(listed) else sum(i not in names for i in listed)


def _dense(names: Names) -> int:
    """``len(names)`` when its ids are exactly ``0 .. len - 1`` (as a writer numbers them), else 0."""
    return len(names) if names and min(names) == 0 and max(names) == len(names) - 1 else 0
