"""What ``metricbus show`` and ``metricbus inspect`` print: aligned tables, names in natural order.

Both stream the journal: ``inspect`` counts in one pass; ``show`` spills its formatted rows to a temporary file.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TextIO

from metricbus.journal import Journal
from metricbus.journal.reader import Commit, timeline
from metricbus.replay import Source, emitted
from metricbus.spec import Spec


class UsageError(Exception):
    """A mistake of the command line (or a selection that matches nothing), reported as one line, exit 2."""


def span(steps: Iterable[int]) -> str:
    ordered = sorted(set(steps))  # never empty here
    return f"step {ordered[0]}" if len(ordered) == 1 else f"steps {ordered[0]}..{ordered[-1]}"


def fmt(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.6g}"


def natural(name: str) -> tuple[tuple[int | str, ...], str]:
    """Sort key putting ``m/2`` before ``m/10``: digit runs compare as numbers (``re.split`` puts them at odd
    positions, so equal positions always hold equal types)."""
    parts = re.split(r"(\d+)", name)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name


def by_step(points: Iterable[tuple[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """One row per step: two writes at one step (training, then evaluation) merge; a step lower than the last
    one (a resumed run went back to a checkpoint) replaces every row from there on, as a backend's rewind does."""
    rows: dict[int, dict[str, float]] = {}
    last: int | None = None
    for step, metrics in points:
        if last is not None and step < last:
            for stale in [s for s in rows if s >= step]:
                del rows[stale]
        rows.setdefault(step, {}).update(metrics)
        last = step
    return rows


class _Rows:
    """:func:`by_step`'s rows, formatted, spilled to a temporary file as they come (memory holds one row).

    A step lower than the last one truncates the file at the first row it replaces (the file is in step order).
    """

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # noqa: SIM115  (closed by close(); a context would span show())
        self._row: tuple[int, dict[str, str]] | None = None
        self.count = 0

    def add(self, step: int, metrics: Mapping[str, float]) -> None:
        row = self._row
        if row is not None and step < row[0]:
            self._truncate(step)
            row = None
        if row is not None and step == row[0]:
            row[1].update((n, fmt(v)) for n, v in metrics.items())
            return
        if row is not None:
            pickle.dump(row, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self.count += 1
        self._row = (step, {n: fmt(v) for n, v in metrics.items()})

    def _truncate(self, step: int) -> None:
        kept = 0
        for offset, (at, _) in self._records():
            if at >= step:
                self._file.truncate(offset)
                break
            kept += 1
        self._file.seek(0, os.SEEK_END)
        self._row, self.count = None, kept

    def _records(self) -> Iterator[tuple[int, tuple[int, dict[str, str]]]]:
        self._file.seek(0)
        for _ in range(self.count):
            offset = self._file.tell()
            yield offset, pickle.load(self._file)

    def rows(self, last: int | None) -> Iterator[tuple[int, dict[str, str]]]:
        """The rows in step order (``last``: only the last ones)."""
        if self._row is not None:
            pickle.dump(self._row, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self.count, self._row = self.count + 1, None
        skip = 0 if last is None else max(0, self.count - last)
        for i, (_, row) in enumerate(self._records()):
            if i >= skip:
                yield row

    def close(self) -> None:
        self._file.close()


def show(journal: Source, patterns: Sequence[str], last: int | None, out: TextIO) -> None:
    """The emitted values, one aligned row per step. Memory holds one row: rows go to a temporary file, which is
    read twice (names and widths, then the lines)."""
    rows = _Rows()
    try:
        for step, metrics in emitted(journal):
            rows.add(step, metrics)
        _table(journal, rows, patterns, last, out)
    finally:
        rows.close()


def _table(journal: Source, rows: _Rows, patterns: Sequence[str], last: int | None, out: TextIO) -> None:
    every: set[str] = set()
    for _, cells in rows.rows(None):
        every.update(cells)
    if not rows.count:
        raise UsageError(f"no emitted steps to show: the journal has {len(journal)} commits")
    ordered = sorted(every, key=natural)
    for pattern in patterns:
        if not any(fnmatchcase(n, pattern) for n in ordered):
            few = ", ".join(ordered[:8]) + (f", ... ({len(ordered)} in all)" if len(ordered) > 8 else "")
            raise UsageError(f"--metric {pattern!r} matches no metric; the journal has {few}")
    widths: dict[str, int] = {}
    steps: list[int] = []  # the first and the last shown
    step_width = len("step")
    for step, cells in rows.rows(last):
        steps[1:] = [step]
        step_width = max(step_width, len(str(step)))
        for name, cell in cells.items():
            widths[name] = max(widths.get(name, len(name)), len(cell))
    names = [n for n in ordered if n in widths and (not patterns or any(fnmatchcase(n, p) for p in patterns))]
    if not names:
        raise UsageError(f"no values of {', '.join(map(repr, patterns))} in the last {last} steps ({span(steps)})")
    size = [step_width, *(widths[n] for n in names)]
    out.writelines(_lines([["step", *names]], size))
    out.writelines(_lines(([str(step), *(cells.get(n, "-") for n in names)] for step, cells in rows.rows(last)), size))


def _lines(rows: Iterable[list[str]], widths: list[int]) -> Iterator[str]:
    for r in rows:
        line = "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        yield line.rstrip() + "\n"


def table(rows: list[list[str]]) -> Iterator[str]:
    """The aligned lines of ``rows``, each ending in a newline (written one by one: a reader may stop early)."""
    return _lines(rows, [max(len(r[i]) for r in rows) for i in range(len(rows[0]))])


FAILED_RANGES_SHOWN = 8  # inspect lists the steps of at most this many runs of failed commits


@dataclass
class Census:
    """What one pass over a journal's commits counts for ``inspect``: the commits in the journal (``commits``,
    their first and last step) and, apart, those whose journal write failed (``failed``, as runs of steps)."""

    commits: int = 0
    first_step: int | None = None
    last_step: int | None = None
    segments: int = 0
    ranks: set[int] = field(default_factory=set)
    summaries: int = 0
    records: int = 0
    metrics: dict[str, Spec] = field(default_factory=dict)  # each metric's spec, the last one seen
    failed: int = 0
    failed_steps: list[tuple[int, int]] = field(default_factory=list)  # (first, last) of each run of failed steps

    def add(self, commit: Commit) -> None:
        self.segments += commit.starts_segment or self.commits + self.failed == 0
        if commit.failed:  # in the timeline (an empty commit, so windows stay the live ones), not in the journal
            self.failed += 1
            runs = self.failed_steps
            if runs and runs[-1][0] <= commit.step <= runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], commit.step)
            else:
                runs.append((commit.step, commit.step))
            return
        self.commits += 1
        self.first_step = commit.step if self.first_step is None else self.first_step
        self.last_step = commit.step
        self.ranks.update(commit.ranks)
        for partial in commit.partials:
            self.summaries += len(partial.entries)
            for name, spec, summary in partial.entries:
                self.records += summary.count
                self.metrics[name] = spec


