"""Replay's rank level, a batch of commits at a time: raw rows as packed partials, reduced side by side.

Each commit of the timeline becomes its partials (packed from the raw rows by
:class:`metricbus.journal.packed.PackedRows`, or the decoded Summaries of a single rank), and commits of several
workers are merged column-wise together (:func:`metricbus.packed_ranks.rank_levels`), at most ``_BATCH_ENTRIES``
entries at once; a commit of one worker keeps its partial, for the live single-worker path. A commit whose ranks
log the same names in the same order (a writer's commits, one after the other) is read as one
:class:`metricbus.packed_ranks.Ranks`: its layout, specs and block positions are decided once for the journal and
the commit costs a few numpy slices, with no Partial per rank. With ``log_every`` 1, runs of commits of one shape
skip all that: :mod:`metricbus.replay_columns` reduces and emits them as arrays (exact element by element); the
runs a one-file journal's reader found (:class:`~metricbus.journal.reader.CommitRun`) go there with no Commit built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from metricbus.canonical import nans
from metricbus.fixed import Array
from metricbus.journal.packed import PackedRows
from metricbus.journal.reader import Commit, CommitRun
from metricbus.packed_ranks import Ranks, Workers, rank_levels
from metricbus.partial import Partial
from metricbus.ranks import with_specs
from metricbus.reduce import Ranked, StepReducer
from metricbus.replay_columns import ColumnLayout, Layouts, run_fields
from metricbus.replay_windows import windows
from metricbus.spec import Spec

Respec = Callable[[str, Spec], Spec]
_new = tuple.__new__  # a NamedTuple built without its Python-level __new__ (one per commit of a columnar run)


class Emitted(NamedTuple):
    """A commit's emitted values, already computed by the columnar path (``log_every`` 1: nothing is pending), every
    NaN ``math.nan`` (:func:`metricbus.canonical.nans`).
    A NamedTuple: one is built per commit, and a tuple is the cheapest immutable record to build."""

    metrics: dict[str, float]


Level = Ranked | Partial | Emitted


class Stepped(NamedTuple):
    """A commit of a :class:`~metricbus.journal.reader.CommitRun` emitted by the columnar path: what replay reads of
    a commit once it is emitted (no Commit is built for it)."""

    step: int
    starts_segment: bool


Item = Commit | Stepped
Pieces = list[tuple[list[Item], Array]]  # a columnar run: commits and their rows' fields, (T, rows, N_FIELDS) each


def reduced(
    commits: Iterable[Commit | CommitRun],
    respec: Respec,
    reducer: StepReducer,
    *,
    log_every: int = 0,
) -> Iterator[list[tuple[Item, dict[str, Spec], Level]]]:
    """The timeline's commits with their specs and rank-level results, a batch at a time: commits are read from
    their raw rows as packed partials and reduced side by side (:func:`metricbus.packed_ranks.rank_levels`); at
    most ``_BATCH_ENTRIES`` entries are held. With ``log_every`` 1, runs of commits of one shape that fit the
    columnar path (:mod:`metricbus.replay_columns`) come emitted already, at most ``_COLUMN_ENTRIES`` rows a run;
    a :class:`CommitRun` that fits it goes there as one array (its commits come back as :class:`Stepped`). With a
    larger ``log_every`` so do the whole windows inside such a run (:mod:`metricbus.replay_windows`), given the phase
    of the consumer's open window, counted here: every commit counts one (a whole window merged in columns leaves
    the phase as it was), a segment's first commit starts a window (the consumer resets its reducer there)."""
    rows = PackedRows(respec)
    layouts = Layouts(respec, reducer, windows=log_every > 1) if log_every >= 1 else None
    seen: dict[Any, Any] = {}  # rank-level layouts of the row layouts met so far
    batch: list[tuple[Commit, Workers, dict[str, Spec]]] = []
    held = 0
    run: Pieces = []
    shape: ColumnLayout | None = None
    count = 0  # commits in run
    phase = 0  # commits in the consumer's open window (its reducer's ``pending``) after what was yielded

    def counted(out: list[tuple[Item, dict[str, Spec], Level]]) -> list[tuple[Item, dict[str, Spec], Level]]:
        nonlocal phase
        if log_every > 1:
            for item, _, _ in out:
                phase = (0 if item.starts_segment else phase) + 1
                phase %= log_every
        return out

    for item in commits:
        if isinstance(item, CommitRun):
            part = item.part
            layout = layouts.of((part._replace(rows=part.rows[0]),)) if layouts is not None else None
            if layout is None:  # each commit on its own
                each: Iterable[Commit] = item.commits()
            else:
                if batch:
                    yield counted(_levels(batch, reducer, seen))
                    batch, held = [], 0
                fields = part.rows["fields"]
                stepped: list[Item] = [_new(Stepped, (step, False)) for step in item.steps]
                stepped[0] = Stepped(item.steps[0], item.starts_segment)
                per = max(1, _COLUMN_ENTRIES // max(layout.rows, 1))
                for lo in range(0, len(stepped), per):
                    piece = stepped[lo : lo + per]
                    if run and (layout is not shape or (count + len(piece)) * layout.rows > _COLUMN_ENTRIES):
                        yield counted(_emitted(run, shape, phase, log_every))
                        run, count = [], 0
                    run.append((piece, fields[lo : lo + per]))
                    count += len(piece)
                    shape = layout
                continue
        else:
            each = (item,)
        for commit in each:
            layout = layouts.of(commit.parts) if layouts is not None and commit.parts else None
            if layout is not None:
                if batch:
                    yield counted(_levels(batch, reducer, seen))
                    batch, held = [], 0
                if run and (layout is not shape or (count + 1) * layout.rows > _COLUMN_ENTRIES):
                    yield counted(_emitted(run, shape, phase, log_every))
                    run, count = [], 0
                run.append(([commit], run_fields([commit.parts])))
                count += 1
                shape = layout
                continue
            if run:
                yield counted(_emitted(run, shape, phase, log_every))
                run, count = [], 0
            partials: Workers
            alike = rows.ranks(commit.parts) if commit.parts else None
            if alike is not None:  # every rank logs the same names: the commit is a few numpy slices
                partials, specs = alike
            elif commit.parts and not _one_rank(commit):
                partials = rows.partials(commit.parts)
                specs = rows.specs(partials)
            else:  # one rank (its Summaries are what the single path reads), or a Journal read whole (decoded already)
                partials = commit.partials
                specs = {}
                for partial in partials:
                    for name, spec, _ in partial.entries:
                        if name not in specs:
                            specs[name] = respec(name, spec)
                partials = [with_specs(p, specs) for p in partials]
            batch.append((commit, partials, specs))
            held += _entries(partials)
            if held >= _BATCH_ENTRIES or len(batch) >= _BATCH_COMMITS:
                yield counted(_levels(batch, reducer, seen))
                batch, held = [], 0
    if run:
        yield counted(_emitted(run, shape, phase, log_every))
    if batch:
        yield counted(_levels(batch, reducer, seen))


def _emitted(
    run: Pieces, layout: ColumnLayout | None, pending: int, log_every: int
) -> list[tuple[Item, dict[str, Spec], Level]]:
    """A run of commits of one shape, emitted by the columnar path (``log_every`` > 1: its whole windows; its other
    commits come as rank-level results, :mod:`metricbus.replay_windows`)."""
    assert layout is not None  # a run always has its layout
    fields = run[0][1] if len(run) == 1 else np.concatenate([piece for _, piece in run])
    commits = [commit for piece, _ in run for commit in piece]
    if log_every > 1:  # ``pending``: the consumer's open window when this run starts
        levels = windows(layout, fields, commits, pending=pending, log_every=log_every, emitted=_emitted_level)
        return [(commit, layout.specs, level) for commit, level in zip(commits, levels, strict=True)]
    out = layout.emit(fields)
    return [(commit, {}, _new(Emitted, (metrics,))) for commit, metrics in zip(commits, out, strict=True)]


def _emitted_level(metrics: dict[str, float]) -> Emitted:
    return _new(Emitted, (nans(metrics),))


def _one_rank(commit: Commit) -> bool:
    """True when a commit's raw rows are one rank's."""
    if len(commit.parts) != 1:
        return False
    ranks = commit.parts[0].rows["rank"]
    return not len(ranks) or bool((ranks == ranks[0]).all())


def _entries(partials: Workers) -> int:
    """A commit's entries."""
    if isinstance(partials, Ranks):
        return sum(fields[0].size for _, fields in partials.groups)
    return sum(len(p) for p in partials)


def _several(partials: Workers) -> bool:
    """True when a commit has several workers (a :class:`Ranks` always has)."""
    return isinstance(partials, Ranks) or len(partials) > 1


def _levels(
    batch: list[tuple[Commit, Workers, dict[str, Spec]]], reducer: StepReducer, seen: dict[Any, Any]
) -> list[tuple[Item, dict[str, Spec], Level]]:
    """Each commit's rank level: merged column-wise for several workers; a lone worker's partial as it is."""
    several = [(partials, (), specs) for _, partials, specs in batch if _several(partials)]
    merged = iter(rank_levels(several, reducer, seen=seen) if several else [])
    out: list[tuple[Item, dict[str, Spec], Level]] = []
    for commit, partials, specs in batch:
        if isinstance(partials, Ranks) or len(partials) > 1:
            out.append((commit, specs, next(merged)))
        else:
            out.append((commit, specs, partials[0] if partials else {}))
    return out


_BATCH_ENTRIES = 1 << 12  # entries reduced in one block (its memory: ~100 bytes an entry)
_BATCH_COMMITS = 256
_COLUMN_ENTRIES = 1 << 14  # rows of one columnar run (its arrays: a few hundred bytes a row)
