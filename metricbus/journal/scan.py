"""The reader's two passes over one rank file, a chunk at a time (see :mod:`metricbus.journal.reader`).

:func:`index_file` (the first pass) checks every frame, warns about damage, and keeps the headers, the gaps and
the *resets* (commits that replace the file's later steps); :func:`file_commits` (the second pass) yields the
commits that stay in the timeline, each as a :class:`RawPart`, decoded into Summaries only when asked
(:func:`entries_of`).
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
import zlib
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass, field
from io import FileIO
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from metricbus.errors import JournalError, JournalWarning
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
_COMMITS = (b"S", b"R")
_COUNT_AT = 8  # an entry's count (its first field) follows its rank and id (<II)
_SMALL = 1 << 10  # a commit of at most this many entries compares its ids with the commit before's
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
    name-table record and is skipped by :attr:`Commit.partials`.
    """

    rows: Any  # np.ndarray of ENTRY_DTYPE (numpy's stubs do not type structured arrays usefully)
    rests: Mapping[int, tuple[float, ...]]
    names: Names


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

    def crc(self, pos: int, n: int) -> int:
        value = 0
        while n > 0:  # a long (or a bogus) length is checked a chunk at a time
            k = min(n, _CHUNK)
            value = zlib.crc32(self.view(pos, k), value)
            pos, n = pos + k, n - k
        return value

    def frames(
        self, report: Callable[[int, int | None], None] | None, whole: Container[int] = ()
    ) -> Iterator[tuple[int, memoryview]]:
        """``(offset, payload)`` of each valid frame; ``report(offset, resume or None)`` at each damaged stretch.
        ``whole``: offsets of long frames found valid before (by the first pass), read at once like short ones."""
        pos, end = len(MAGIC), self.size
        while pos < end:
            if pos + FRAME.size <= end:
                length, crc = FRAME.unpack(self.view(pos, FRAME.size))
                stop = pos + FRAME.size + length
                if 0 < length <= MAX_FRAME and stop <= end:
                    if length <= _WHOLE or pos in whole or self._sized(pos, length):  # read once, then checked
                        payload = self.view(pos + FRAME.size, length)
                        if zlib.crc32(payload) == crc:
                            yield pos, payload
                            pos = stop
                            continue
                    elif self.crc(pos + FRAME.size, length) == crc:
                        yield pos, self.view(pos + FRAME.size, length)
                        pos = stop
                        continue
            resume = self._resync(pos + 1)
            if report is not None:
                report(pos, resume)
            if resume is None:
                return
            pos = resume

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
    """The step of an "S" or "R" body; ValueError or struct.error if it is inconsistent (nothing is decoded)."""
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

    def damage(pos: int, resume: int | None) -> None:
        rf.damaged += 1
        if resume is None:
            _warn(path, f"torn or damaged record at byte {pos}; skipped the last {size - pos} bytes")
        else:
            _warn(path, f"damaged record at byte {pos}; skipped {resume - pos} bytes")

    with file:
        size = os.fstat(file.fileno()).st_size
        _check_magic(path, file.read(len(MAGIC)))
        ordinal, last, new_segment, prior, checked = 0, None, False, b"", b""
        for pos, payload in _Source(file, size, reuse=True).frames(damage):
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
    limits, lowest = [], math.inf
    for ordinal, step in reversed(resets):
        lowest = min(lowest, step)
        limits.append((ordinal, int(lowest)))
    return FileIndex(rf, size, bad, limits[::-1], last, long=long)


def _clip(gap: Gap, step: int) -> Gap | None:
    """``gap`` without its steps ``>= step`` (None: nothing left)."""
    if gap.first_step >= step:
        return None
    return Gap(gap.rank, gap.first_step, min(gap.last_step, step - 1))


FileItem = tuple[int, int, bool, RawPart | None]  # step, n-th commit of that step in the file, starts a segment, part


def file_commits(index: FileIndex, *, decode: bool) -> Iterator[FileItem]:
    """Second pass over one file: its kept commits in order (``decode`` False: steps only, no part)."""
    path, bad, limits = index.file.path, index.bad, index.limits
    names: Names = {}
    table, body = names, b""  # the last table read from an "N" frame, and that frame
    sized, dense = names, 0  # a table and its _dense count
    known_in, known_ids = names, b""  # a table and a small commit's ids found in it (the next commit's, likely)
    ordinal, at, last, nth, new_segment, prior, unknown = 0, 0, None, 0, False, b"", 0
    with path.open("rb", buffering=0) as file:
        for pos, payload in _Source(file, index.size).frames(None, index.long):
            kind = bytes(payload[:1])
            header, prior = prior, (bytes(payload) if kind == b"H" else b"")
            if kind == b"H":
                if prior != header and pos not in bad:
                    names, new_segment = {}, True
            elif kind == b"N" and decode:
                if names is not table or payload != body:  # a checkpoint repeating the table keeps it (and its id)
                    names = _names(payload[1:], names)[0]  # an error was reported by the first pass
                    table, body = names, bytes(payload)
            elif kind in _COMMITS and pos not in bad:
                step, n = STEP.unpack_from(payload, 1)
                while at < len(limits) and limits[at][0] <= ordinal:
                    at += 1
                starts, ordinal, new_segment = new_segment, ordinal + 1, False
                if at < len(limits) and step >= limits[at][1]:
                    continue  # a later segment (or a step going back) replaces it
                nth = nth + 1 if step == last else 0
                last = step
                if not decode:
                    yield step, nth, starts, None
                    continue
                rows = np.frombuffer(_own(payload), ENTRY_DTYPE, count=n, offset=1 + STEP.size)
                if names is not sized:
                    sized, dense = names, _dense(names)
                ids, small = rows["id"], n <= _SMALL
                if not (small and names is known_in and ids.tobytes() == known_ids):  # else the ids just checked
                    if n and not int(ids.max()) < dense:  # else every id is in the table: no per-entry lookup
                        listed = ids.tolist()
                        if not names.keys() >= set(listed):
                            unknown += sum(i not in names for i in listed)
                    elif small:
                        known_in, known_ids = names, ids.tobytes()
                rests = {}
                if kind == b"R":
                    rests = {k: rest for k, (_, _, _, rest) in enumerate(unpack_commit(kind, bytes(payload[1:]))[1])
                             if rest}
                yield step, nth, starts, RawPart(rows, rests, names)
    if unknown and not index.warned:
        index.warned = True
        _warn(path, f"{unknown} entries refer to a lost name table record; skipped")


def _own(payload: memoryview) -> memoryview | bytes:
    """A commit's bytes to keep: its own copy, so that a kept part never holds a whole chunk, unless the payload is
    most of the buffer it was read into (a long frame is read alone)."""
    return payload if 2 * payload.nbytes >= memoryview(payload.obj).nbytes else bytes(payload)


def _dense(names: Names) -> int:
    """``len(names)`` when its ids are exactly ``0 .. len - 1`` (as a writer numbers them), else 0."""
    return len(names) if names and min(names) == 0 and max(names) == len(names) - 1 else 0
