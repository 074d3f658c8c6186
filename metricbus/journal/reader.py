"""Reading: one rank file (torn and damaged frames skipped with a warning), or a whole journal merged by step.

Every frame carries a CRC32: a torn or damaged frame is skipped with a :class:`JournalWarning`, and the reader
resynchronises on the next valid frame. Of two identical adjacent headers (format 3 writes each twice) one is kept;
"G" frames (commits a writer failed to journal, or wrote without an fsync that succeeded) are collected in
``Journal.gaps``; a commit the file holds is replayed either way.

One timeline. Each header starts a *segment* (a writer: the first run, then each ``resume``). A segment's first
commit at step ``S`` replaces everything the file held at steps ``>= S`` (a resume from a checkpoint at ``S``), and
commits of one segment at the same step (training, then evaluation) are kept in order. So ``Journal.commits`` is
one timeline: steps ``< S`` from before, ``>= S`` from the new segment; ``Journal.breaks`` holds the index of each
segment's first commit there (a ``log_every`` window never spans two segments: replay emits the open one first).

Streaming. :func:`stream_journal` reads a journal of any length in bounded memory: a first pass over each file
reads frame headers, headers, gaps and the step of each commit (no entry is decoded) and keeps O(segments): the
*resets* (a commit that drops the file's later steps: a segment's first commit, or a step going back) with the
running minimum of their steps, so that a commit is kept iff its step is below the steps of every later reset.
:meth:`JournalStream.commits` then merges one generator per file (files are read a chunk at a time, a commit
decoded when it is reached; :mod:`~metricbus.journal.scan`) by ``(step, n-th commit of that step)``.
:func:`read_journal` is that stream collected.

Files of every format up to ``FORMAT_VERSION`` are read; a newer one is refused with a
:class:`~metricbus.errors.JournalError` that says to upgrade. In a directory, a rank file that cannot be read at all
(empty, foreign, no readable header), or one another run wrote (its last header's run id is not the one most
files hold), is skipped with a :class:`JournalWarning` naming it and why, and listed in ``Journal.skipped``; the other
ranks are read. A directory where no file is readable, or a single file path that is unreadable, is a
``JournalError``.

Damage in the middle of a rank file (a flipped byte) loses the commits of the frames it hit: the steps between the
commit read before it and the one read after it that other files hold are listed in ``short`` and ``holes`` and named
in a :class:`JournalWarning`, as a rank cut short is (they are replayed without that rank's records); so is a
commit lost at the step of either of those two, where another file keeps more commits at that step
(:func:`count_lost`: it is counted in its place, empty, so the commits after it merge with their own).

Ranks cut short. Every torch.distributed rank journals every commit (an empty one too), after the commit's
collectives. A rank stopped in between (SIGKILL, OOM) leaves its file without the steps the other ranks' files hold
after it, in the same segment (the writers that started at the same step): those steps are then replayed without
that rank's records, where live may have emitted them with its records (a file ending with fewer commits at its
last step than another, the rank stopped between a step's two commits, is cut short from that step: ``within``).
They are listed in ``short`` (one
:class:`Gap` per rank and stretch; ``metricbus inspect`` shows them) and a :class:`JournalWarning` names them. A rank
absent from a later segment (a run resumed with fewer ranks) is not cut short.
"""

from __future__ import annotations

import heapq
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from metricbus.adapter import RunInfo
from metricbus.errors import JournalError, JournalWarning
from metricbus.journal.format import SUFFIX, rank_file, run_from_json, spec_from_json
from metricbus.journal.frames import ENTRY_DTYPE
from metricbus.journal.lost import lost_commits
from metricbus.journal.scan import (
    Entry,
    FileCommit,
    FileIndex,
    FileItem,
    Gap,
    RankFile,
    RawPart,
    RunItem,
    UnreadableError,
    entries_of,
    failed_write,
    file_commits,
    file_runs,
    index_file,
    joined_spans,
    limits_of,
)
from metricbus.partial import Partial
from metricbus.spec import Spec

__all__ = ["ENTRY_DTYPE", "Commit", "CommitRun", "FileCommit", "Gap", "Journal", "JournalStream", "Outline", "RankFile",
           "RawPart", "read_journal", "read_rank_file", "stream_journal", "timeline"]

