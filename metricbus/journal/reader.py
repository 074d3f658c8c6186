"""Reading: one rank file (torn and damaged frames skipped with a warning), or a whole journal merged by step.

Every frame carries a CRC32: a torn or damaged frame is skipped with a :class:`JournalWarning`, and the reader
resynchronises on the next valid frame. Of two identical adjacent headers (format 3 writes each twice) one is kept;
"G" frames (commits a writer failed to journal) are collected in ``Journal.gaps`` and replay skips them.

One timeline. Each header starts a *segment* (a writer: the first run, then each ``resume``). A segment's first
commit at step ``S`` replaces everything the file held at steps ``>= S`` (a resume from a checkpoint at ``S``), and
commits of one segment at the same step (training, then evaluation) are kept in order. So ``Journal.commits`` is
one timeline: steps ``< S`` from before, ``>= S`` from the new segment; ``Journal.breaks`` holds the index of each
segment's first commit there (a ``log_every`` window never spans two segments: replay emits the open one first).

Files of every format up to ``FORMAT_VERSION`` are read; a newer one is refused with a
:class:`~metricbus.errors.JournalError` that says to upgrade. In a directory, a rank file that cannot be read at all
(empty, foreign, no readable header) is skipped with a :class:`JournalWarning` naming it and why, and listed in
``Journal.skipped``; the other ranks are read. A directory where no file is readable, or a single file path that is
unreadable, is a ``JournalError``.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metricbus.adapter import RunInfo
from metricbus.errors import JournalError, JournalWarning
from metricbus.journal.format import (
    FORMAT_VERSION,
    FRAME,
    FRAME_TYPES,
    GAP,
    MAGIC,
    MAX_FRAME,
    SUFFIX,
    run_from_json,
    spec_from_json,
    unpack_commit,
)
from metricbus.partial import Partial
from metricbus.spec import Spec
from metricbus.summary import Summary

Entry = tuple[str, Spec, Summary]
_MAGIC_SLACK = 2  # a magic with at most this many wrong bytes is damage, not a foreign file


class _UnreadableError(JournalError):
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
    """What one journal file holds: its headers and its timeline of commits (see the module docstring)."""

    path: Path
    headers: list[dict[str, Any]] = field(default_factory=list)
    commits: list[FileCommit] = field(default_factory=list)
    damaged: int = 0
    gaps: list[Gap] = field(default_factory=list)

    def add(self, step: int, ranks: dict[int, list[Entry]], *, new_segment: bool) -> None:
        """Append a commit; a segment's first commit (or any step going back) drops the commits at steps >= it."""
        commits = self.commits
        if commits and (new_segment or step < commits[-1].step):
            keep = len(commits)
            while keep and commits[keep - 1].step >= step:
                keep -= 1
            if keep < len(commits):
                del commits[keep:]
                self.gaps = [g for g in (_clip(g, step) for g in self.gaps) if g is not None]
        commits.append(FileCommit(step, ranks, new_segment))


def _clip(gap: Gap, step: int) -> Gap | None:
    """``gap`` without its steps ``>= step`` (None: nothing left)."""
    if gap.first_step >= step:
        return None
    return Gap(gap.rank, gap.first_step, min(gap.last_step, step - 1))


def _warn(path: Path, what: str) -> None:
    warnings.warn(f"journal {path}: {what}", JournalWarning, stacklevel=3)


def _frames(path: Path, data: bytes, rf: RankFile) -> Iterator[tuple[int, bytes]]:
    pos, end = len(MAGIC), len(data)
    while pos < end:
        if pos + FRAME.size <= end:
            length, crc = FRAME.unpack_from(data, pos)
            stop = pos + FRAME.size + length
            if 0 < length <= MAX_FRAME and stop <= end:
                payload = data[pos + FRAME.size : stop]
                if zlib.crc32(payload) == crc:
                    yield pos, payload
                    pos = stop
                    continue
        rf.damaged += 1
        resume = _resync(data, pos + 1)
        if resume is None:
            _warn(path, f"torn or damaged record at byte {pos}; skipped the last {end - pos} bytes")
            return
        _warn(path, f"damaged record at byte {pos}; skipped {resume - pos} bytes")
        pos = resume


