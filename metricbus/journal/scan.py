"""The reader's two passes over one rank file, a chunk at a time (see :mod:`metricbus.journal.reader`).

:func:`index_file` (the first pass) checks every frame, warns about damage, and keeps the headers, the gaps and
the *resets* (commits that replace the file's later steps); :func:`file_commits` (the second pass) yields the
commits that stay in the timeline, each as a :class:`RawPart`, decoded into Summaries only when asked
(:func:`entries_of`).

Both passes read a writer's commits of one shape (same length, ranks and name ids) a run at a time, as one numpy
array over the bytes read (:mod:`metricbus.journal.frames`: :meth:`FrameSource.frames`, :func:`run_array`; "P"
frames decoded together by :func:`~metricbus.journal.compact.compact_run`): one CRC per frame and no Python per
frame beyond it; the second pass does not compute again the CRCs the first one checked (why that is safe:
``FrameSource.frames``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import warnings
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from io import FileIO
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, cast

import numpy as np

from metricbus.errors import JournalError, JournalWarning
from metricbus.journal import stage
from metricbus.journal.compact import compact_rows
from metricbus.journal.format import (
    ENTRY,
    FORMAT_VERSION,
    FRAME,
    GAP,
    MAGIC,
    SEGMENT,
    STEP,
    lost_steps,
    spec_from_json,
    unpack_commit,
    window_steps,
)
from metricbus.journal.frames import (
    ENTRY_DTYPE,
    S_FRAME,
    WHOLE,
    FrameSource,
    Overlaid,
    run_array,
    run_of,
    run_steps,
    split_run,
)
from metricbus.journal.window_marks import OpenWindow
from metricbus.spec import Spec
from metricbus.summary import Summary, rest_layout

Entry = tuple[str, Spec, Summary]
Names = Mapping[int, tuple[str, Spec]]
# One entry of a commit frame, as numpy reads it (ENTRY's layout "<II12d").
_MAGIC_SLACK = 2  # a magic with at most this many wrong bytes is damage, not a foreign file
_COMMITS = (b"S", b"R", b"P")
_COUNT_AT = 8  # an entry's count (its first field) follows its rank and id (<II)
_SMALL = 1 << 10  # a commit of at most this many entries compares its ids with the commit before's
_PRINT_END = 2048  # bytes kept of each end of a long commit frame (_print)
_NONE = bytes(4)  # a commit's entry count (its bytes 9..12, after the type and step), when it has no entry
_NO_RESTS: Mapping[int, tuple[float, ...]] = MappingProxyType({})
_NO_ROWS = np.empty(0, ENTRY_DTYPE)  # a commit lost to damage ("W" frame): counted, holding nothing
_NO_ROWS.flags.writeable = False
_FAILED_ROWS = np.empty(0, ENTRY_DTYPE)  # an "L" frame's failed commit: counted, holding nothing (failed_write)
_FAILED_ROWS.flags.writeable = False
_new = tuple.__new__
_DAMAGE = (ValueError, KeyError, TypeError, struct.error)


class UnreadableError(JournalError):
    """A rank file with nothing to read in it (a directory skips it; a single path raises it)."""


@dataclass(frozen=True, slots=True)
class Gap:
    """Commits of writer rank ``rank`` with ``first_step <= step <= last_step`` that it failed to journal, or wrote
    without an fsync that succeeded (those are in the file and replayed, but were never known to be on disk)."""

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


def _warn(path: Path, what: str) -> None:
    warnings.warn(f"journal {path}: {what}", JournalWarning, stacklevel=3)


def check_header(path: Path, header: Any) -> dict[str, Any]:
    """``header`` (a decoded "H" frame) as a dict; TypeError if it is not an object, JournalError if its format is
    newer than this metricbus reads."""
    if not isinstance(header, dict):
        raise TypeError(f"a header is a JSON object, not {type(header).__name__}")
    fmt = header.get("format")
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise JournalError(
            f"{path} has journal format {fmt!r}, newer than this metricbus reads ({FORMAT_VERSION}); upgrade metricbus"
        )
    return dict(header)


def check_magic(path: Path, head: bytes) -> None:
    """Pass a file's first bytes ``head`` that are metricbus's magic, with a warning where at most
    ``_MAGIC_SLACK`` of them are damaged; else UnreadableError (an empty or foreign file)."""
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
        if not np.isfinite(counts).all():
            raise ValueError("a summary count that is not finite")
    return int(step)


def _run_steps(span: memoryview, k: int) -> Any:
    """The steps of a run's commits when each is one :func:`_commit_step` accepts and they increase (so only the
    first may reset the file, and none repeats the one before: a writer never writes two commits of one shape at one
    step); else None (the run is read frame by frame, with the warnings)."""
    steps = run_steps(span, k)
    return steps if steps is not None and bool((steps[1:] > steps[:-1]).all()) else None


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
    long: set[int] = field(default_factory=set)  # offsets of the valid frames over WHOLE bytes (one per 16 MiB)
    # commits lost to damage that a "W" frame names: file offset -> their steps, yielded (empty) before that frame
    phantoms: dict[int, list[int]] = field(default_factory=dict)
    # the offsets in ``phantoms`` that are "W" frames: their lost commits end the window before them, in the
    # segment of the commits before (a segment starting after that frame replaces them as it replaces those)
    tails: set[int] = field(default_factory=set)
    sound: list[tuple[int, int]] = field(default_factory=list)  # stretches read as valid frames (FrameSource.frames)
    # per segment (a writer) with commits, in file order: the step of its first commit, of the last one it wrote,
    # and the ordinal of its first commit
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    resets: list[tuple[int, int]] = field(default_factory=list)  # ``(ordinal, step)``: what ``limits`` is made of
    commits: int = 0  # commits counted (the ordinal after the last one)
    tail: tuple[int, bytes] | None = None  # what the file's stage held, read after the file's bytes (stage.py)
    holes: list[tuple[int, int]] = field(default_factory=list)  # steps (first, last) lost to damage mid-segment
    # damage mid-segment (log_every 1) between commits at steps ``before`` (None: before the writer's first commit)
    # and ``after``, the commit read after it at file offset ``at``: ``(before, after, at)``. Commits lost at those
    # two steps themselves (a second commit at a step: evaluation after training) show only against the other files'
    # counts of commits there (:func:`metricbus.journal.reader.count_lost`)
    mends: list[tuple[int | None, int, int]] = field(default_factory=list)
    finals: list[int] = field(default_factory=list)  # per segment: how many of its commits are at its last step
    # damage after the commit at step ``before`` followed by a writer's header (a torn tail, then a resume), the
    # segment that writer opened: ``(before, segment index)``
    cuts: list[tuple[int, int]] = field(default_factory=list)
    # per segment: when its writer opened the file (its header's ``opened_unix_ns``; None for every segment where a
    # header lacks it, written before this version, or where they do not increase: a header lost to damage)
    opened: list[int | None] = field(default_factory=list)


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

    holes: list[tuple[int, int]] = []
    mends: list[tuple[int | None, int, int]] = []
    cuts: list[tuple[int, int]] = []
    hole: int | None = None  # damage after a commit at this step: the steps up to the next commit read are lost
    hole_first = False  # that damage came before the writer's first commit read (``hole`` is its "K" step - 1)
    before_first: int | None = None  # the step before the file's first writer's first commit (its "K" frame)

    def damage(pos: int, resume: int | None) -> None:
        nonlocal start, hole, hole_first
        if start is not None and start < pos:
            sound.append((start, pos))
        start = resume
        rf.damaged += 1
        if resume is None:
            _warn(path, f"torn or damaged record at byte {pos}; skipped the last {size - pos} bytes")
        else:
            _warn(path, f"damaged record at byte {pos}; skipped {resume - pos} bytes")
            if hole is None and window is None:  # (log_every > 1: the window's "W" frame names what was lost)
                hole, hole_first = (last, False) if last is not None else (before_first, True)

    with file:
        size = os.fstat(file.fileno()).st_size
        tail = stage.staged(path, file.fileno())  # commits its writer staged, not in the file yet (stage.py)
        source_file: FileIO | Overlaid = file if tail is None else Overlaid(file, *tail)
        # the file's bytes, then the staged ones; or the file as it is now (a batch written since the size above)
        size = os.fstat(file.fileno()).st_size if tail is None else tail[0] + len(tail[1])
        check_magic(path, file.read(len(MAGIC)))
        ordinal, last, new_segment, prior, checked = 0, None, False, b"", b""
        # the last commit frame with entries read in this segment: a second copy of it is damage (a writer never
        # writes one twice: two commits at one step hold different names; an empty commit may repeat)
        before = b""
        window: OpenWindow | None = None  # log_every > 1: the commits read in the open window
        phantoms: dict[int, list[int]] = {}
        tails: set[int] = set()
        segments: list[list[int]] = []  # [first step, last step, first ordinal] of each segment's commits
        finals: list[int] = []  # how many commits each segment holds at its last step
        times: list[int | None] = []  # when each segment's writer opened the file
        opened = False  # a header was read since the last commit: the next commit (or "K" frame) opens a segment
        opened_at = 0  # the ordinal of the first commit after that header

        def wrote(first: int, final: int, at: int, n: int = 1) -> None:  # commits at steps first .. final were
            nonlocal opened, hole  # read in this segment, the first at file offset ``at``, ``n`` of them at ``final``
            if hole is not None:  # the first commit read after damage: the steps in between were in it
                if first > hole + 1:
                    holes.append((hole + 1, first - 1))
                mends.append((None if hole_first else hole, first, at))
                hole = None
            if opened or not segments:
                segments.append([first, final, opened_at])
                finals.append(0)
                times.append(_opened(rf.headers[-1]) if rf.headers else None)
                opened = False
            finals[-1] = finals[-1] + n if first == final == segments[-1][1] else n
            segments[-1][1] = final

        def reset(step: int) -> None:  # the commit read next (ordinal) drops the file's steps >= step
            resets.append((ordinal, step))
            rf.gaps = [g for g in (_clip(g, step) for g in rf.gaps) if g is not None]
            holes[:] = [(low, min(high, step - 1)) for low, high in holes if low < step]  # replaced, not lost
        for at, span, k in FrameSource(source_file, size, reuse=True).frames(damage, runs=True):
            steps = _run_steps(span, k) if k > 1 else None
            repeats = steps is not None and int(steps[0]) == last and before  # its first commit, the one before?
            if repeats and _print(split_run(at, span, k)[0][1]) == before:  # frame by frame, where that is skipped
                steps = None
            if steps is not None:  # a run of whole commits, steps increasing: only its first may reset the file
                first = int(steps[0])
                if last is not None and first <= last and (new_segment or first < last):
                    reset(first)
                if window is not None:
                    stride = (len(span) + FRAME.size) // k
                    window.add((step, at + i * stride) for i, step in enumerate(steps.tolist()))
                ordinal, last, new_segment, prior = ordinal + k, int(steps[-1]), False, b""
                wrote(first, last, at)
                before = _print(split_run(at, span, k)[-1][1])
                continue
            for pos, payload in split_run(at, span, k):
                if len(payload) > WHOLE:
                    long.add(pos)
                kind = bytes(payload[:1])
                header, prior = prior, (bytes(payload) if kind == b"H" else b"")
                try:
                    if kind == b"H":
                        if prior == header:
                            continue  # the second copy of the header just read
                        rf.headers.append(check_header(path, json.loads(bytes(payload[1:]))))
                        new_segment, before, opened, opened_at = True, b"", True, ordinal
                        if hole is not None and not hole_first and last is not None:  # a torn tail, then a resume
                            cuts.append((last, len(segments)))
                        hole = None  # (a writer opened the file again: its commits replace, not continue)
                        every = _log_every(rf.headers[-1])
                        window = OpenWindow(every=every, damaged=rf.damaged) if every > 1 else None
                    elif kind == b"N":
                        if payload != checked:  # a checkpoint repeating the table just checked is not decoded again
                            error = _names(payload[1:], {})[1]
                            if error is not None:
                                raise error
                            checked = bytes(payload)
                    elif kind in _COMMITS:
                        step = _commit_step(kind, payload[1:])
                        if step == last and before and _print(payload) == before:  # never written
                            bad.add(pos)
                            rf.damaged += 1
                            _warn(path, f"record at byte {pos} repeats the commit before it (step {step}); skipped")
                            continue
                        if last is not None and step <= last and (new_segment or step < last):  # drops steps >= step
                            reset(step)
                        if window is not None:
                            window.add(((step, pos),))
                        ordinal, last, new_segment, before = ordinal + 1, step, False, _print(payload)
                        wrote(step, step, pos)
                    elif kind == b"L":  # commits whose write failed: each counts as an empty commit here
                        for step in lost_steps(payload[1:]):
                            if last is not None and step <= last and (new_segment or step < last):
                                reset(step)
                            if window is not None:
                                window.add(((step, pos),))
                            ordinal, last, new_segment, before = ordinal + 1, step, False, b""
                            wrote(step, step, pos)
                    elif kind == b"W":  # the steps of the window just ended: what damage took is counted still
                        listed = window_steps(payload[1:])
                        if window is not None:
                            for where, lost in window.losses(listed, pos, rf.damaged).items():
                                phantoms.setdefault(where, []).extend(lost)
                                holes.extend(_runs(lost))  # the steps it lost, exactly (they may jump)
                                if where == pos:  # the window's last commits: the file's last step so far
                                    tails.add(pos)
                                    last = lost[-1] if last is None else max(last, lost[-1])
                                    wrote(lost[0], last, pos, lost.count(last))
                            window = window.next(rf.damaged)
                    elif kind == b"K":  # a writer's first commit is at this step, read or not
                        (first,) = SEGMENT.unpack(payload[1:])
                        if last is None:  # damage before any commit read: the steps from ``first`` on are lost
                            before_first = first - 1
                        if opened or not segments:  # the writer's first commit is at ``first``, read or not
                            wrote(first, first, pos, 0)
                        if last is not None and first <= last:  # drops steps >= first
                            reset(first)
                            last = first - 1  # so the segment's commits (at first, or later) reset nothing more
                        new_segment, before = False, b""
                        if window is not None:
                            window = window.next(rf.damaged)
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
    return FileIndex(rf, size, bad, limits_of(resets), last, long=long, sound=sound, phantoms=phantoms, tails=tails,
                     segments=[(first, final, at) for first, final, at in segments], resets=resets, commits=ordinal,
                     holes=holes, mends=mends, finals=finals, opened=_increasing(times), cuts=cuts, tail=tail)


def _opened(header: Mapping[str, Any]) -> int | None:
    value = header.get("opened_unix_ns")
    return value if type(value) is int else None


def _increasing(times: list[int | None]) -> list[int | None]:
    """``times``, or None for each where one is None or they do not increase (a segment took the header of the one
    before: its own was lost to damage)."""
    known = [t for t in times if t is not None]
    if len(known) < len(times) or any(a >= b for a, b in itertools.pairwise(known)):
        return [None] * len(times)
    return times


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """``steps`` (ascending) as ``(first, last)`` runs of consecutive or repeated steps."""
    return joined_spans([(step, step) for step in steps])


def joined_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(first, last)`` step spans, sorted, overlapping or adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for low, high in sorted(spans):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def limits_of(resets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """:attr:`FileIndex.limits` of resets ``(ordinal, step)`` (in ordinal order): each with the lowest step of it
    and of every reset after it."""
    limits, lowest = [], math.inf
    for ordinal, step in reversed(resets):
        lowest = min(lowest, step)
        limits.append((ordinal, int(lowest)))
    return limits[::-1]


def _log_every(header: Mapping[str, Any]) -> int:
    every = header.get("log_every", 1)
    return every if isinstance(every, int) else 1


def _print(payload: memoryview) -> bytes:
    """What tells a commit frame from the next one at its step: its bytes, or for a long one its length and the
    bytes at both ends (two commits at one step hold different names, so their first entries already differ); b""
    for a commit without entries (an empty commit may repeat)."""
    if payload[9:13] == _NONE:
        return b""
    if len(payload) <= 2 * _PRINT_END:
        return bytes(payload)
    return b"".join((len(payload).to_bytes(8, "little"), payload[:_PRINT_END], payload[-_PRINT_END:]))


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


def failed_write(part: RawPart) -> bool:
    """Whether ``part`` is a commit whose journal write failed (one an "L" frame lists): counted where it was, so
    ``log_every`` windows stay the live ones, but holding none of its records."""
    return part.rows is _FAILED_ROWS


def _empties(
    timeline: _Timeline, steps: Iterable[int], names: Names, decode: bool, *, failed: bool, counted: bool = True,
    tail: bool = False,
) -> Iterator[FileItem]:
    """Empty commits at ``steps`` (``failed`` writes, else lost to damage: ``counted`` and ``tail`` as
    :meth:`_Timeline.take`), where the timeline keeps them."""
    rows = _FAILED_ROWS if failed else _NO_ROWS
    for step in steps:
        taken = timeline.take(step, counted=counted, tail=tail)
        if taken is not None:
            yield step, taken[0], taken[1], RawPart(rows, _NO_RESTS, names) if decode else None


def _items(index: FileIndex, *, decode: bool, runs: bool) -> Iterator[FileItem | RunItem]:
    """The second pass. A run of commits of one shape (:func:`_alike`) is read as one array: its rows' names checked
    once, each commit's part a view of it (the run copied once, as one commit is: :meth:`FrameSource.keep`)."""
    path, bad, phantoms = index.file.path, index.bad, index.phantoms
    breaks = bad if not phantoms else {*bad, *phantoms}  # a run is read frame by frame where a lost commit goes
    timeline = _Timeline(index.limits)
    names: Names = {}
    table, body = names, b""  # the last table read from an "N" frame, and that frame
    sized, dense = names, 0  # a table and its _dense count
    known_in, known_ids = names, b""  # a table and a small commit's ids found in it (the next commit's, likely)
    prior, unknown = b"", 0
    with path.open("rb", buffering=0) as file:
        read = file if index.tail is None else Overlaid(file, *index.tail)  # (the first pass's stage, as it read it)
        source = FrameSource(read, index.size, reuse=True)  # what is kept of it is copied (keep)
        for start, span, k in source.frames(None, index.long, runs=True, sound=index.sound):
            run = _alike(start, span, k, breaks) if k > 1 else None
            if run is not None:
                prior, missing, shape, rows = b"", 0, None, None
                if decode:
                    if span[0] == S_FRAME:  # a view of the span read: copied ("P" rows are decoded already)
                        run = run_of(source.keep(span), k)
                    rows = run["rows"]
                    if names is not sized:
                        sized, dense = names, _dense(names)
                    missing, shape = _missing(rows[0]["id"], names, dense), shape_bytes(rows[0])
                kept: list[int] = []
                first, steps = timeline.new_segment, run["step"].tolist()
                if runs and rows is not None and timeline.take_all(run["step"], steps):  # every one kept, nth 0
                    unknown += missing * k
                    yield RunItem(steps, first, RawPart(rows, _NO_RESTS, names, shape))
                    continue
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
            for pos, payload in split_run(start, span, k):
                if phantoms and pos in phantoms:  # commits lost to damage, counted (empty) where they were
                    yield from _empties(timeline, phantoms[pos], names, decode, failed=False, counted=False,
                                        tail=pos in index.tails)
                kind = bytes(payload[:1])
                header, prior = prior, (bytes(payload) if kind == b"H" else b"")
                if kind == b"H":
                    if prior != header and pos not in bad:
                        names, timeline.new_segment = {}, True
                elif kind == b"N" and decode:
                    if names is not table or payload != body:  # a checkpoint repeating the table keeps it (and its id)
                        names = _names(payload[1:], names)[0]  # an error was reported by the first pass
                        table, body = names, bytes(payload)
                elif kind == b"L" and pos not in bad:  # failed commits: empty ones, so windows count them
                    yield from _empties(timeline, lost_steps(payload[1:]), names, decode, failed=True)
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

    def take_all(self, array: Any, steps: list[int]) -> bool:
        """:meth:`take` of each of a run's ``steps`` (``array``: the same, as an array) at once, where it keeps every
        one of them with ``nth`` 0 (no later segment replaces any of them, the steps rise, the first is not the last
        one taken): True. Else False, and nothing was taken (take them one at a time)."""
        limits, at, end = self._limits, self._limit(self._ordinal), self._ordinal + len(steps)
        if at < len(limits) and (limits[at][0] < end or steps[-1] >= limits[at][1]):
            return False
        if steps[0] == self._last or not bool((array[1:] > array[:-1]).all()):
            return False
        self._at, self._ordinal, self._nth, self._last, self.new_segment = at, end, 0, steps[-1], False
        return True

    def take(self, step: int, *, counted: bool = True, tail: bool = False) -> tuple[int, bool] | None:
        """The next commit, at ``step``: ``(nth, starts a segment)``, or None where a later segment (or a step
        going back) replaces it. ``counted`` False: a commit lost to damage (the first pass did not count it), in
        the segment of the commit read after it, or (``tail``) of the commits read before it: then a reset by the
        commit read next replaces it too."""
        limits, at = self._limits, self._limit(self._ordinal - tail)
        self._at = at
        starts, self.new_segment = self.new_segment, False
        self._ordinal += counted
        if at < len(limits) and step >= limits[at][1]:
            return None
        self._nth = self._nth + 1 if step == self._last else 0
        self._last = step
        return self._nth, starts

    def _limit(self, ordinal: int) -> int:
        """The index of the limit that applies to the commit of ``ordinal`` (``len(limits)``: none), from the last
        one found on (commits are read in order)."""
        limits, at = self._limits, self._at
        while at < len(limits) and limits[at][0] <= ordinal:
            at += 1
        return at


def _alike(start: int, span: memoryview, k: int, bad: Container[int]) -> Any:
    """:func:`run_of` a run whose commits all have the same ranks and name ids and none unreadable; else None."""
    stride = (len(span) + FRAME.size) // k
    if bad and any(start + i * stride in bad for i in range(k)):
        return None
    run = run_array(span, k)
    if run is None or span[0] != S_FRAME:  # (a run of "P" frames shares its head: its ranks and ids)
        return run
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
