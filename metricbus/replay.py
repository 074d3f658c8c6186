"""Replay a journal through the live reduction path, optionally re-aggregated with other rules; sync adapters.

Each commit's per-rank partials go through one :class:`metricbus.reduce.StepReducer` with the journal's
``log_every``, exactly as in ``MetricBus.commit``; the last,
partial window is emitted at the last step, as ``MetricBus.close`` does. With no rule changes the emitted values
are the live ones, bit for bit. A rule override changes the spec of matching metrics; every kind is a function of
the journaled micro-level Summary, so history is re-aggregated exactly.

Everything here streams: a path is read with :func:`~metricbus.journal.reader.stream_journal`, one commit at a
time, so memory holds the reducer's open ``log_every`` window and a few commits, whatever the journal's length. An
in-memory :class:`~metricbus.journal.Journal` (``read_journal``) is accepted too.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.canonical import nans
from metricbus.errors import AdapterError, JournalError, RejectedMetricsError, SpecError
from metricbus.errors_classify import backoff_s, classify, permanent_errors_of
from metricbus.journal import CursorStore, Journal
from metricbus.journal.cursors import identity_of, resume_adapter
from metricbus.journal.reader import Commit, CommitRun, JournalStream, stream_journal, timeline
from metricbus.journal.scan import Names, RawPart, shape_bytes
from metricbus.journal.writer import held_for_sync
from metricbus.partial import Partial
from metricbus.reduce import StepReducer
from metricbus.replay_levels import Emitted, reduced
from metricbus.rules import Rules
from metricbus.spec import Spec, SpecLike, micro_sketch, parse_spec, parse_spec_text
from metricbus.spec_table import SpecTable, output_keys

Progress = Callable[[int, int], None]
Source = Journal | JournalStream


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
    if not text.strip():  # (a shell variable left unset: '--steps "$FROM"') not every step, silently
        raise JournalError(f"bad --steps {text!r}: it is empty; use A:B, A: or :B with integer steps")
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

    def __init__(self, overrides: Sequence[tuple[str, SpecLike]]) -> None:
        # a rule's spec in any form a bus's rules take ("sum", ["mean", "max"], Agg(...)), or a parsed Spec
        self._overrides = [(pattern, parse_spec(spec, metric=pattern)) for pattern, spec in overrides]
        self._cache: dict[str, tuple[str, Spec] | None] = {}

    def rule(self, name: str) -> tuple[str, Spec] | None:
        """``(pattern, spec)`` of the first override matching ``name``, or None."""
        if name not in self._cache:
            self._cache[name] = next(((p, s) for p, s in self._overrides if fnmatchcase(name, p)), None)
        return self._cache[name]

    def __call__(self, name: str, spec: Spec) -> Spec:
        if not self._overrides:
            return spec
        found = self.rule(name)
        if found is None:
            return spec
        new = found[1]
        if new.nan is not None and new.nan != spec.nan:  # the policy acted at log(): the journal holds summaries
            logged = f"nan={spec.nan!r}" if spec.nan is not None else "the bus's nan policy"
            raise SpecError(
                f"the rule {new} for {name!r} sets nan={new.nan!r}, but {name!r} was logged under {logged} and the "
                "journal holds its records' summaries: a replay cannot drop or check non-finite records again; leave "
                "nan out of the rule"
            )
        if micro_sketch(new) and not micro_sketch(spec):
            raise SpecError(
                f"the rule {new} for {name!r} reads the distribution of its records, but the journal has no sketch "
                f"of {name!r} (it was logged with spec {spec}); a quantile over a level's results works on any "
                f"journal, e.g. {name}=micro:mean,step:p90"
            )
        return new

    def check(self, metrics: Iterable[tuple[str, Spec]], *, every_rule: bool) -> None:
        """Raise SpecError, before anything is emitted, for an override the journal cannot serve (its ``metrics``:
        every journaled ``(name, spec)``): one that reads a sketch the journal lacks, or one that makes a metric
        emit a name another metric emits (the live bus's check, :meth:`SpecTable.check_outputs`: never a merge);
        ``every_rule``: also one whose pattern matches no journaled metric (a typed rule's typo)."""
        kept: dict[str, str] = {}  # output name -> the metric not overridden that emits it
        replaced: dict[str, tuple[str, Spec]] = {}  # overridden name -> (pattern, spec)
        journaled = sorted(metrics, key=lambda item: item[0])
        names = sorted({name for name, _ in journaled})
        for pattern, _ in self._overrides if every_rule else ():  # a typed rule that re-aggregates nothing: a typo
            if not any(fnmatchcase(name, pattern) for name in names):
                few = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "") or "none"
                raise SpecError(f"replay rule {pattern!r} matches no metric of the journal; it has {few}")
        if every_rule:  # a typed rule that every metric it matches takes an earlier one for: it changes nothing
            first = {name: next(i for i, (p, _) in enumerate(self._overrides) if fnmatchcase(name, p))
                     for name in names if self.rule(name) is not None}
            for i, (pattern, spec) in enumerate(self._overrides):
                shadowed = [name for name in names if fnmatchcase(name, pattern)]
                if shadowed and all(first[name] != i for name in shadowed):
                    earlier = self._overrides[first[shadowed[0]]]
                    raise SpecError(
                        f"replay rule {pattern}={spec} re-aggregates nothing: the metrics it matches "
                        f"({', '.join(shadowed[:8])}) take the earlier rule {earlier[0]}={earlier[1]} (the first "
                        "matching rule wins); drop one, or put the more specific rule first"
                    )
        for name, spec in journaled:
            new = self(name, spec)  # raises for a sketch the journal lacks
            found = self.rule(name)
            if found is None:
                for key in output_keys(name, spec):
                    kept.setdefault(key, name)
            else:
                replaced[name] = (found[0], new)
        table = SpecTable(Rules())
        for name, (pattern, spec) in replaced.items():
            try:
                table.check_outputs(name, spec, kept)  # records what it checked: two overridden names clash too
            except SpecError as exc:
                why = f"replay rule {pattern!r} ({spec}) would merge two metrics into one series"
                raise SpecError(f"{why}: {exc}") from None


@dataclass(slots=True)
class _Table:
    """A name table met by :func:`_journaled`: the table (held, so its id stays its own), the ids met, and the
    shape (:func:`~metricbus.journal.scan.shape_bytes`) of the last rows read with it."""

    names: Names
    met: set[int] = field(default_factory=set)
    shape: bytes = b""


def _journaled(commits: Iterable[Commit | CommitRun]) -> set[tuple[str, Spec]]:
    """Every ``(name, spec)`` the rows of ``commits`` hold. A stream's row ids are read where rows differ in shape
    from the last ones of their name table (each rank file's commits, mostly alike); held: each table and its ids."""
    out: set[tuple[str, Spec]] = set()
    tables: dict[int, _Table] = {}
    for item in commits:
        if isinstance(item, CommitRun):
            parts: Iterable[RawPart] = (item.part._replace(rows=item.part.rows[0]),)  # one shape: the first commit's
        elif item.parts:
            parts = item.parts
        else:  # a Journal's commit: its partials are decoded already
            out.update((name, spec) for partial in item.partials for name, spec, _ in partial.entries)
            continue
        for part in parts:
            table = tables.get(id(part.names))
            if table is None:
                table = tables[id(part.names)] = _Table(part.names)
            shape = part.shape if part.shape is not None else shape_bytes(part.rows)
            if shape == table.shape:
                continue
            table.shape = shape
            new = set(part.rows["id"].tolist()) - table.met
            table.met.update(new)
            out.update(table.names[i] for i in new if i in table.names)  # an id without a name: skipped, as read
    return out


def emitted(
    journal: Source,
    *,
    rules: Sequence[tuple[str, SpecLike]] = (),
    steps: StepRange | None = None,
    progress: Progress | None = None,
    every_rule: bool = False,
) -> Iterator[tuple[int, dict[str, float]]]:
    """The ``(step, metrics)`` a live bus would have delivered, recomputed from the journal.

    Every commit is reduced, in order, through the live :class:`~metricbus.reduce.StepReducer` (so windows are
    the live ones; a segment's open window is emitted at its last step, as the bus's ``close`` does, before the
    next segment starts a fresh one); ``steps`` only selects which emitted steps are yielded, never what is
    reduced. A step may be yielded more than once (several commits at one step, with disjoint names).
    ``every_rule``: a rule whose pattern matches no journaled metric, or only metrics an earlier rule takes, is a
    SpecError (``metricbus replay --rule``: a typo, or a rule that changes nothing); else it is left unused, as a
    live bus's rule that matches nothing (a shared rule set such as ``VERL_RULES`` names metrics a run may not
    have).
    """
    for step, out, _ in emissions(journal, rules=rules, progress=progress, every_rule=every_rule):
        if steps is None or step in steps:
            yield step, out


def emissions(
    journal: Source,
    *,
    rules: Sequence[tuple[str, SpecLike]] = (),
    progress: Progress | None = None,
    until: int | None = None,
    every_rule: bool = False,
) -> Iterator[tuple[int, dict[str, float], bool]]:
    """:func:`emitted`'s ``(step, metrics)`` with a third item: True for a window closed early (a segment's end).
    ``until``: only the timeline before that step (what a resume at it keeps)."""
    reducer = StepReducer(log_every=journal.log_every)
    respec = _Respec(rules)
    if rules:  # a pass over the rows' name ids: a rule that cannot be served fails before anything is emitted
        respec.check(_journaled(_commits(journal, until)), every_rule=every_rule)
    total = len(journal) if progress is not None else 0  # a stream counts its commits in a pass decoding nothing
    last: int | None = None
    done = 0
    for batch in reduced(_commits(journal, until), respec, reducer, log_every=journal.log_every):
        for commit, specs, ranked in batch:
            step = commit.step
            if commit.starts_segment:  # a resumed writer starts afresh: the open window ends with its segment
                if reducer.pending and last is not None:
                    tail = reducer.finish()
                    if tail:
                        yield last, nans(tail), True
                reducer = StepReducer(log_every=journal.log_every)
            last = step
            out: dict[str, float] | None
            if isinstance(ranked, Emitted):  # the columnar path: log_every 1, or a window it merged (none pending)
                if reducer.pending:  # reduced() counts the phase of the open window: never seen
                    raise AssertionError(f"step {step}: a window merged in columns while the reducer had one open")
                out = ranked.metrics  # (its NaNs are math.nan already)
            else:
                if isinstance(ranked, Partial):  # one worker: its states are the rank level (the live single path)
                    out = reducer.commit([reducer.worker(ranked.updates(), specs)], specs)
                else:
                    out = reducer.commit_ranked(ranked, specs)
                out = out and nans(out)
            if out:
                yield step, out, False
            done += 1
            if progress is not None:
                progress(done, max(total, done))
    if reducer.pending and last is not None:
        tail = reducer.finish()
        if tail:
            yield last, nans(tail), True


def _commits(journal: Source, until: int | None) -> Iterator[Commit | CommitRun]:
    """The timeline (a stream's runs of one shape together), only before step ``until`` if given."""
    commits = journal.runs() if isinstance(journal, JournalStream) else timeline(journal)
    return commits if until is None else _before(commits, until)


def _before(commits: Iterator[Commit | CommitRun], until: int) -> Iterator[Commit | CommitRun]:
    """The commits before the first at step ``until`` or later (the timeline's steps do not go back)."""
    for item in commits:
        if isinstance(item, CommitRun):
            if item.steps[-1] >= until:
                cut = bisect.bisect_left(item.steps, until)
                if cut:
                    yield item.head(cut)
                return
        elif item.step >= until:
            return
        yield item


def record_counts(journal: Source) -> tuple[int, int]:
    """``(summaries, records)`` in the journal: micro-level summaries, and the records they summarise."""
    summaries = records = 0
    for commit in timeline(journal):
        for partial in commit.partials:
            summaries += len(partial.entries)
            records += sum(s.count for _, _, s in partial.entries)
    return summaries, records


def _open(source: str | os.PathLike[str] | Source) -> Source:
    return source if isinstance(source, Journal | JournalStream) else stream_journal(source)


def replay_run(live: RunInfo) -> RunInfo:
    """The run a replay opens its adapters with by default: a new one, its id ``<live id>-replay-<a new run id>``, its
    name ``<live name or id> (replay)``, the live run's project, tags (and ``replay``) and config."""
    fresh = RunInfo(project=live.project)
    return RunInfo(
        project=live.project,
        name=f"{live.name or live.id} (replay)",
        tags=(*live.tags, "replay"),
        config=live.config,
        start_time_unix_ns=fresh.start_time_unix_ns,
        id=f"{live.id}-replay-{fresh.id}",
    )


def replay(
    source: str | os.PathLike[str] | Source,
    adapters: Sequence[Adapter],
    *,
    rules: Sequence[tuple[str, SpecLike]] | Mapping[str, SpecLike] = (),
    steps: StepRange | None = None,
    progress: Progress | None = None,
    run: RunInfo | None = None,
    every_rule: bool = False,
) -> int:
    """Send every replayed step to each adapter (open, write..., flush, close); returns the steps sent
    (``every_rule``: as :func:`emitted`). Where no step is emitted (in ``steps``), no adapter opens.

    The adapters open ``run``, by default a new run made from the journal's (:func:`replay_run`): a replay, with
    ``rules`` or without, never adds to the live run's backend run (its jsonl file, TensorBoard folder, MLflow or
    wandb run would then hold each step twice, or the old and the re-aggregated values side by side);
    :func:`sync` is what delivers into the live run. So before any adapter opens, each is told so (its optional
    ``new_run`` verb, with what the live run's adapters of its name wrote to): ``MLFLOW_RUN_ID`` and
    ``WANDB_RUN_ID`` are ignored, and an option naming the live run's file, folder or run (``attach=True``) is a
    :class:`~metricbus.errors.ConfigError`, as is a jsonl file or TensorBoard folder that already holds rows (an
    earlier replay's: this one would add every step again)."""
    journal = _open(source)
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    info = run or replay_run(journal.run)
    _new_runs(journal, adapters)
    stream = emitted(journal, rules=items, steps=steps, progress=progress, every_rule=every_rule)
    first = next(stream, None)  # a rule the journal cannot serve (its first commit's names) fails before any open
    if first is None:  # no emitted step (in ``steps``): no adapter opens, so nothing is created (an empty jsonl file,
        return 0  # a TensorBoard event file that a corrected replay into the same place would then be refused for)
    opened: list[Adapter] = []
    refused: dict[int, tuple[Adapter, dict[str, RejectedMetricsError]]] = {}  # per adapter (id): names it refuses
    sent = 0
    try:
        for adapter in adapters:
            adapter.open(run=info)
            opened.append(adapter)
        for step, metrics in itertools.chain([first] if first is not None else [], stream):
            for adapter in adapters:
                try:
                    adapter.write(step=step, metrics=metrics)
                except RejectedMetricsError as exc:  # the step's other metrics were written: the replay goes on
                    names = refused.setdefault(id(adapter), (adapter, {}))[1]
                    for metric in exc.rejected:
                        names.setdefault(metric, exc)
            sent += 1
    except BaseException:
        _close_all(opened, status="failed", raise_error=False)  # the error that stopped the replay is the one raised
        raise
    closing: Exception | None = None
    try:
        _close_all(opened, status="finished", raise_error=True, failing={id(a) for a, _ in refused.values()})
    except Exception as exc:
        if not refused:
            raise
        closing = exc
    if refused:
        said = [f"adapter {_label(adapter)!r} {_refusal(names)}" for adapter, names in refused.values()]
        if closing is not None:
            said.append(f"then closing failed ({type(closing).__name__}: {closing})")
        first_error = closing or next(iter(next(iter(refused.values()))[1].values()))
        raise AdapterError(f"replay sent {sent} steps, without metrics a backend refuses: " + "; ".join(said)) \
            from first_error
    return sent


def _label(adapter: Adapter) -> str:
    return str(getattr(adapter, "name", type(adapter).__name__))


def _refusal(refused: Mapping[str, BaseException]) -> str:
    """``refuses metric 'x' (why, what is valid); ...``: the metric names an adapter refuses; the other metrics of
    their steps were written."""
    names = list(refused)
    reasons = "; ".join(dict.fromkeys(str(getattr(e, "rejected", {}).get(n, e)) for n, e in refused.items()))
    return (
        f"refuses metric{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} "
        f"({reasons}); the other metrics of those steps were written"
    )


def _cursors(journal: Source) -> CursorStore:
    """The delivery cursors next to the journal (a directory, or a single rank file's folder)."""
    return CursorStore(journal.directory if journal.directory.is_dir() else journal.directory.parent)


def _new_runs(journal: Source, adapters: Sequence[Adapter]) -> None:
    """Call each adapter's optional ``new_run(live=...)`` (see :mod:`metricbus.adapter`), all before any opens."""
    store = _cursors(journal)
    for adapter in adapters:
        new_run = getattr(adapter, "new_run", None)
        if callable(new_run):
            new_run(live=store.identities(str(getattr(adapter, "name", type(adapter).__name__))))


def _close_all(
    adapters: Sequence[Adapter], *, status: Status, raise_error: bool, failing: Collection[int] = ()
) -> None:
    """Flush and close every adapter, each even where another's flush or close raised (one whose flush raised, or
    whose id is in ``failing``, is closed as failed, so no backend run is left open or complete without what it
    lacks); then raise the first error if ``raise_error``."""
    error: Exception | None = None
    for adapter in adapters:
        final: Status = "failed" if id(adapter) in failing else status
        try:
            adapter.flush()
        except Exception as exc:
            error, final = error or exc, "failed"
        try:
            adapter.close(status=final)
        except Exception as exc:
            error = error or exc
    if error is not None and raise_error:
        raise error


FLUSH_EVERY = 1000  # sync flushes (and then acknowledges) at least every this many steps per adapter ...
FLUSH_INTERVAL_S = 2.0  # ... and at least this often, so a killed sync redoes little
SYNC_TRIES = 5  # a write failing with transient errors is tried this often before sync stops that adapter ...
SYNC_RETRY_BASE_S, SYNC_RETRY_CAP_S = 0.1, 2.0  # ... waiting this long, doubling, in between
SyncProgress = Callable[[int, int, int], None]  # (commits reduced, commits in the journal, steps sent)


class SyncInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped ``sync``: what was written was flushed and acknowledged; ``sent`` is ``{label: steps}``."""

    def __init__(self, sent: dict[str, int]) -> None:
        super().__init__(sent)
        self.sent = sent


@dataclass(slots=True)
class _Target:
    """One adapter in a sync: its cursor, the last step written (and how many) not yet acknowledged, its error.

    ``sent`` counts acknowledged steps only.
    """

    adapter: Adapter
    label: str
    cursor: int | None
    written: int | None = None
    whole: int | None = None  # the last step all of whose commits were written (``written`` or the one before)
    at_written: int = 0  # the writes at step ``written`` not yet acknowledged
    unflushed: int = 0
    sent: int = 0
    error: BaseException | None = None
    gaps: set[int] = field(default_factory=set)  # steps the backend rejected live: retried here
    rejected: dict[int, BaseException] = field(default_factory=dict)  # steps it rejected for good in this sync
    refused: dict[str, BaseException] = field(default_factory=dict)  # metric names it refuses (steps still written)
    resent: set[int] = field(default_factory=set)  # gaps written, not yet acknowledged
    identity: dict[str, str] | None = None  # the backend run the live bus (or a last sync) wrote to
    rewind: int | None = None  # where a resume left its backend to be rewound before anything is sent
    flushed: int | None = None  # the last whole step flushed: acknowledged once durable (``durable_step``) or closed

    def wants(self, step: int) -> bool:
        return self.error is None and (self.cursor is None or step > self.cursor or step in self.gaps)


def sync(
    source: str | os.PathLike[str] | Source,
    adapters: Sequence[Adapter],
    *,
    progress: SyncProgress | None = None,
    flush_every: int = FLUSH_EVERY,
    flush_interval_s: float = FLUSH_INTERVAL_S,
    stop: threading.Event | None = None,
) -> dict[str, int]:
    """Send each adapter the replayed steps after its delivery cursor; returns ``{adapter label: steps sent}``.

    Each adapter is first told its cursor and the backend run the live bus wrote to (``resume(after_step=...,
    identity=...)``, if it has that optional verb, so it drops steps written but never acknowledged) and opened
    with the journal's run, whose ``id`` is the live run's: the steps land in the same backend run, which is then
    closed as finished. A step is acknowledged (the cursor advanced) only after the
    adapter's ``flush()`` returned: every ``flush_every`` steps, every ``flush_interval_s`` and at the end. So after
    any crash, of the trainer or of a sync, the next sync sends every journaled step once.

    A write that raises a transient error (:mod:`metricbus.errors_classify`: the backend is down) is tried again
    with backoff (:data:`SYNC_TRIES` in all); one that still fails stops that adapter (what it wrote before is
    flushed and acknowledged) and the error is re-raised after the others are done.
    A step the backend rejects for good (a permanent error, as live) is skipped for that adapter and kept as a gap
    (retried by the next sync) while the later steps are sent; the adapter is then closed as failed and an
    :class:`~metricbus.errors.AdapterError` naming it and the steps is raised at the end. Where several adapters
    failed, or one was stopped by an error after rejecting steps, one AdapterError names each failure (chained
    from the first error).

    ``KeyboardInterrupt``, or ``stop`` set (checked between steps; the CLI sets it on Ctrl-C), flushes and
    acknowledges what was written, closes the adapters and raises :class:`SyncInterrupted`.

    A journal a bus still writes (the trainer running) is a :class:`~metricbus.errors.JournalError` naming the file
    and that bus, before any adapter is touched: that bus delivers the same steps into the same backend runs. Sync
    holds the rank files' writer locks while it runs, so a bus resuming the journal meanwhile is refused too.
    """
    where = source.directory if isinstance(source, Journal | JournalStream) else source
    with held_for_sync(where):  # no bus may write the journal (and deliver its steps) meanwhile
        return _sync(_open(source), adapters, progress=progress, flush_every=flush_every,
                     flush_interval_s=flush_interval_s, stop=stop)


def _sync(
    journal: Source,
    adapters: Sequence[Adapter],
    *,
    progress: SyncProgress | None,
    flush_every: int,
    flush_interval_s: float,
    stop: threading.Event | None,
) -> dict[str, int]:
    store = _cursors(journal)
    names = [str(getattr(a, "name", type(a).__name__)) for a in adapters]
    labels = [n if names.count(n) == 1 else f"{n}[{i}]" for i, n in enumerate(names)]
    targets = [
        _Target(a, label, store.get(a), gaps=store.gaps(a), identity=store.identity(a), rewind=store.pending_rewind(a))
        for a, label in zip(adapters, labels, strict=True)
    ]
    last = _last_step(journal)
    pending = [t for t in targets if t.cursor is None or t.cursor < last or t.gaps or t.rewind is not None]
    opened: list[_Target] = []
    try:
        for target in pending:
            if _start(target, journal.run):
                opened.append(target)
                store.set_identity(target.adapter, identity_of(target.adapter))
        _send(journal, opened, store=store, progress=progress, flush_every=flush_every,
              flush_interval_s=flush_interval_s, stop=stop)
    except KeyboardInterrupt:
        _finish(opened, store, status="failed")
        raise SyncInterrupted({t.label: t.sent for t in targets}) from None
    except BaseException:
        _finish(opened, store, status="failed")
        raise
    _finish(opened, store, status="finished")
    failed = [t for t in targets if t.error is not None]
    rejecting = [t for t in targets if (t.rejected or t.refused) and t.error is None]
    both = [t for t in failed if t.rejected or t.refused]  # stopped by an error after rejecting steps: each is said
    if len(failed) + len(rejecting) > 1 or both:  # each adapter's own failure, not only the first one's
        said = [_failed(t) for t in failed] + [str(_rejected(t)) for t in rejecting]
        cause = failed[0].error if failed else _rejected(rejecting[0])
        count = len(failed) + len(rejecting)
        head = f"{count} adapter{'s' if count > 1 else ''} failed in this sync: "
        raise AdapterError(head + "; ".join(said)) from cause
    if failed:
        assert failed[0].error is not None
        raise failed[0].error
    if rejecting:
        error = _rejected(rejecting[0])
        raise error from error.__cause__
    return {t.label: t.sent for t in targets}


def _failed(target: _Target) -> str:
    """What stopped ``target`` (its error), and the steps its backend had rejected for good before, if any."""
    said = f"adapter {target.label!r} failed ({type(target.error).__name__}: {target.error})"
    if target.refused:
        said += f", after it {_refusal(target.refused)}"
    if not target.rejected:
        return said
    steps = sorted(target.rejected)
    first = target.rejected[steps[0]]
    return (
        f"{said}, after rejecting step{'s' if len(steps) > 1 else ''} {_steps(steps)} for good "
        f"({type(first).__name__}: {first}), kept as gap{'s' if len(steps) > 1 else ''} that the next sync retries"
    )


def _steps(steps: list[int]) -> str:
    """The first ten of ``steps`` (sorted), then how many more."""
    return ", ".join(map(str, steps[:10])) + (f" and {len(steps) - 10} more" if len(steps) > 10 else "")


def _rejected(target: _Target) -> AdapterError:
    """The error that says which steps ``target``'s backend rejected for good (chained from the first one's)."""
    steps = sorted(target.rejected)
    if not steps:  # only metric names refused: every step was sent without them
        refused = next(iter(target.refused.values()))
        error = AdapterError(f"adapter {target.label!r} {_refusal(target.refused)} ({target.sent} steps sent)")
        error.__cause__ = refused
        return error
    first = target.rejected[steps[0]]
    also = f"; it {_refusal(target.refused)}" if target.refused else ""
    error = AdapterError(
        f"adapter {target.label!r} rejected step{'s' if len(steps) > 1 else ''} {_steps(steps)} for good "
        f"({type(first).__name__}: {first}); it sent every other step ({target.sent} steps), and the next sync "
        f"retries the rejected ones (kept as gaps) once the cause is fixed{also}"
    )
    error.__cause__ = first
    return error


def _start(target: _Target, run: RunInfo) -> bool:
    """Tell the adapter its cursor, open it, and rewind it where a resume left a rewind pending (its backend holds
    an abandoned timeline from there on: see :mod:`metricbus.journal.cursors`); False (the error kept, an opened
    adapter closed as failed) when any of it raised."""
    try:
        resume_adapter(target.adapter, target.cursor, target.identity)
        target.adapter.open(run=run)
    except Exception as exc:
        target.error = exc
        return False
    rewind = getattr(target.adapter, "rewind", None)
    if target.rewind is not None and callable(rewind):
        try:
            rewind(step=target.rewind)
        except Exception as exc:
            target.error = exc
            with contextlib.suppress(Exception):
                target.adapter.close(status="failed")
            return False
    return True


def _send(
    journal: Source,
    targets: list[_Target],
    *,
    store: CursorStore,
    progress: SyncProgress | None,
    flush_every: int,
    flush_interval_s: float,
    stop: threading.Event | None,
) -> None:
    reduced = [0, len(journal) if progress is not None else 0]
    sent = 0

    def tick(done: int, total: int) -> None:
        reduced[:] = [done, total]

    last_ack = time.monotonic()
    stream = emitted(journal, progress=None if progress is None else tick)

    def following() -> tuple[tuple[int, dict[str, float]] | None, Exception | None]:
        try:
            return next(stream, None), None
        except Exception as exc:  # raised once the emission read before it is written
            return None, exc

    ahead, failure = following()
    while ahead is not None:
        step, metrics = ahead
        ahead, failure = following()  # a cursor covers whole steps: is this the step's last commit?
        last_of_step = failure is None and (ahead is None or ahead[0] != step)
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        if all(t.error is not None for t in targets):
            break
        wrote = False
        for target in targets:
            if not target.wants(step):
                continue
            try:
                _write(target.adapter, step, metrics, stop)
            except RejectedMetricsError as exc:  # the step's other metrics were written: it counts as sent
                for metric in exc.rejected:
                    target.refused.setdefault(metric, exc)
            except Exception as exc:
                if classify(exc, permanent=permanent_errors_of(target.adapter)) == "transient":
                    target.error = exc
                else:
                    _reject(target, store, step, exc)
                continue
            if target.written != step:
                target.written, target.at_written = step, 0
            target.unflushed += 1
            target.at_written += 1
            if last_of_step:
                target.whole = step
            if step in target.gaps and step not in target.rejected:
                target.resent.add(step)
            wrote = True
        sent += wrote
        if any(t.unflushed >= flush_every for t in targets) or time.monotonic() - last_ack >= flush_interval_s:
            for target in targets:
                _acknowledge(target, store)
            last_ack = time.monotonic()
        if progress is not None:
            progress(reduced[0], reduced[1], sent)
    else:
        if failure is not None:  # reducing the emission after the last one written failed
            raise failure
    if progress is not None:
        progress(reduced[1], reduced[1], sent)


def _write(adapter: Adapter, step: int, metrics: Mapping[str, float], stop: threading.Event | None) -> None:
    """``adapter.write``, a transient failure (a backend briefly away, a request still running) tried again with
    backoff, :data:`SYNC_TRIES` times in all, as live delivery does; the last failure, or a permanent one, raised."""
    for tries in itertools.count(1):
        try:
            adapter.write(step=step, metrics=metrics)
            return
        except Exception as exc:
            if tries >= SYNC_TRIES or classify(exc, permanent=permanent_errors_of(adapter)) == "permanent":
                raise
        delay = backoff_s(tries=tries, base_s=SYNC_RETRY_BASE_S, cap_s=SYNC_RETRY_CAP_S)
        if stop is not None and stop.wait(delay):
            raise KeyboardInterrupt
        if stop is None:
            time.sleep(delay)


def _reject(target: _Target, store: CursorStore, step: int, exc: Exception) -> None:
    """The backend rejected ``step`` for good: keep it a gap (recorded once), so the cursor may pass it and the next
    sync retries it; the other steps go on."""
    target.rejected.setdefault(step, exc)
    target.resent.discard(step)  # another commit at this step was written: the step is still not whole there
    if step not in target.gaps:
        store.add_gap(target.adapter, step, f"{type(exc).__name__}: {exc}")
        target.gaps.add(step)


def _acknowledge(target: _Target, store: CursorStore) -> None:
    """Flush the adapter, then advance its cursor (never before the flush returned) through the last step written
    whole: a cursor covers whole steps, so a step with another commit still to send (training, then evaluation at
    one step) is not acknowledged yet, and a sync stopped in between sends that whole step again. An adapter whose
    optional ``durable_step`` says less (wandb keeps the last step's row open until a later step) is acknowledged
    only that far; the rest once a later flush or ``close()`` made it durable."""
    if target.written is None or not target.unflushed:
        return
    try:
        target.adapter.flush()
    except Exception as exc:
        target.error = target.error or exc
        target.unflushed = 0  # not acknowledged; the next sync sends these steps again
        target.written = target.whole = target.flushed = None
        return
    through = target.whole
    held = 0 if through == target.written else min(target.at_written, target.unflushed)
    target.sent += target.unflushed - held
    target.unflushed = held
    if through is None:
        return
    target.flushed = through
    _advance(target, store, _durable(target.adapter, through))


def _durable(adapter: Adapter, flushed: int) -> int | None:
    """The last step durable after a flush: ``flushed``, or less where the adapter's ``durable_step`` says so (as the
    live delivery worker reads it)."""
    if not hasattr(adapter, "durable_step"):
        return flushed
    try:
        durable = adapter.durable_step
    except Exception:
        return None
    return None if durable is None else min(flushed, int(durable))


def _advance(target: _Target, store: CursorStore, through: int | None) -> None:
    """Move the cursor to ``through`` (never back) and forget the gaps delivered up to it."""
    if through is None:
        return
    if target.cursor is None or through > target.cursor:
        store.advance(target.adapter, through)
        target.cursor = through
    done = {step for step in target.resent if step <= through}
    if done:  # rejected live, delivered now
        store.clear_gaps(target.adapter, done)
        target.gaps -= done
        target.resent -= done


def _finish(targets: list[_Target], store: CursorStore, *, status: Status) -> None:
    """Acknowledge what each opened adapter wrote, then close it (a failed one as ``failed``); a close that returned
    made every step it flushed durable."""
    for target in targets:
        _acknowledge(target, store)
        try:
            failed = target.error is not None or target.rejected or target.refused
            target.adapter.close(status="failed" if failed else status)
        except Exception as exc:
            target.error = target.error or exc
            continue
        _advance(target, store, target.flushed)


def _last_step(journal: Source) -> int:
    return -(2**63) if journal.last_step is None else journal.last_step