class Commit:
    """One commit of the timeline: ``step``, ``starts_segment`` (a resumed writer's first commit; never the first
    commit of the timeline), and its per-rank partials, decoded from ``parts`` (:class:`RawPart`, one per rank file
    that holds the commit, in file order) on first access. ``ranks[i]`` is the rank of ``partials[i]`` (a
    :class:`Journal`'s commits, already decoded, have no parts and no ranks: the Journal keeps its ranks)."""

    __slots__ = ("_decoded", "_failed", "parts", "starts_segment", "step")

    def __init__(
        self, step: int, parts: tuple[RawPart, ...], *, starts_segment: bool, partials: list[Partial] | None = None,
        failed: bool = False,
    ) -> None:
        self.step = step
        self.parts = parts
        self.starts_segment = starts_segment
        self._decoded: tuple[list[int], list[Partial]] | None = None if partials is None else ([], partials)
        self._failed = failed

    @property
    def failed(self) -> bool:
        """The commit's journal write failed in every rank file that holds it (an "L" frame lists it; a disk was
        full): it is in the timeline, empty, so ``log_every`` windows stay the live ones, but none of its records
        is in the journal. False for a commit read without decoding (``commits(decode=False)``)."""
        return self._failed or (bool(self.parts) and all(failed_write(part) for part in self.parts))

    def _decode(self) -> tuple[list[int], list[Partial]]:
        if self._decoded is None:
            merged: dict[int, list[Entry]] = {}
            for part in self.parts:  # a later file's entries of one rank replace an earlier one's
                merged.update(entries_of(part))
            ranks = sorted(merged)
            self._decoded = ranks, [Partial(tuple(merged[r])) for r in ranks]
        return self._decoded

    @property
    def ranks(self) -> list[int]:
        """The ranks with entries in this commit, ascending."""
        return self._decode()[0]

    @property
    def partials(self) -> list[Partial]:
        """Each rank's partial, in rank order."""
        return self._decode()[1]


class CommitRun(NamedTuple):
    """Commits one after the other in a journal of one rank file whose rows have one shape (the same ranks and name
    ids, no rests), for a vectorized consumer (:meth:`JournalStream.runs`): each one's step, whether the first
    starts a segment, and their rows as one ``(len(steps), n)`` array (``part.rows``)."""

    steps: list[int]
    starts_segment: bool
    part: RawPart

    def commits(self) -> Iterator[Commit]:
        """Each of them as a :class:`Commit`."""
        rows, rests, names, shape = self.part
        for i, step in enumerate(self.steps):
            yield Commit(step, (RawPart(rows[i], rests, names, shape),), starts_segment=self.starts_segment and not i)

    def head(self, n: int) -> CommitRun:
        """The first ``n`` of them."""
        rows, rests, names, shape = self.part
        return CommitRun(self.steps[:n], self.starts_segment, RawPart(rows[:n], rests, names, shape))


def read_rank_file(path: str | os.PathLike[str]) -> RankFile:
    """Read one journal file with its commits; raise JournalError if it is missing, foreign or from a newer format."""
    index = index_file(Path(path))
    index.file.commits = [
        FileCommit(step, entries_of(part), starts) for step, _, starts, part in file_commits(index, decode=True)
        if part is not None
    ]
    return index.file


# -- a whole journal -------------------------------------------------------------------------------------------------


class _Meta:
    """What a journal's header says (shared by :class:`Journal` and :class:`JournalStream`)."""

    header: dict[str, Any]

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


@dataclass(frozen=True, slots=True)
class Outline:
    """The timeline's shape, from a pass that decodes no entry: commits, first and last step, segments."""

    commits: int
    first_step: int | None
    last_step: int | None
    segments: int


