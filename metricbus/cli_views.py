"""What ``metricbus show`` and ``metricbus inspect`` print: aligned tables, names in natural order."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from fnmatch import fnmatchcase
from typing import TextIO

from metricbus.journal import Journal
from metricbus.replay import emitted, record_counts


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


def table(rows: list[list[str]]) -> Iterator[str]:
    """The aligned lines of ``rows``, each ending in a newline (written one by one: a reader may stop early)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        line = "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        yield line.rstrip() + "\n"


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


def show(journal: Journal, patterns: Sequence[str], last: int | None, out: TextIO) -> None:
    rows = by_step(emitted(journal))
    if not rows:
        raise UsageError(f"no emitted steps to show: the journal has {len(journal.commits)} commits")
    every = sorted({n for m in rows.values() for n in m}, key=natural)
    for pattern in patterns:
        if not any(fnmatchcase(n, pattern) for n in every):
            few = ", ".join(every[:8]) + (f", ... ({len(every)} in all)" if len(every) > 8 else "")
            raise UsageError(f"--metric {pattern!r} matches no metric; the journal has {few}")
    steps = list(rows)[-last:] if last is not None else list(rows)
    present = {n for s in steps for n in rows[s]}
    names = [n for n in every if n in present and (not patterns or any(fnmatchcase(n, p) for p in patterns))]
    if not names:
        raise UsageError(f"no values of {', '.join(map(repr, patterns))} in the last {last} steps ({span(steps)})")
    cells = [["step", *names]]
    cells += [[str(step), *(fmt(rows[step][n]) if n in rows[step] else "-" for n in names)] for step in steps]
    out.writelines(table(cells))


def inspect(journal: Journal, out: TextIO) -> None:
    run = journal.run
    summaries, records = record_counts(journal)
    steps = [s for s, _ in journal.commits]
    h = journal.header
    lines = [
        f"journal     {journal.directory}",
        f"format      {h.get('format')} (metricbus {h.get('metricbus')})",
        f"run         id={run.id} project={run.project} name={run.name} tags={','.join(run.tags) or '-'}",
        f"segments    {len(journal.breaks) + 1 if journal.commits else 0} (a resumed run starts one)",
        f"files       {len(journal.files)}",
        f"ranks       {len(journal.ranks)} ({', '.join(map(str, journal.ranks)) or '-'})",
        f"commits     {len(steps)}" + (f" (steps {steps[0]}..{steps[-1]})" if steps else ""),
        f"log_every   {journal.log_every}",
        f"summaries   {summaries} ({records} records)",
    ]
    damaged = sum(f.damaged for f in journal.files)
    if damaged:
        lines.append(f"damaged     {damaged} records skipped")
    for gap in journal.gaps:
        steps_text = str(gap.first_step) if gap.first_step == gap.last_step else f"{gap.first_step}..{gap.last_step}"
        lines.append(f"gap         rank {gap.rank}: step {steps_text} not journaled (a write failed)")
    for path, why in journal.skipped:
        lines.append(f"skipped     {path.name}: {why}")
    if journal.rules:
        lines.append("rules")
        lines += [f"  {pattern} = {spec}" for pattern, spec in journal.rules]
    known = journal.metrics()
    metrics = {n: known[n] for n in sorted(known, key=natural)}
    lines.append(f"metrics     {len(metrics)}")
    out.write("\n".join(lines) + "\n")
    if metrics:
        out.writelines(table([["  name", "spec"], *[[f"  {n}", str(s)] for n, s in metrics.items()]]))
