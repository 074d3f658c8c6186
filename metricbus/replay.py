"""Replay a journal through the live reduction path, optionally re-aggregated with other rules; sync adapters.

Each commit's per-rank partials go through one :class:`metricbus.reduce.StepReducer` with the journal's
``log_every``, exactly as in ``MetricBus.commit``; the last,
partial window is emitted at the last step, as ``MetricBus.close`` does. With no rule changes the emitted values
are the live ones, bit for bit. A rule override changes the spec of matching metrics; every kind is a function of
the journaled micro-level Summary, so history is re-aggregated exactly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from metricbus.adapter import Adapter, RunInfo
from metricbus.errors import JournalError
from metricbus.journal import CursorStore, Journal, read_journal
from metricbus.reduce import StepReducer
from metricbus.spec import Spec, parse_spec_text

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class StepRange:
    """Commits with ``start <= step < stop`` (None: unbounded)."""

    start: int | None = None
    stop: int | None = None

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        return (self.start is None or step >= self.start) and (self.stop is None or step < self.stop)


def parse_steps(text: str) -> StepRange:
    """``A:B`` (half-open, like a Python slice; either side may be left out) or a single step ``A``."""
    start, sep, stop = text.partition(":")
    try:
        lo = int(start) if start.strip() else None
        hi = (int(stop) if stop.strip() else None) if sep else (None if lo is None else lo + 1)
    except ValueError:
        raise JournalError(f"bad --steps {text!r}; use A:B, A: or :B with integer steps") from None
    return StepRange(lo, hi)


def parse_rule(text: str) -> tuple[str, Spec]:
    """``PATTERN=SPEC`` (SPEC: ``sum``, ``mean,max`` or ``micro:sum,rank:mean``)."""
    pattern, sep, spec = text.partition("=")
    if not sep or not pattern.strip():
        raise JournalError(f"bad rule {text!r}; use PATTERN=SPEC, e.g. 'actor/pg_loss=micro:sum,rank:mean'")
    return pattern.strip(), parse_spec_text(spec, metric=pattern.strip())


class _Respec:
    """Journaled spec -> overriding spec, decided once per name (first matching override wins)."""

    def __init__(self, overrides: Sequence[tuple[str, Spec]]) -> None:
        self._overrides = list(overrides)
        self._cache: dict[str, Spec | None] = {}

    def __call__(self, name: str, spec: Spec) -> Spec:
        if not self._overrides:
            return spec
        if name not in self._cache:
            self._cache[name] = next((s for p, s in self._overrides if fnmatchcase(name, p)), None)
        found = self._cache[name]
        return spec if found is None else found


def emitted(
    journal: Journal,
    *,
    rules: Sequence[tuple[str, Spec]] = (),
    steps: StepRange | None = None,
    progress: Progress | None = None,
) -> Iterator[tuple[int, dict[str, float]]]:
    """The ``(step, metrics)`` a live bus would have delivered, recomputed from the journal.

    Every commit is reduced, in order, through the live :class:`~metricbus.reduce.StepReducer` (so windows are
    the live ones); ``steps`` only selects which emitted steps are yielded, never what is reduced.
    """
    reducer = StepReducer(log_every=journal.log_every)
    respec = _Respec(rules)
    commits = journal.commits
    last: int | None = None
    for i, (step, partials) in enumerate(commits):
        specs: dict[str, Spec] = {}
        for partial in partials:
            for name, spec, _ in partial.entries:
                if name not in specs:
                    specs[name] = respec(name, spec)
        workers = [reducer.worker(p.updates(), specs) for p in partials]
        last = step
        out = reducer.commit(workers, specs)
        if out and (steps is None or step in steps):
            yield step, out
        if progress is not None:
            progress(i + 1, len(commits))
    if reducer.pending and last is not None:
        out = reducer.finish()
        if out and (steps is None or last in steps):
            yield last, out


def record_counts(journal: Journal) -> tuple[int, int]:
    """``(summaries, records)`` in the journal: micro-level summaries, and the records they summarise."""
    summaries = records = 0
    for _, partials in journal.commits:
        for partial in partials:
            summaries += len(partial.entries)
            records += sum(s.count for _, _, s in partial.entries)
    return summaries, records


def replay(
    source: str | os.PathLike[str] | Journal,
    adapters: Sequence[Adapter],
    *,
    rules: Sequence[tuple[str, Spec]] | Mapping[str, Spec] = (),
    steps: StepRange | None = None,
    progress: Progress | None = None,
    run: RunInfo | None = None,
) -> int:
    """Send every replayed step to each adapter (open, write..., flush, close); returns the steps sent."""
    journal = source if isinstance(source, Journal) else read_journal(source)
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    info = run or journal.run
    for adapter in adapters:
        adapter.open(run=info)
    sent = 0
    status: Any = "failed"
    try:
        for step, metrics in emitted(journal, rules=items, steps=steps, progress=progress):
            for adapter in adapters:
                adapter.write(step=step, metrics=metrics)
            sent += 1
        status = "finished"
    finally:
        for adapter in adapters:
            adapter.flush()
            adapter.close(status=status)
    return sent


def sync(
    source: str | os.PathLike[str] | Journal, adapters: Sequence[Adapter], *, progress: Progress | None = None
) -> dict[str, int]:
    """Send each adapter the replayed steps after its delivery cursor, advancing the cursor after each write.

    Returns ``{adapter name: steps sent}``. A write that raises stops that adapter (its cursor stays at the last
    acknowledged step, so the next sync resumes there) and the error is re-raised after the others are done.
    """
    journal = source if isinstance(source, Journal) else read_journal(source)
    store = CursorStore(journal.directory if journal.directory.is_dir() else journal.directory.parent)
    cursors = [store.get(a) for a in adapters]
    pending = [a for a, c in zip(adapters, cursors, strict=True) if c is None or c < _last_step(journal)]
    names = [str(getattr(a, "name", type(a).__name__)) for a in adapters]
    labels = [n if names.count(n) == 1 else f"{n}[{i}]" for i, n in enumerate(names)]
    sent = dict.fromkeys(labels, 0)
    if not pending:
        return sent
    for adapter in pending:
        adapter.open(run=journal.run)
    failed: dict[int, BaseException] = {}
    try:
        for step, metrics in emitted(journal, progress=progress):
            for i, adapter in enumerate(adapters):
                cursor = cursors[i]
                if adapter not in pending or i in failed or (cursor is not None and step <= cursor):
                    continue
                try:
                    adapter.write(step=step, metrics=metrics)
                except Exception as exc:
                    failed[i] = exc
                    continue
                store.advance(adapter, step)
                sent[labels[i]] += 1
    finally:
        for i, adapter in enumerate(adapters):
            if adapter not in pending:
                continue
            adapter.flush()
            adapter.close(status="failed" if i in failed else "finished")
    if failed:
        first = next(iter(failed.values()))
        raise first
    return sent


def _last_step(journal: Journal) -> int:
    return journal.commits[-1][0] if journal.commits else -(2**63)