class JournalStream(_Meta):
    """A journal read in bounded memory (see the module docstring); made by :func:`stream_journal`.

    Known at once (from the first pass): ``directory``, ``header`` (the lowest rank's last header), ``files``
    (:class:`RankFile` with headers, damage and gaps; no commits), ``gaps``, ``short`` (ranks cut short, see the
    module docstring), ``skipped`` and ``last_step``.
    :meth:`commits` yields the timeline (each call reads the files again); :meth:`outline` counts it.
    """

    def __init__(self, directory: Path, indexes: list[FileIndex], skipped: list[tuple[Path, str]]) -> None:
        self.directory = directory
        self._indexes = indexes
        self.files = [ix.file for ix in indexes]
        self.skipped = skipped
        self.gaps = _merge_gaps(self.files)
        stale = replace_across(indexes)  # the files whose last commit another file's resume replaced
        short, stops, within = cut_short(indexes)
        for rank, final in count_lost(indexes, stops):  # also lacks commits at its last step: cut short from there
            short = [Gap(rank, final, g.last_step) if g.rank == rank and g.first_step == final + 1 else g
                     for g in short]
            within.add((rank, final))
        self.holes = damaged_short(indexes)
        self.short = sorted([*short, *self.holes], key=lambda g: (g.rank, g.first_step))
        # (rank, step) of each gap of ``short`` that starts inside a step: that rank's file stops there, with fewer
        # commits than another file holds at that step (the rank stopped between its training and evaluation commits)
        self.within = frozenset(within)
        first = min(self.files, key=lambda rf: int(rf.headers[0].get("rank", 0)))
        self.header = first.headers[-1]
        steps = [ix.last_step for i, ix in enumerate(indexes) if ix.last_step is not None and i not in stale]
        self.last_step: int | None = max(steps) if steps else None  # (else a file's last commit is kept)

    def commits(self, *, decode: bool = True) -> Iterator[Commit]:
        """The timeline, one :class:`Commit` at a time (``decode`` False: steps and segments only, no parts).

        Holds one pending commit per rank file (and the one being merged): memory does not grow with the journal.
        """
        files = [file_commits(ix, decode=decode) for ix in self._indexes]
        if len(files) == 1:  # one file: each of its items is a commit of its own (nth counts a step's commits)
            for index, (step, _, first, part) in enumerate(files[0]):
                yield Commit(step, () if part is None else (part,), starts_segment=first and index > 0)
            return
        merged = heapq.merge(*files, key=_key)
        key: tuple[int, int] | None = None
        parts: list[RawPart] = []
        starts, index = False, 0
        for step, nth, first, part in merged:  # heapq.merge is stable: equal keys come in file order
            if (step, nth) != key:
                if key is not None:
                    yield Commit(key[0], tuple(parts), starts_segment=starts and index > 0)
                    index += 1
                key, parts, starts = (step, nth), [], False
            starts = starts or first
            if part is not None:
                parts.append(part)
        if key is not None:
            yield Commit(key[0], tuple(parts), starts_segment=starts and index > 0)

    def runs(self) -> Iterator[Commit | CommitRun]:
        """:meth:`commits`, except that in a journal of one rank file, commits of one shape one after the other come
        together as a :class:`CommitRun` (read as one array, never as one Commit each)."""
        if len(self._indexes) > 1:
            yield from self.commits()
            return
        index = 0
        for item in file_runs(self._indexes[0]):
            if isinstance(item, RunItem):
                yield CommitRun(item.steps, item.starts and index > 0, item.part)
                index += len(item.steps)
            else:
                step, _, first, part = item
                yield Commit(step, () if part is None else (part,), starts_segment=first and index > 0)
                index += 1

    @cached_property
    def _outline(self) -> Outline:
        count, first, last, segments = 0, None, None, 0
        for commit in self.commits(decode=False):
            count += 1
            first = commit.step if first is None else first
            last = commit.step
            segments += commit.starts_segment
        return Outline(count, first, last, segments + (count > 0))

    def outline(self) -> Outline:
        """Commits, first and last step and segments of the timeline (one pass over frame headers; cached)."""
        return self._outline

    def __len__(self) -> int:
        return self._outline.commits


def _run_id(index: FileIndex) -> str | None:
    """The run a rank file's last writer wrote (None where its header names none: such a file is not judged)."""
    run = index.file.headers[-1].get("run")
    value = run.get("id") if isinstance(run, dict) else None
    return value if isinstance(value, str) and value else None


def _one_run(indexes: list[FileIndex], skipped: list[tuple[Path, str]]) -> list[FileIndex]:
    """The files of the journal's run; a file another run wrote (copied or left in the folder) is added to
    ``skipped``: merged, its entries would replace those of the rank its header names at the steps both hold.
    Every writer of a run, resumed or not, writes its id; the journal's run is the one most files hold (on a tie,
    the lowest rank file's)."""
    ids = [_run_id(ix) for ix in indexes]
    held = [i for i in ids if i is not None]
    if len(set(held)) < 2:
        return indexes
    ours = max(dict.fromkeys(held), key=held.count)  # first seen wins a tie (files are in rank order)
    kept = []
    for index, theirs in zip(indexes, ids, strict=True):
        if theirs is None or theirs == ours:
            kept.append(index)
        else:
            skipped.append((index.file.path, f"{index.file.path} was written by run {theirs!r}, the journal's other "
                            f"files by run {ours!r} (a file of another run in this folder: move it out)"))
    return kept