def _runs(runs: Sequence[tuple[int, int]]) -> str:
    """``step 4``, ``steps 4..6``, ``steps 2, 8..9``: the steps of runs of commits (the first few runs)."""
    shown = [str(a) if a == b else f"{a}..{b}" for a, b in runs[:FAILED_RANGES_SHOWN]]
    more = f", ... ({len(runs)} runs)" if len(runs) > FAILED_RANGES_SHOWN else ""
    return ("step " if len(runs) == 1 and runs[0][0] == runs[0][1] else "steps ") + ", ".join(shown) + more


def inspect(journal: Source, out: TextIO) -> None:
    """Run metadata, ranks, steps, metrics and specs, from one pass over the commits."""
    census = Census()
    for commit in timeline(journal):
        census.add(commit)
    ranks = sorted(journal.ranks) if isinstance(journal, Journal) else sorted(census.ranks)
    run = journal.run
    h = journal.header
    steps = f" (steps {census.first_step}..{census.last_step})" if census.commits else ""
    if census.failed:
        steps += f", {census.failed} failed ({_runs(census.failed_steps)}: the journal write failed, their records "
        steps += "are not in the journal)"
    lines = [
        f"journal     {journal.directory}",
        f"format      {h.get('format')} (metricbus {h.get('metricbus')})",
        f"run         id={run.id} project={run.project} name={run.name} tags={','.join(run.tags) or '-'}",
        f"segments    {census.segments} (a resumed run starts one)",
        f"files       {len(journal.files)}",
        f"ranks       {len(ranks)} ({', '.join(map(str, ranks)) or '-'})",
        f"commits     {census.commits}{steps}",
        f"log_every   {journal.log_every}",
        f"summaries   {census.summaries} ({census.records} records)",
    ]
    damaged = sum(f.damaged for f in journal.files)
    if damaged:
        lines.append(f"damaged     {damaged} records skipped")
    for gap in journal.gaps:
        steps_text = str(gap.first_step) if gap.first_step == gap.last_step else f"{gap.first_step}..{gap.last_step}"
        lines.append(
            f"gap         rank {gap.rank}: step {steps_text} not journaled, or not known to be on disk "
            "(a write or an fsync failed)"
        )
    holes = set(journal.holes)
    for gap in journal.short:
        if gap in holes and len(journal.files) == 1:
            lines.append(
                f"damaged     rank {gap.rank}: its file lost its commits at {span((gap.first_step, gap.last_step))} to "
                "damaged bytes (not replayed: those steps are missing, or hold other values than live)"
            )
            continue
        if gap in holes:
            lines.append(
                f"damaged     rank {gap.rank}: its file lost its commits at {span((gap.first_step, gap.last_step))} to "
                "damaged bytes, the other ranks' hold them (replayed without it)"
            )
            continue
        if (gap.rank, gap.first_step) in journal.within:
            lines.append(
                f"cut short   rank {gap.rank}: its file stops inside step {gap.first_step} (fewer commits there than "
                f"the other ranks'), the other ranks' go on to step {gap.last_step} (it stopped between two commits, "
                "or its last frames were lost; replayed without it)"
            )
            continue
        lines.append(
            f"cut short   rank {gap.rank}: its file stops at step {gap.first_step - 1}, the other ranks' go on to step "
            f"{gap.last_step} (it stopped between a commit's collectives and its journal write, or its last frames "
            "were lost; replayed without it)"
        )
    for path, why in journal.skipped:
        lines.append(f"skipped     {path.name}: {why}")
    if journal.rules:
        lines.append("rules")
        lines += [f"  {pattern} = {spec}" for pattern, spec in journal.rules]
    metrics = {n: census.metrics[n] for n in sorted(census.metrics, key=natural)}
    lines.append(f"metrics     {len(metrics)}")
    out.write("\n".join(lines) + "\n")
    if metrics:
        out.writelines(table([["  name", "spec"], *[[f"  {n}", str(s)] for n, s in metrics.items()]]))