def _resync(data: bytes, pos: int) -> int | None:
    """The next offset where a whole frame with a valid CRC starts."""
    end = len(data)
    while pos + FRAME.size < end:
        length, crc = FRAME.unpack_from(data, pos)
        stop = pos + FRAME.size + length
        if (
            0 < length <= MAX_FRAME
            and stop <= end
            and data[pos + FRAME.size] in FRAME_TYPES
            and zlib.crc32(data[pos + FRAME.size : stop]) == crc
        ):
            return pos
        pos += 1
    return None


def _check_header(path: Path, header: Any) -> dict[str, Any]:
    if not isinstance(header, dict):
        raise TypeError(f"a header is a JSON object, not {type(header).__name__}")
    fmt = header.get("format")
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise JournalError(
            f"{path} has journal format {fmt!r}, newer than this metricbus reads ({FORMAT_VERSION}); upgrade metricbus"
        )
    return dict(header)


def _check_magic(path: Path, data: bytes) -> None:
    if data.startswith(MAGIC):
        return
    if not data:
        raise _UnreadableError(f"{path} is empty (not a metricbus journal file)")
    wrong = sum(a != b for a, b in zip(data[: len(MAGIC)], MAGIC, strict=False)) + max(0, len(MAGIC) - len(data))
    if wrong > _MAGIC_SLACK:
        raise _UnreadableError(f"{path} is not a metricbus journal file (bad magic)")
    _warn(path, f"damaged magic ({wrong} bytes); read as a journal")