def _missing_ranks(directory: Path, indexes: list[FileIndex], paths: list[Path]) -> list[tuple[Path, str]]:
    """The rank files the run's headers say it journaled (``world``: a torch.distributed group's size, one file per
    rank) that ``directory`` lacks (``paths``: the files it holds), as ``skipped`` entries: replayed without them,
    the steps they journaled may differ from live."""
    worlds = [h.get("world") for ix in indexes for h in ix.file.headers]
    world = max((w for w in worlds if isinstance(w, int)), default=0)  # 0: no header says (no torch.distributed)
    names = {path.name for path in paths}
    out = []
    for rank in range(world):
        path = rank_file(directory, rank)
        if path.name not in names:
            out.append((path, f"{path.name} is missing, where the run's headers say {world} ranks journaled a file "
                        "each: the steps it journaled are replayed without that rank's records, so live may have "
                        "emitted other values there (put the file back, if it was moved)"))
    return out


def _key(item: FileItem) -> tuple[int, int]:
    return item[0], item[1]


def stream_journal(directory: str | os.PathLike[str]) -> JournalStream:
    """Open ``directory`` (or a single ``.mbj`` file) for streaming: the first pass over every rank file, with
    its warnings; JournalError if nothing is readable."""
    directory = Path(directory)
    if directory.is_file():
        paths = [directory]
    elif directory.is_dir():
        paths = sorted(directory.glob(f"rank-*{SUFFIX}"))
        if not paths:
            raise JournalError(f"{directory} holds no journal files (rank-*{SUFFIX})")
    else:
        raise JournalError(f"no journal at {directory}")
    indexes: list[FileIndex] = []
    skipped: list[tuple[Path, str]] = []
    for path in paths:
        try:
            indexes.append(index_file(path))
        except UnreadableError as exc:
            if directory.is_file():
                raise
            skipped.append((path, str(exc)))
    if not indexes:
        raise UnreadableError(
            f"{directory} holds no readable journal file: " + "; ".join(why for _, why in skipped)
        )
    indexes = _one_run(indexes, skipped)
    if directory.is_dir():
        skipped.extend(_missing_ranks(directory, indexes, paths))
    for path, why in skipped:
        warnings.warn(f"journal {path}: skipped, the other ranks are read ({why})", JournalWarning, stacklevel=2)
    stream = JournalStream(directory, indexes, skipped)
    holes = set(stream.holes)
    alone = len(stream.files) == 1
    for gap in stream.short:
        first, final = gap.first_step, gap.last_step
        steps = f"step {first}" if first == final else f"steps {first}..{final}"
        warnings.warn(
            f"journal {directory}: the file lost its commits at {steps} to damaged bytes (the steps between the "
            "commits read around them; where steps jump, some may never have been committed): their records are not "
            "replayed, so those steps are missing or hold other values than live emitted"
            if gap in holes and alone
            else f"journal {directory}: rank {gap.rank}'s file lost its commits at {steps} to damaged bytes, where "
            "the other ranks' files hold them: those steps are replayed without its records, so live may have "
            "emitted other values there"
            if gap in holes
            else f"journal {directory}: rank {gap.rank}'s file stops inside step {first}, with fewer commits there "
            f"than the other ranks' files, which go on to step {final} in the same segment (the rank stopped between "
            "two commits, or its last frames were lost): " + ("that step is" if first == final else "those steps are")
            + " replayed without its records, so live may have emitted other values there"
            if (gap.rank, first) in stream.within
            else f"journal {directory}: rank {gap.rank}'s file stops at step {gap.first_step - 1} where the other "
            f"ranks' files go on to step {gap.last_step} in the same segment (the rank stopped between a commit's "
            "collectives and its journal write, or its last frames were lost): those steps are replayed without its "
            "records, so live may have emitted other values there",
            JournalWarning,
            stacklevel=2,
        )
    if alone:
        for lost in lost_commits(indexes[0]):
            steps = " or ".join(f"step {step}" for step in lost.steps)
            held = f" (of {', '.join(lost.metrics)})" if lost.metrics else ""
            warnings.warn(
                f"journal {directory}: a commit at {steps}{held} was in damaged bytes (between the commits read at "
                f"steps {lost.before} and {lost.after}; the step holds fewer commits than most steps): it is not "
                "replayed, so " + ("that step is" if len(lost.steps) == 1 else "one of those steps is")
                + " missing its values",
                JournalWarning,
                stacklevel=2,
            )
    return stream


