"""Resuming a run on its journal: the run it continues, and what each adapter must be told at the first commit.

``MetricBus(journal=..., resume=True)`` reads the journal (:func:`previous_run`): the new writer keeps the run's
id (so every adapter opens the same backend run), and its first commit, at step ``S``, starts a new segment of the
journal (see :mod:`metricbus.journal.reader`). At that commit :func:`catch_up` decides, per adapter, from its
delivery cursor ``c``:

* ``S`` at or below the last journaled step (a resume from an earlier checkpoint): the backend holds steps that
  the new segment replaces. Let ``R`` be ``S``, or the step of the old segment's last, unfinished window if that is
  earlier (it is emitted now, at its last commit, as ``close()`` would have). If ``c >= R`` the backend is rewound
  to ``R`` (its optional ``rewind`` verb) and the cursor moves back to ``R - 1``.
* Either way, the steps of the old timeline after ``c`` (the ones a crash kept from the backend) are delivered
  first, so the backend's steps stay in order and the cursor never skips one.

Without ``resume``, a journal that already holds commits is refused: two runs never share one timeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from metricbus.adapter import RunInfo
from metricbus.errors import JournalError
from metricbus.journal import Journal, JournalStream, stream_journal
from metricbus.journal.format import SUFFIX
from metricbus.journal.scan import UnreadableError

Emission = tuple[int, Mapping[str, float]]


@dataclass(frozen=True, slots=True)
class CatchUp:
    """What one adapter gets before a resumed run's first step: an optional rewind, then the steps it missed."""

    rewind: int | None
    steps: tuple[Emission, ...]
    cursor: int | None  # the cursor after the rewind


def previous_run(
    directory: str, *, resume: bool, run: RunInfo | None, log_every: int = 1
) -> tuple[RunInfo | None, JournalStream | None]:
    """The run to write and the journal it continues (None: a fresh run), opened as a stream (its first pass only:
    headers, gaps and the last step; the commits are read again, one at a time, at the first commit).

    ``resume`` False and a journal with commits: JournalError saying to pass ``resume=True`` or use a new
    directory. ``run`` given with ``resume``: its project, name, tags and config are used, with the journal's id
    and start time (the run stays one run). A ``log_every`` other than the journal's: JournalError (replay, show
    and sync read one ``log_every`` for the whole timeline, so another one would change the earlier windows).
    """
    path = Path(directory)
    if not path.is_dir() or not any(path.glob(f"rank-*{SUFFIX}")):
        return run, None
    try:
        journal = stream_journal(path)
    except UnreadableError:  # nothing readable: a fresh run (a writer refuses a file it cannot append to)
        return run, None
    if journal.last_step is None:
        return run, None
    old = journal.run
    if not resume:
        first = next(iter(journal.commits(decode=False)), None)
        raise JournalError(
            f"journal {directory} already holds run {old.id!r} (steps {first.step if first else journal.last_step}.."
            f"{journal.last_step}); pass resume=True to continue that run (its backend runs too), or give this run a "
            "new journal directory"
        )
    if journal.log_every != log_every:
        raise JournalError(
            f"journal {directory} was written with log_every={journal.log_every}; resume it with "
            f"log_every={journal.log_every} (a run's windows are read with one log_every, so replay, show and sync "
            f"would emit its earlier steps other than live did), got log_every={log_every}; or give this run a new "
            "journal directory"
        )
    if run is None:
        return old, journal
    return replace(run, id=old.id, start_time_unix_ns=old.start_time_unix_ns), journal


def catch_up(
    journal: Journal | JournalStream, *, step: int, cursors: Sequence[int | None], others: Sequence[int] = ()
) -> list[CatchUp]:
    """Per adapter (its cursor in ``cursors``), the rewind and steps it needs before the first commit at ``step``.

    The old timeline is replayed as a stream; only the emissions some adapter still needs (after the lowest cursor,
    and the last one, which decides a rewind) are kept. ``others``: the cursors of backends this bus has no adapter
    for; their plans (no steps: ``metricbus sync`` sends them) follow those of ``cursors``, so that a rewind moves
    their cursors back too."""
    from metricbus.replay import emissions

    floor = None if any(c is None for c in cursors) else min(cursors, default=None)  # type: ignore[type-var]
    kept: list[tuple[int, Mapping[str, float]]] = []
    last: tuple[int, Mapping[str, float], bool] | None = None
    for emission in emissions(journal, until=step):
        if last is not None and (floor is None or last[0] > floor):
            kept.append(last[:2])
        last = emission
    rewinding = journal.last_step is not None and step <= journal.last_step
    start = step
    if rewinding and last is not None and last[2]:
        start = min(start, last[0])  # the old segment's unfinished window, emitted now at its last commit
    if last is not None:
        kept.append(last[:2])
    out = []
    for acked in cursors:
        rewind, after = None, acked
        if rewinding and acked is not None and acked >= start:
            rewind, after = start, start - 1
        missed = tuple((s, m) for s, m in kept if after is None or s > after)
        out.append(CatchUp(rewind, missed, after))
    for acked in others:
        rewound = rewinding and acked >= start
        out.append(CatchUp(start if rewound else None, (), start - 1 if rewound else acked))
    return out