def read_rank_file(path: str | os.PathLike[str]) -> RankFile:
    """Read one journal file; raise JournalError if it is missing, foreign or from a newer format."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _UnreadableError(f"cannot read journal file {path}: {exc.strerror or exc}") from exc
    _check_magic(path, data)
    rf = RankFile(path)
    names: dict[int, tuple[str, Spec]] = {}
    unknown = 0
    from_tuple = Summary.from_tuple
    previous = b""
    new_segment = False
    for pos, payload in _frames(path, data, rf):
        kind, body = payload[:1], payload[1:]
        prior, previous = previous, payload
        try:
            if kind == b"H":
                if payload == prior:
                    continue  # the second copy of the header just read
                rf.headers.append(_check_header(path, json.loads(body)))
                names = {}  # a restarted writer numbers its names afresh
                new_segment = True
            elif kind == b"N":
                for ident, name, spec, *_ in json.loads(body):  # later versions may add per-name fields
                    names[int(ident)] = (str(name), spec_from_json(spec))
            elif kind in {b"S", b"R"}:
                step, rows = unpack_commit(kind, body)
                ranks: dict[int, list[Entry]] = {}
                for rank, ident, fields, rest in rows:
                    entries = ranks.get(rank)
                    if entries is None:
                        entries = ranks[rank] = []
                    known = names.get(ident)
                    if known is None:
                        unknown += 1
                        continue
                    entries.append((known[0], known[1], from_tuple(fields, rest)))
                rf.add(step, ranks, new_segment=new_segment)  # a commit with nothing logged still counts
                new_segment = False
            elif kind == b"G":
                first, last = GAP.unpack(body)
                rank = int(rf.headers[-1].get("rank", -1)) if rf.headers else -1
                rf.gaps.append(Gap(rank, first, last))
            # other frame types: written by a newer minor version; skipped
        except JournalError:
            raise
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            rf.damaged += 1
            _warn(path, f"unreadable record at byte {pos} ({exc}); skipped")
    if not rf.headers:
        raise _UnreadableError(f"{path} has no readable journal header")
    if unknown:
        _warn(path, f"{unknown} entries refer to a lost name table record; skipped")
    return rf


@dataclass
class Journal:
    """A whole journal directory: header of the lowest rank, and every commit's partials in rank order.

    ``commits``: the timeline, in step order (a step may hold several commits); ``breaks``: the indexes in
    ``commits`` where a segment (a resumed writer) starts; ``gaps``: the commits some writer failed to journal
    (their step may still hold other ranks' partials); ``skipped``: the rank files that could not be read at all.
    """

    directory: Path
    header: dict[str, Any]
    files: list[RankFile]
    commits: list[tuple[int, list[Partial]]]
    ranks: list[int]
    gaps: list[Gap] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    breaks: frozenset[int] = frozenset()

    @property
    def last_step(self) -> int | None:
        """The step of the last commit of the timeline (None: no commit)."""
        return self.commits[-1][0] if self.commits else None

    def until(self, step: int) -> Journal:
        """This journal's timeline before ``step`` (what a resume at ``step`` keeps)."""
        keep = len(self.commits)
        while keep and self.commits[keep - 1][0] >= step:
            keep -= 1
        return Journal(self.directory, self.header, self.files, self.commits[:keep], self.ranks, self.gaps,
                       self.skipped, frozenset(i for i in self.breaks if i < keep))

    @property
    def run(self) -> RunInfo:
        """The run metadata."""
        return run_from_json(self.header.get("run", {}))

    @property
    def log_every(self) -> int:
        """The bus's log_every."""
        return int(self.header.get("log_every", 1))

    @property
    def rules(self) -> list[tuple[str, Spec]]:
        """The bus's rules when the journal was written."""
        return [(str(p), spec_from_json(s)) for p, s in self.header.get("rules", [])]

    def metrics(self) -> dict[str, Spec]:
        """Every metric journaled and its spec (the last one seen)."""
        out: dict[str, Spec] = {}
        for _, partials in self.commits:
            for partial in partials:
                for name, spec, _ in partial.entries:
                    out[name] = spec
        return dict(sorted(out.items()))


def read_journal(directory: str | os.PathLike[str]) -> Journal:
    """Read every rank file of ``directory`` (or a single ``.mbj`` file) and merge them by step and rank."""
    directory = Path(directory)
    if directory.is_file():
        paths = [directory]
    elif directory.is_dir():
        paths = sorted(directory.glob(f"rank-*{SUFFIX}"))
        if not paths:
            raise JournalError(f"{directory} holds no journal files (rank-*{SUFFIX})")
    else:
        raise JournalError(f"no journal at {directory}")
    files: list[RankFile] = []
    skipped: list[tuple[Path, str]] = []
    for path in paths:
        try:
            files.append(read_rank_file(path))
        except _UnreadableError as exc:
            if directory.is_file():
                raise
            skipped.append((path, str(exc)))
    if not files:
        raise JournalError(f"{directory} holds no readable journal file: " + "; ".join(why for _, why in skipped))
    for path, why in skipped:
        warnings.warn(f"journal {path}: skipped, the other ranks are read ({why})", JournalWarning, stacklevel=2)
    merged: dict[tuple[int, int], dict[int, list[Entry]]] = {}
    starts: set[tuple[int, int]] = set()
    for rf in files:
        seen: dict[int, int] = {}
        for commit in rf.commits:
            nth = seen[commit.step] = seen.get(commit.step, -1) + 1  # the n-th commit of this step in this file
            key = (commit.step, nth)
            merged.setdefault(key, {}).update(commit.ranks)
            if commit.starts_segment:
                starts.add(key)
    all_ranks = sorted({r for ranks in merged.values() for r in ranks})
    keys = sorted(merged)
    commits = [(step, [Partial(tuple(merged[step, nth][r])) for r in sorted(merged[step, nth])]) for step, nth in keys]
    breaks = frozenset(i for i, key in enumerate(keys) if key in starts and i > 0)
    first = min(files, key=lambda rf: int(rf.headers[0].get("rank", 0)))
    return Journal(directory, first.headers[-1], files, commits, all_ranks, _merge_gaps(files), skipped, breaks)


def _merge_gaps(files: list[RankFile]) -> list[Gap]:
    """Every file's gaps, overlapping ones of a rank merged (a retried marker repeats the start of its range)."""
    out: list[Gap] = []
    for gap in sorted((g for rf in files for g in rf.gaps), key=lambda g: (g.rank, g.first_step, g.last_step)):
        last = out[-1] if out else None
        if last is not None and last.rank == gap.rank and gap.first_step <= last.last_step:
            out[-1] = Gap(gap.rank, last.first_step, max(last.last_step, gap.last_step))
        else:
            out.append(gap)
    return out