@dataclass
class Journal(_Meta):
    """A whole journal directory in memory: header of the lowest rank, and every commit's partials in rank order.

    ``commits``: the timeline, in step order (a step may hold several commits); ``breaks``: the indexes in
    ``commits`` where a segment (a resumed writer) starts; ``failed``: the indexes in ``commits`` of the commits
    whose journal write failed (:attr:`Commit.failed`: empty, counted); ``gaps``: the commits some writer failed
    to journal, or wrote without an fsync that succeeded (their step may still hold other ranks' partials, or this
    one's); ``skipped``: the rank files that could not be read at all.
    """

    directory: Path
    header: dict[str, Any]
    files: list[RankFile]
    commits: list[tuple[int, list[Partial]]]
    ranks: list[int]
    gaps: list[Gap] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    breaks: frozenset[int] = frozenset()
    short: list[Gap] = field(default_factory=list)  # ranks cut short (see the module docstring)
    failed: frozenset[int] = frozenset()
    holes: list[Gap] = field(default_factory=list)  # those of ``short`` lost to damage mid-segment
    within: frozenset[tuple[int, int]] = frozenset()  # as JournalStream.within

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
                       self.skipped, frozenset(i for i in self.breaks if i < keep), self.short,
                       frozenset(i for i in self.failed if i < keep), self.holes, self.within)

    def __len__(self) -> int:
        return len(self.commits)

    def metrics(self) -> dict[str, Spec]:
        """Every metric journaled and its spec (the last one seen)."""
        out: dict[str, Spec] = {}
        for _, partials in self.commits:
            for partial in partials:
                for name, spec, _ in partial.entries:
                    out[name] = spec
        return dict(sorted(out.items()))


def timeline(source: Journal | JournalStream) -> Iterator[Commit]:
    """The commits of either form (a :class:`Journal`'s wrap its partials)."""
    if isinstance(source, JournalStream):
        yield from source.commits()
        return
    for i, (step, partials) in enumerate(source.commits):
        yield Commit(step, (), starts_segment=i in source.breaks, partials=partials, failed=i in source.failed)


def read_journal(directory: str | os.PathLike[str]) -> Journal:
    """Read every rank file of ``directory`` (or a single ``.mbj`` file) and merge them by step and rank (the whole
    timeline in memory: :func:`stream_journal` reads one commit at a time)."""
    stream = stream_journal(directory)
    commits: list[tuple[int, list[Partial]]] = []
    breaks: set[int] = set()
    failed: set[int] = set()
    ranks: set[int] = set()
    for i, commit in enumerate(stream.commits()):
        commits.append((commit.step, commit.partials))
        ranks.update(commit.ranks)
        if commit.starts_segment:
            breaks.add(i)
        if commit.failed:
            failed.add(i)
    return Journal(stream.directory, stream.header, stream.files, commits, sorted(ranks), stream.gaps,
                   stream.skipped, frozenset(breaks), stream.short, frozenset(failed), stream.holes, stream.within)


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


def replace_across(indexes: list[FileIndex]) -> set[int]:
    """Make a resume replace steps in every file: a resume (a file's segment after its first) starting at step
    ``S`` that no later reset of its own file replaced drops, in each other file that did not take part in it (a
    rank absent from the resumed run), the steps ``>= S`` of that file's segments before the resume. Sets each
    file's ``limits`` again; returns the files whose last commit is dropped so.

    Which segments of two files were one resumed run is read off :func:`sessions`; where a file's segments cannot
    be matched so (a journal written before this version, where several resumes started at one step), a file took
    part in the resume if it has a segment starting at ``S`` or later, and its segments from the first one of them on
    are taken for not before the resume."""
    if len(indexes) < 2:
        return set()
    runs = sessions(indexes)
    live: list[tuple[int, int, int | None]] = []  # (file, step, session) of the resumes (later segments) that stand
    for i, ix in enumerate(indexes):
        ours = runs[i]
        for k, (start, _, at) in enumerate(ix.segments):
            if k and all(step > start for ordinal, step in ix.resets if ordinal > at):  # (the first: no resume)
                live.append((i, start, None if ours is None else ours[k]))
    stale: set[int] = set()
    for j, ix in enumerate(indexes):
        extra: list[tuple[int, int]] = []
        ours = runs[j]
        for i, start, session in live:
            if i == j:
                continue
            if session is not None and ours is not None:
                if session in ours:
                    continue  # this rank took part in that resume: its own segment replaced its steps
                # the first segment of this file after the resume's run: it and what follows are not before it
                until = next((at for (_, _, at), s in zip(ix.segments, ours, strict=True) if s > session), ix.commits)
            else:  # the first segment of this file starting at ``start`` or later (this rank took part in it, or in a
                until = next((at for first, _, at in ix.segments if first >= start), ix.commits)  # later one)
            if any(start <= final for _, final, at in ix.segments if at < until):
                extra.append((until, start))
                if until == ix.commits and ix.last_step is not None and ix.last_step >= start:
                    stale.add(j)
        if extra:
            ix.limits = limits_of(sorted([*ix.resets, *extra]))
    return stale


def sessions(indexes: list[FileIndex]) -> list[list[int] | None]:
    """Per file, the run (the first one, then each resume) that wrote each of its segments, as the index of that
    run's segment in the file with the most segments, the *reference* (the lowest rank's: torch.distributed ranks are
    ``0 .. world-1``, so every run that journaled anything wrote rank 0's file); None for a file whose segments do
    not match the reference's in order by their first steps (a damaged file), or where a header lacks the time its
    writer opened the file (``opened_unix_ns``: written before this version).

    A file's segments are matched in order to reference segments starting at the same step; where several could be
    a segment's (resumes from one checkpoint, each on other ranks: ranks 0 and 1 resumed at step 5 and killed, then
    rank 0 alone at step 5 again), the one whose writer opened its file nearest in time (the ranks of one run open
    their files together, and a run starts after the one before it ended; the later one on a tie)."""
    ref = max(range(len(indexes)), key=lambda i: len(indexes[i].segments))  # (the first on a tie: lowest rank)
    base = indexes[ref]
    return [list(range(len(base.segments))) if i == ref and None not in base.opened else _matched(ix, base)
            for i, ix in enumerate(indexes)]


def _matched(ix: FileIndex, base: FileIndex) -> list[int] | None:
    """The reference segment of each of ``ix``'s segments (:func:`sessions`), or None where they do not match."""
    ours, theirs = ix.segments, base.segments
    mine, when = [t for t in ix.opened if t is not None], [t for t in base.opened if t is not None]
    if len(mine) < len(ours) or len(when) < len(theirs):
        return None
    latest = [0] * len(ours)  # the last reference segment each can match with the ones after it still matched
    p = len(theirs)
    for k in range(len(ours) - 1, -1, -1):
        p -= 1
        while p >= 0 and theirs[p][0] != ours[k][0]:
            p -= 1
        if p < 0:
            return None
        latest[k] = p
    out: list[int] = []
    low = 0
    for k, (first, _, _) in enumerate(ours):
        candidates = [p for p in range(low, latest[k] + 1) if theirs[p][0] == first]  # (latest[k] is one)
        chosen = min(candidates, key=lambda p: (abs(when[p] - mine[k]), -p))
        out.append(chosen)
        low = chosen + 1
    return out


def count_lost(indexes: list[FileIndex], stops: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Find the commits a rank file lost to damage at the steps of the commits read around the damage
    (``FileIndex.mends``): a step's second commit (evaluation after training), or its first one. Where another file
    keeps more commits at such a step than this one, the missing ones are added to this file's ``holes`` and counted
    where they were, as empty commits (``FileIndex.phantoms``): so the commit read after the damage merges with the
    other files' commit of its own place at that step (their evaluation with its evaluation, not with their
    training), and the step is named as lost. Returns ``(rank, step)`` of each of ``stops`` (:func:`cut_short`)
    whose file holds fewer commits at its last step than another file. One more pass over the frame headers of
    every file, only where a journal of several files has such damage or a rank cut short."""
    if len(indexes) < 2 or not (stops or any(ix.mends for ix in indexes)):
        return []
    wanted = {step for ix in indexes for before, after, _ in ix.mends for step in (before, after) if step is not None}
    wanted.update(step for _, _, step in stops)
    counts: list[dict[int, int]] = []
    for ix in indexes:
        count: dict[int, int] = {}
        for step, _, _, _ in file_commits(ix, decode=False):
            if step in wanted:
                count[step] = count.get(step, 0) + 1
        counts.append(count)
    for i, ix in enumerate(indexes):
        for before, after, at in ix.mends:
            lost: list[int] = []
            for step in (before, after) if before is not None and before != after else (after,):
                most = max(c.get(step, 0) for j, c in enumerate(counts) if j != i)
                lost.extend([step] * (most - counts[i].get(step, 0)))
            if lost:
                ix.phantoms.setdefault(at, []).extend(lost)
                ix.holes.extend((step, step) for step in dict.fromkeys(lost))
        ix.holes = joined_spans(ix.holes)
    return [(rank, step) for i, rank, step in stops
            if counts[i].get(step, 0) < max(c.get(step, 0) for j, c in enumerate(counts) if j != i)]


def damaged_short(indexes: list[FileIndex]) -> list[Gap]:
    """The steps a rank file lost to damage in the middle of a segment (``FileIndex.holes``) that another file's
    segments hold (as :func:`cut_short`, by the segments' first and last steps): replayed without that rank. In a
    journal of one file, every step it lost (between the commits read around the damage; exact where a ``log_every``
    window's "W" frame lists them): not replayed, the whole run's records there were in those commits."""
    if len(indexes) == 1:
        ix = indexes[0]
        rank = int(ix.file.headers[-1].get("rank", 0))
        return [Gap(rank, low, high) for low, high in joined_spans(ix.holes)]
    out: list[Gap] = []
    for i, ix in enumerate(indexes):
        rank = int(ix.file.headers[-1].get("rank", i))
        for low, high in ix.holes:
            spans = sorted(
                (max(low, first), min(high, final))
                for j, other in enumerate(indexes)
                if j != i
                for first, final, _ in other.segments
                if first <= high and final >= low
            )
            merged: list[list[int]] = []
            for a, b in spans:
                if merged and a <= merged[-1][1] + 1:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            out.extend(Gap(rank, a, b) for a, b in merged)
    return out


def cut_short(indexes: list[FileIndex]) -> tuple[list[Gap], list[tuple[int, int, int]], set[tuple[int, int]]]:
    """The steps each rank file lacks that another file holds in a segment both started at the same step, before
    any segment (of any file) starting at or below them replaced them (see the module docstring); ``(file, rank,
    step)`` of each file cut short, its segment's last step (whose commits :func:`count_lost` compares); and
    ``(rank, step)`` of each file that ends at the others' last step with fewer commits there (the rank stopped
    between a step's training and evaluation commits, or its last frame was lost): cut short at that step."""
    if len(indexes) < 2:
        return [], [], set()
    starts = sorted({first for ix in indexes for first, _, _ in ix.segments})
    out: list[Gap] = []
    stops: list[tuple[int, int, int]] = []
    within: set[tuple[int, int]] = set()
    for start in starts:
        finals = {i: [(final, ix.finals[k]) for k, (first, final, _) in enumerate(ix.segments) if first == start]
                  for i, ix in enumerate(indexes)}
        most = max(len(f) for f in finals.values())
        # a file with fewer writers starting here than another missed the latest (a resume at the same step with
        # fewer ranks, or ranks added by an earlier one): which writer its segment was is unknown, so it is not compared
        ends = {i: f[-1] for i, f in finals.items() if len(f) == most}
        if len(ends) < 2:
            continue
        latest = max(final for final, _ in ends.values())
        later = [s for s in starts if start < s <= latest]
        if later:  # a later segment (a resume at that step) replaced the steps from there on
            latest = later[0] - 1
        full = max((n for final, n in ends.values() if final == latest), default=0)
        for i, (final, n) in ends.items():
            rank = int(indexes[i].file.headers[-1].get("rank", i))
            if final < latest:
                out.append(Gap(rank, final + 1, latest))
                stops.append((i, rank, final))
            elif final == latest and n < full and not later:
                out.append(Gap(rank, final, latest))
                within.add((rank, final))
    return sorted(out, key=lambda g: (g.rank, g.first_step)), stops, within
