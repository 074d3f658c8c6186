"""``MetricBus``: log raw records, commit a step, get exact declared reductions delivered to adapters.

A thin face over four parts: a :class:`~metricbus.collect.Collector` (this worker's records per metric and
update), the :class:`~metricbus.spec_table.SpecTable` (each name's spec), a rank transport with the
:class:`~metricbus.reduce.StepReducer` (update -> rank -> step) and a :class:`~metricbus.sink.Sink` (journal and
adapters). ``commit()`` is "take -> exchange -> journal -> reduce -> deliver".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, SupportsIndex

from metricbus import shutdown, step_check
from metricbus.accumulate import FOLD_AT
from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.canonical import nans
from metricbus.collect import Collector
from metricbus.delivery import WRITE_TIMEOUT_S, as_seconds
from metricbus.errors import (
    AdapterNotFoundError,
    ClosedError,
    ConfigError,
    DistributedError,
    JournalError,
    MetricBusError,
    MetricBusWarning,
    MetricTypeError,
    MetricValueError,
    SpecError,
    StepError,
)
from metricbus.ingest_nan import check_ingested_nan
from metricbus.options import BusOptions, check_request_timeouts
from metricbus.partial import Partial, Updates, joined_workers
from metricbus.ranks import Commit, LocalRanks, RankTransport, make_transport
from metricbus.reduce import StepReducer
from metricbus.registry import resolve_adapter
from metricbus.rules import Rules, check_pattern
from metricbus.shutdown import EXIT_TIMEOUT_S
from metricbus.sink import Sink
from metricbus.spec import NanPolicy, Spec, SpecLike, check_nan, parse_spec
from metricbus.spec_table import Claim, SpecTable

_NOT_STEPS = frozenset({"bool", "torch.bool"})  # numpy's and torch's booleans have an __index__ too (not a step)

_NOTHING = Partial()


def as_step(step: object) -> int:
    """``step`` as a commit step: an int, or a numpy or torch integer (0-d), in int64's range; else StepError."""
    if isinstance(step, bool) or not isinstance(step, int):
        index = getattr(type(step), "__index__", None)  # numpy and torch integers: their int
        if (
            isinstance(step, bool)
            or index is None
            or str(getattr(step, "dtype", "")) in _NOT_STEPS
            or getattr(step, "ndim", 0) != 0  # a one-element tensor or array is not a step: a 0-d one is
        ):
            why = " (a bool is not a step)" if isinstance(step, bool) else ""
            raise StepError(f"commit step must be an int (or a numpy or torch integer), got {step!r}{why}")
        try:
            step = int(index(step))
        except (TypeError, ValueError, RuntimeError) as exc:  # a tensor of several values, or not an integer
            raise StepError(f"commit step must be an int (or a numpy or torch integer), got {step!r}") from exc
    if not -(2**63) <= step < 2**63:
        raise StepError(f"commit step {step} is out of range; steps are int64 (-2**63 <= step < 2**63)")
    return step
CLOSE_TIMEOUT_S = 30.0  # how long close() (and the close at interpreter exit) gives the adapters to drain


class MetricBus:
    """Collects per-micro-batch records and emits exact hierarchical reductions at each commit."""

    def __init__(
        self,
        *,
        adapters: Sequence[Adapter | str | Mapping[str, Any]] = (),
        rules: Mapping[str, SpecLike] | None = None,
        log_every: int = 1,
        nan: NanPolicy = "propagate",
        strict: bool = False,
        run: RunInfo | Mapping[str, Any] | None = None,
        dist: str | None = "auto",
        group: Any = None,
        writer_rank: int = 0,
        journal: str | None = None,
        fsync: str = "interval",
        queue_size: int = 1024,
        queue_policy: str = "block",
        queue_timeout_s: float = 10.0,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        exit_timeout_s: float = EXIT_TIMEOUT_S,
        resume: bool = False,
        on_open_error: str = "raise",
    ) -> None:
        opts = BusOptions.build(
            adapters=adapters, rules=rules, log_every=log_every, nan=nan, strict=strict, run=run, dist=dist,
            group=group, writer_rank=writer_rank, journal=journal, fsync=fsync, queue_size=queue_size,
            queue_policy=queue_policy, queue_timeout_s=queue_timeout_s, write_timeout_s=write_timeout_s,
            exit_timeout_s=exit_timeout_s, resume=resume, on_open_error=on_open_error,
        )  # fmt: skip
        previous = None
        if opts.journal is not None:
            from metricbus.resume import previous_run

            run_info, previous = previous_run(opts.journal, resume=opts.resume, run=opts.run, log_every=opts.log_every)
        elif opts.resume:
            raise ConfigError("resume: needs a journal (the run to continue is read from it); pass journal=DIR")
        else:
            run_info = opts.run
        self.run = run_info or RunInfo()
        self._rules = Rules(opts.rules)
        self._table = SpecTable(self._rules)
        self._collector = Collector(table=self._table, nan=opts.nan)
        self._fast = self._collector.fast
        self._reducer = StepReducer(log_every=opts.log_every)
        self._log_every = opts.log_every
        self._ingested: list[Partial] = []
        # the partials of a commit that failed before anything left this process, worker by worker (ingest order):
        # the next commit joins worker i's with the i-th partial ingested for it (records stay buffered)
        self._held: list[Partial] = []
        # the Partial objects whose records are partly in _ingested or _held (a refused metric left out at ingest(),
        # a commit(only=...) that took some names): ingesting one again would count the rest twice (_check_once)
        self._sources: list[Partial] = []
        self._last_step: int | None = None
        self._resumed_after = None if previous is None else previous.last_step  # commit() without a step: next one
        self._step_names: set[str] = set()  # the metrics the last step's commits held
        self._closed = False
        self._forked_from: int | None = None  # in a child of os.fork(): the PID of the process that built the bus
        self._late_names: set[str] = set()  # metrics an adapter logged while close() drained it (named once)
        # run first by close() (not at exit): an owner holding records for this bus commits them (MetricBusLogger)
        self._before_close: Callable[[], None] | None = None
        self._lock = shutdown.BusLock()  # commits, ingests, exports and close run one at a time
        self._ranks: RankTransport = make_transport(dist=opts.dist, group=opts.group, writer_rank=opts.writer_rank)
        built: list[Adapter] = [_resolve(i, a) for i, a in enumerate(opts.adapters)]  # every rank fails alike
        check_request_timeouts(built, write_timeout_s=opts.write_timeout_s)  # (specs were checked as given)
        opened: int | None = None  # when this run (or resume) began: the writer's clock, in every rank's journal
        if self._ranks.collective:  # one run on every rank: the writer's id and start time
            shared = self._agreed_options(opts)
            self.run = dataclasses.replace(self.run, id=shared[0], start_time_unix_ns=shared[1])
            opened = int(shared[3])
        self._sink = Sink(
            adapters=built if self._ranks.is_writer else [],
            journal=opts.journal, fsync=opts.fsync, rank=self._ranks.rank, world=self._ranks.world, run=self.run,
            rules=self._rules.items(),
            log_every=opts.log_every, strict=opts.strict, queue_size=opts.queue_size,
            queue_policy=opts.queue_policy, queue_timeout_s=opts.queue_timeout_s,
            write_timeout_s=opts.write_timeout_s, exit_timeout_s=opts.exit_timeout_s,
            on_open_error=opts.on_open_error, previous=previous if self._ranks.is_writer else None,
            opened_unix_ns=opened,
        )  # fmt: skip
        if self._sink.durable or self._ranks.collective:
            shutdown.track(id(self), self._close_at_exit)
        else:  # nothing to close at exit; a Ctrl-C inside its commit() still waits for the commit to be whole
            shutdown.guard(id(self), self)
        _watch_forks(self)

    def _agreed_options(self, opts: BusOptions) -> list[Any]:
        """The writer's run id, start time and clock now (``[id, start, options, now]``), from every rank's (one
        collective: every rank's journal header then says when this run began by one clock); every rank raises
        ``DistributedError`` alike where the ranks built their buses with options that must agree (a rank's own
        ``nan=`` default or ``log_every`` would make the ranks reduce or emit differently; two ``writer_rank`` two
        writers, or none)."""
        agreed = {"nan": opts.nan, "log_every": opts.log_every, "writer_rank": opts.writer_rank}
        mine = json.dumps([self.run.id, self.run.start_time_unix_ns, agreed, time.time_ns()])
        every = [json.loads(text) for text in self._ranks.gather(mine)]
        for option in agreed:
            seen = {rank: theirs[2][option] for rank, theirs in enumerate(every)}
            if len(set(seen.values())) > 1:
                shown = ", ".join(f"{value!r} on rank {rank}" for rank, value in seen.items())
                raise DistributedError(
                    f"MetricBus({option}=...) differs across the torch.distributed ranks ({shown}); build the bus "
                    f"with the same {option}= on every rank (spec nan= policies that differ go in rules or agg=, "
                    "which the ranks agree on)"
                )
        if not 0 <= opts.writer_rank < self._ranks.world:  # checked after the exchange: every rank raises alike
            raise DistributedError(
                f"writer_rank={opts.writer_rank} is not a rank of the group (size {self._ranks.world})"
            )
        shared: list[Any] = every[opts.writer_rank]
        return shared

    @classmethod
    def from_config(cls, source: Any = None, **overrides: Any) -> MetricBus:
        """Build a bus from a config file path, a mapping (dict or OmegaConf), or ``$METRICBUS_CONFIG``."""
        from metricbus.config import bus_from_config

        return bus_from_config(cls, source, overrides)

    # -- declaring ---------------------------------------------------------------------------------------------

    def define(self, pattern: str, spec: SpecLike, *, nan: NanPolicy | None = None) -> None:
        """Add a rule: metrics matching ``pattern`` (fnmatchcase) get ``spec``; the first matching rule wins.

        Names already logged that it matches first take it too while they hold the default and were never
        committed (their records so far included; a different ``nan=`` policy for records already logged is
        refused); a name logged with ``agg=`` keeps it. One committed with the default, or a worker's declaration
        that differs, is a SpecError naming it, and the rule is not added."""
        check_pattern(pattern)
        parsed = parse_spec(spec, metric=pattern)
        if nan is not None:
            policy = check_nan(nan, metric=pattern)
            if parsed.nan is not None and parsed.nan != policy:
                raise SpecError(
                    f"define({pattern!r}) gives nan={policy!r} and its spec nan={parsed.nan!r}; give one nan policy"
                )
            parsed = Spec(parsed.chains, policy)
        self._collector.define(pattern, parsed)

    def spec_of(self, name: str) -> Spec:
        """The spec ``name`` has (or would get if logged now without ``agg=``)."""
        return self._table.spec(name)

    # -- logging -----------------------------------------------------------------------------------------------

    def log(
        self,
        name: str | Mapping[str, Any],
        value: Any = None,
        *,
        weight: Any = None,
        agg: SpecLike | None = None,
    ) -> None:
        """Record ``value`` (a number, array or tensor: each element one record) for ``name``, or a dict of them.

        Safe from several threads; records of one thread keep their order.
        """
        if weight is None and agg is None:
            if type(value) is float:
                fast = self._fast
                try:
                    buffer = fast.get(name)  # type: ignore[arg-type]
                except TypeError:  # an unhashable name (a dict with a value): the general path says what is wrong
                    buffer = None
                if buffer is not None:
                    buffer.append(value)  # atomic under the GIL; see metricbus.accumulate
                    if self._fast is not fast:  # close() began on another thread since the buffer was read
                        try:
                            self._collector.late(name, ((buffer, value),))
                        except ClosedError as exc:
                            self._logged_while_closing(name, exc)
                    elif len(buffer) >= FOLD_AT:
                        self._collector.fold(name)  # type: ignore[arg-type]
                    return
            elif value is None and type(name) is dict and self._collector.log_floats(name):
                return
        try:
            if self._closed:
                raise self._closed_error(f"log {name!r}")
            self._collector.log(name, value, weight=weight, agg=agg)
        except ClosedError as exc:
            self._logged_while_closing(name, exc)

    def _logged_while_closing(self, name: Any, exc: ClosedError) -> None:
        """A log() refused because close() began: raise ClosedError, except on an adapter's delivery thread (a backend
        that logs into this bus from its write() or close(), or a logging handler that does, while close() drains
        it): there the records are dropped and the metric named once in metricbus's log, where the ClosedError
        failed that write, and so lost the last steps, and stalled close() for its whole timeout."""
        label = None if self._forked_from is not None else self._sink.delivery.label_of(threading.current_thread())
        if label is None:
            raise exc
        key = ", ".join(map(repr, name)) if isinstance(name, Mapping) else repr(name)
        if key in self._late_names:
            return
        self._late_names.add(key)
        shutdown.logger.warning(
            "metricbus: adapter %r logged %s into the bus while close() delivers its last steps; those records come "
            "after the last commit and were dropped (a backend's records are committed only while the bus is open)",
            label, key,
        )  # fmt: skip

    def _on_delivery_thread(self, verb: str) -> None:
        """Refuse ``verb`` on an adapter's delivery thread (from a backend's write() or close(), or a logging handler
        it triggers): close() and a commit() that waits for room in a full queue hold the bus while they wait for
        that thread, so it would wait for itself (close() for its whole timeout, losing the last steps)."""
        label = self._sink.delivery.label_of(threading.current_thread())
        if label is not None:
            raise MetricBusError(
                f"cannot {verb} from adapter {label!r}'s delivery thread (inside its backend's write() or close()): "
                "close() and a commit() waiting for room in its queue wait for that thread, so this would wait for "
                "itself. log() from there is fine; commit and close from the training loop"
            )

    def end_update(self) -> None:
        """End one optimizer update on this worker: the records since the last boundary are its micro level.

        Without boundaries a commit is one update. ``commit()`` ends the last update itself.
        """
        self._check_open("end_update")
        self._collector.end_update()

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """``with bus.update(): ...`` logs one optimizer update (ends it when the block exits, also on error)."""
        try:
            yield
        finally:
            if not self._closed:
                with contextlib.suppress(ClosedError):  # close() began on another thread meanwhile
                    self._collector.end_update()

    # -- exporting and ingesting (single-controller rank level) -----------------------------------------------

    def export(self) -> Partial:
        """This worker's uncommitted records as a picklable Partial; the buffer is left empty."""
        self._on_delivery_thread("export()")
        with self._lock:
            self._check_open("export")
            updates, errors = self._collector.take()
            if errors:
                self._collector.restore(updates)  # keep the good metrics for the next export
                raise _rejected(errors, what="export()", kept="kept for the next export()")
            partial = self._collector.partial(updates)
            partial.packed  # noqa: B018  (packed here, on the worker: the driver reduces it column-wise)
            return partial

    def ingest(self, partials: Iterable[Partial]) -> None:
        """Add workers' partials; they rank in ingest order (before this bus's own records) at the next commit.

        Each partial carries its worker's specs: a name this bus has no rule for takes the worker's declared
        spec. Two different declared specs (this bus's ``agg=`` or rule against a worker's, or two workers')
        raise :class:`~metricbus.errors.SpecError` naming both; a worker's NaN under a ``nan="error"`` name here a
        :class:`~metricbus.errors.MetricValueError`. Such a metric of one partial is left out and the rest of the
        call is ingested (partials in order, the first one's spec settling a conflict): the error lists each
        refused metric with its partial's index in the call. A Partial object ingested twice before a commit
        reduced it (or all of it: one partly taken, by such a refusal or a ``commit(only=...)``) is a
        MetricValueError, and nothing of the call is ingested.
        """
        self._on_delivery_thread("ingest()")
        with self._lock:
            self._check_open("ingest")
            if self._ranks.collective:
                # Ingested partials are workers of their own at the rank level; folding them into one rank's
                # contribution would change rank-level kinds (e.g. rank="mean"), so the combination is refused.
                raise DistributedError(
                    "ingest() cannot be combined with torch.distributed; use export()/ingest() with dist=None, "
                    "or log on every rank and let commit() gather"
                )
            if isinstance(partials, Partial) or not isinstance(partials, Iterable):
                raise MetricTypeError(
                    f"ingest() takes an iterable of Partial objects from export(), got {type(partials).__name__}"
                )
            batch = list(partials)
            for part in batch:  # check all before taking any, so a bad call ingests nothing
                if not isinstance(part, Partial):
                    raise MetricTypeError(f"ingest() takes Partial objects from export(), got {type(part).__name__}")
            _check_once(batch, held=[*self._held, *self._ingested, *self._sources])
            try:
                self._ingest(batch)
                return
            except (SpecError, MetricValueError) as exc:
                if len(batch) == 1 and len(set(batch[0].names())) <= 1:
                    raise  # nothing else in the call to keep
                kind = type(exc)
            # One worker's bad metric would cost every worker's step: take the partials one by one, each without
            # the names it cannot bring, and name what was left out
            refused: list[str] = []
            for i, part in enumerate(batch):
                bad: dict[str, str] = {}
                for name in dict.fromkeys(part.names()):
                    try:
                        self._ingest([_only(part, {name})], dry=True)
                    except (SpecError, MetricValueError) as exc:
                        bad[name] = _NOTHING_TAKEN.sub("", str(exc))
                kept = _only(part, set(part.names()) - set(bad)) if bad else part
                try:
                    if len(kept):
                        self._ingest([kept])
                        if kept is not part:
                            self._sources.append(part)
                except (SpecError, MetricValueError) as exc:  # its names together (e.g. two emitting one output)
                    bad = {", ".join(sorted(set(kept.names()))): _NOTHING_TAKEN.sub("", str(exc))}
                refused.extend(f"  partial {i} of this call: {name!r}: {why}" for name, why in bad.items())
            if not refused:  # one by one, every partial fitted (the call's claims together did not)
                return
            lines = "\n".join(refused)
            raise kind(
                f"ingest(): {len(refused)} metric(s) of the {len(batch)} partials of this call could not be taken "
                f"(left out of the step); every other record of the call was ingested:\n{lines}"
            )

    def _ingest(self, batch: list[Partial], *, dry: bool = False) -> None:
        """Adopt ``batch``'s specs and take it whole, or raise SpecError or MetricValueError and change nothing
        (``dry``: only check)."""
        collector, first = self._collector, len(self._ingested)

        def check(decided: dict[str, Claim]) -> None:
            # this bus's own records of a name were logged under its policy then, and the workers' summaries
            # under theirs: either must fit the policy settled now
            for name, claim in decided.items():
                collector.check_adopted_nan(name, claim.spec, claim.where)
            check_ingested_nan(batch, nan_of=lambda name: collector.nan_of(decided[name].spec), first_worker=first)
            if dry:
                raise _DryRunError

        try:
            self._table.adopt(batch, first_worker=first, check=check)
        except _DryRunError:
            return
        self._collector.respec()
        self._ingested.extend(batch)

    def drop_ingested(self) -> int:
        """Forget the partials ingested since the last commit (and those a refused commit kept), e.g. when a step's
        gather from another group of workers failed and the step is skipped: else the next commit would reduce
        them with its own. Returns how many were dropped. The specs they brought stay adopted."""
        self._on_delivery_thread("drop_ingested()")
        with self._lock:
            self._check_open("drop_ingested")
            dropped = len(self._ingested) + len(self._held)
            self._ingested, self._held, self._sources = [], [], []
            return dropped

    # -- committing --------------------------------------------------------------------------------------------

    @property
    def last_step(self) -> int | None:
        """The step of the last commit (None before the first)."""
        return self._last_step

    @property
    def log_every(self) -> int:
        """How many commits one emitted window spans."""
        return self._log_every

    def commit(self, step: SupportsIndex | None = None, *, only: Iterable[str] | None = None) -> dict[str, float]:
        """End a step: reduce and (every ``log_every``-th commit) emit; returns what was emitted, else ``{}``.

        A metric whose records cannot be reduced (a negative tensor weight, a NaN under ``nan="error"`` found on
        the device) is left out: the others are committed, then :class:`~metricbus.errors.MetricValueError`
        names it. Safe to call from several threads: commits run one at a time.

        ``only``: commit just the records of these names; the others stay buffered, in their updates, for the next
        commit (e.g. evaluation metrics at a step between two training commits, which must not end the training
        window). Under torch.distributed every rank passes the same names.
        """
        kept = None if only is None or isinstance(only, str) else frozenset(only)
        if isinstance(only, str) or (kept is not None and any(not isinstance(name, str) for name in kept)):
            raise MetricTypeError(
                f"commit(only={only!r}): pass an iterable of metric names (str); nothing was committed"
            )
        self._on_delivery_thread("commit()")
        with self._lock:
            self._check_open("commit")
            ranks = self._ranks
            invalid = None
            try:
                step = self._next_step(step)
            except StepError as exc:
                if not ranks.collective:  # nothing reduced: the ingested partials wait, one per worker, as in _commit
                    if self._ingested:
                        self._held, self._ingested = joined_workers(self._held, self._ingested), []
                    raise
                # the other ranks may have passed a valid step: this one enters the commit's collectives all the
                # same, with a step none of them can have (or, at a first commit, the least likely), so that every
                # rank raises and keeps its records instead of waiting on this one (_commit)
                invalid, step = exc, -(2**63) if self._last_step is None else self._last_step - 1
            if ranks.collective and not ranks.usable():
                if ranks.ended is not None:
                    raise DistributedError(
                        f"commit(step={step}) on rank {ranks.rank}: {ranks.ended}, so the ranks cannot commit "
                        "together any more; the records stay buffered (close() closes this rank alone)"
                    )
                raise DistributedError(
                    f"commit(step={step}) on rank {ranks.rank}: the torch.distributed process group was destroyed "
                    "(or never initialized); the records stay buffered. Commit and close() on every rank before "
                    "torch.distributed.destroy_process_group()"
                )
            self._sink.delivery.settle()  # an adapter's thread woken meanwhile runs now, not through the reduction
            updates, errors = self._collector.take()
            apart = None
            if kept is not None:  # the other names' records (own and ingested) stay for the next commit: _Apart
                apart = _Apart(kept, updates, joined_workers(self._held, self._ingested))
                self._sources += [*self._held, *self._ingested]
                updates = [part for u in updates if (part := {n: s for n, s in u.items() if n in kept})]
                self._ingested, self._held = [_only(part, kept) for part in apart.workers], []
            out, rejected = self._commit(step, updates, errors, invalid=invalid, apart=apart)
            if rejected:
                raise _rejected(rejected, what=f"step {step}", kept="committed without them")
            # A strict bus's adapter failure is raised only now, after the step: raising before the collective
            # would leave the writer rank one commit behind the others.
            self._sink.check()
            return out

    def _commit(
        self,
        step: int,
        updates: Updates,
        errors: dict[str, MetricValueError],
        *,
        invalid: StepError | None = None,
        apart: _Apart | None = None,
    ) -> tuple[dict[str, float], dict[str, MetricValueError]]:
        # ``apart``: a commit(only=...) of ``updates`` and the ingested partials' records of those names; where the
        # commit is refused, every record is put back as taken (``back``), else only the other names' (apart.keep)
        # One worker's usual commit (LocalRanks, nothing ingested: this process is worker 0) is journaled from its
        # update's columns as they are, without a Partial; any other from the partials the transport hands back
        journaled = self._sink.journaled
        steady = (
            self._collector.steady(updates)
            if journaled and not self._ingested and not self._held and type(self._ranks) is LocalRanks
            else None
        )
        journaled = journaled and steady is None
        needed = journaled or self._ranks.collective  # else the reducer reads ``updates`` alone
        own = self._collector.partial(updates, undeclared=False) if needed else _NOTHING
        ingested, self._ingested = self._ingested, []
        if self._held:
            ingested, self._held = joined_workers(self._held, ingested), []
        back, workers = (updates, ingested) if apart is None else (apart.updates, apart.workers)
        try:
            commit = Commit(
                own=own, own_updates=updates, ingested=ingested, table=self._table, reducer=self._reducer,
                journaled=journaled, rejected=sorted(errors), step=step, invalid=invalid is not None,
            )
            exchange = self._ranks.exchange(commit)
        except BaseException as exc:
            if not self._ranks.collective:  # nothing left this process: put the records back
                self._collector.restore(back)
                self._held = workers
            elif isinstance(exc, DistributedError) and exc.refused:  # every rank refused it alike
                dropped = self._put_back(back, errors, {}, refused=exc.refused)
                raise DistributedError(f"{exc}. The other records stay buffered{dropped}") from None
            elif isinstance(exc, DistributedError) and self._ranks.ended is not None:  # the backend failed: no rank
                dropped = self._put_back(back, errors, {})  # reduced this step; the ranks cannot commit any more
                raise DistributedError(
                    f"commit(step={step}) on rank {self._ranks.rank}: {self._ranks.ended}; later commits raise, and "
                    f"close() closes this rank alone. The records stay buffered{dropped}"
                ) from None
            raise
        if exchange.mixed:  # another rank is in close(): every rank sees it (dist.TorchRanks.ended)
            dropped = self._put_back(back, errors, exchange.rejected)
            raise DistributedError(
                f"commit(step={step}) on rank {self._ranks.rank}: {self._ranks.ended}; the ranks cannot commit "
                f"together any more: later commits raise, and close() closes this rank alone. The records stay "
                f"buffered{dropped}"
            )
        if exchange.steps is not None or invalid is not None:  # every rank sees the same steps: every rank raises
            dropped = self._put_back(back, errors, exchange.rejected)  # here, keeping its records
            if invalid is not None:
                raise StepError(
                    f"{invalid}; on rank {self._ranks.rank} of a torch.distributed group, whose other ranks raised too "
                    f"(this rank's commit went through the step check as step {step}). The records stay "
                    f"buffered{dropped}"
                ) from None
            assert exchange.steps is not None
            lowest, highest = exchange.steps
            raise DistributedError(
                f"commit(step={step}) on rank {self._ranks.rank}: the ranks committed different steps (lowest "
                f"{lowest}, highest {highest}); every rank must commit the same step, or call commit() without one "
                f"on every rank (a rank whose step was invalid raised a StepError, and shows here as step "
                f"{'-2**63' if self._last_step is None else self._last_step - 1}). The records stay buffered{dropped}"
            )
        names = exchange.names()
        if step == self._last_step:
            again = names & self._step_names
            if again:  # every rank sees the same states, so every rank raises here, and nothing is lost
                dropped = self._put_back(back, errors, exchange.rejected)
                self._held = workers
                shown = ", ".join(repr(n) for n in sorted(again)[:5]) + (" ..." if len(again) > 5 else "")
                raise StepError(
                    f"step {step}: {shown} already committed at this step; a step may hold several commits "
                    f"(training, then evaluation) only with different metric names. The records stay buffered{dropped}"
                )
            self._step_names = self._step_names | names
        else:
            self._step_names = names
        if apart is not None:  # committed: the other names' records wait for the next commit (without those of a
            apart.keep(self, dropped=set(errors) | set(exchange.rejected))  # metric another rank rejected now)
        if not self._held:
            self._sources = []
        # a second commit at a step: the adapters' cursors stay below it until its emission is written (so a crash
        # once it is journaled never leaves a cursor covering a step an adapter did not get whole)
        held = step == self._last_step and self._ranks.is_writer and self._sink.hold(step)
        journal_error = None
        try:
            try:
                if steady is None:
                    self._sink.record(step=step, entries=exchange.journal)
                elif not self._sink.columns(step=step, rank=0, layout=steady[0].layout, fields=steady[1]):
                    # not written from the columns (see Sink.columns): through the commit's own partial
                    self._sink.record(step=step, entries=[(0, self._collector.partial(updates, undeclared=False))])
            except JournalError as exc:  # the step is still reduced and delivered; the journal has a gap
                journal_error = exc
            self._table.seal()
            if self._ranks.collective:  # specs agreed by the ranks (their nan policy) apply from now on; ingest()
                self._collector.respec()  # already applied what ingested workers brought
            self._last_step = step
            out = exchange.commit_to(self._reducer)
            emitted = {} if out is None else self._emit(step, out, repeat=held)
        except BaseException:
            if held:
                self._sink.release(step)
            raise
        if held and not emitted:
            self._sink.release(step)
        if journal_error is not None:
            raise journal_error
        rejected = dict(errors)
        for name, where in exchange.rejected.items():  # another rank's device records of these were bad
            rejected.setdefault(name, MetricValueError(f"{where} rejected the records of {name!r}"))
        return emitted, rejected

    def _put_back(
        self,
        updates: Updates,
        errors: Mapping[str, MetricValueError],
        others: Mapping[str, str],
        *,
        refused: Mapping[str, str] | None = None,
    ) -> str:
        """Put a commit's records back after every rank refused it, without those of metrics another rank rejected
        (``others``: dropped on every rank, as a commit would; ``errors``: this rank's, already left out) or every
        rank refused (``refused``: why); what was dropped, for the error's message."""
        left_out = {**others, **(refused or {})}
        if left_out:
            updates = [{n: s for n, s in update.items() if n not in left_out} for update in updates]
        self._collector.restore(updates)
        reasons = {name: str(error) for name, error in errors.items()}
        reasons.update((name, f"{where} rejected the records of {name!r}") for name, where in others.items())
        reasons.update(refused or {})
        if not reasons:
            return ""
        names = ", ".join(repr(n) for n in sorted(reasons))
        return f"; the records of {names} were dropped ({'; '.join(reasons[n] for n in sorted(reasons))})"

    def _emit(self, step: int, out: dict[str, float], *, repeat: bool = False) -> dict[str, float]:
        nans(out)  # one NaN's bits on every path (canonical.py)
        if out and self._ranks.is_writer:
            self._sink.submit(step=step, metrics=out, repeat=repeat)
        return out

    def _next_step(self, step: SupportsIndex | None) -> int:
        if step is None:
            last = self._last_step if self._last_step is not None else self._resumed_after
            if last is None:
                return 0
            if last + 1 >= 2**63:
                raise StepError(
                    f"commit() after step {last}: the next step, {last + 1}, is out of range; steps are int64 "
                    "(-2**63 <= step < 2**63)"
                )
            return last + 1
        step = as_step(step)
        if self._last_step is not None and step < self._last_step:
            raise StepError(
                f"commit step {step} is less than the last step {self._last_step}; steps never go back within a run "
                f"(another commit at step {self._last_step} is fine for other metrics; to go back to a checkpoint, "
                "build a new bus with resume=True)"
            )
        return step

    # -- flushing and closing ----------------------------------------------------------------------------------

    def flush(self, *, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every adapter wrote, flushed and acknowledged every step committed so far.

        Returns True, or False when ``timeout_s`` ran out first. Adapters stopped because a call hung past
        ``write_timeout_s`` or their thread died are not waited for (the journal keeps their steps for
        ``metricbus sync``). The bus stays open.
        """
        timeout_s = check_wait_s("flush", timeout_s)
        self._on_delivery_thread("flush()")  # it would wait for its own thread until timeout_s
        if self._closed:
            return True
        return self._sink.flush(timeout_s=timeout_s)

    # -- closing -----------------------------------------------------------------------------------------------

    def _check_open(self, verb: str) -> None:
        if self._closed:
            raise self._closed_error(verb)

    def _closed_error(self, verb: str) -> ClosedError:
        if self._forked_from is None:
            return ClosedError(f"cannot {verb}: the bus is closed")
        return ClosedError(
            f"cannot {verb}: this MetricBus was built in process {self._forked_from}, and this process "
            f"({os.getpid()}) is a child of os.fork() (a multiprocessing 'fork' worker, a DataLoader worker) holding "
            "only a copy of it: its journal, adapters and delivery threads are the parent's, which commits and "
            "delivers what it logged. Log in the parent, or build a MetricBus in the child (export() there and "
            "ingest() in the parent); close() in the child does nothing"
        )

    def _fork_child(self) -> None:
        """In a child of ``os.fork()``: this copy of an open bus is closed without touching what the parent's bus
        still uses (its journal file, adapters, their threads) and without committing the records it inherited (the
        parent commits them); ``log()``, ``commit()`` and the others raise ClosedError saying so, ``close()`` does
        nothing. Its locks are new: one a parent thread held at the fork would stay held in the child forever (also
        where the fork came while another thread's close() held them, past setting ``closed``: a commit() in the
        child hung there instead of raising ClosedError)."""
        self._lock = shutdown.BusLock()
        collector = self._collector
        collector.lock = shutdown.BusLock()
        if self._closed:
            return
        self._forked_from = os.getppid()
        self._closed = True
        self._before_close = None
        collector.closed = True
        collector.fast = self._fast = {}  # the lock-free log() paths find no buffer: the validated path raises

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._closed

    def close(self, *, status: Status = "finished", timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Commit records logged since the last commit, emit a partial window, and close the adapters.

        With torch.distributed, ``close()`` is a collective like ``commit()``: call it on every rank, before
        ``destroy_process_group()``. ``close(status="failed")`` (and leaving a ``with`` block on an exception), a
        process group that was already destroyed, and interpreter exit close this rank alone: no collective runs,
        so nothing hangs while the other ranks are elsewhere, and records logged since the last commit are not
        committed (a :class:`~metricbus.errors.MetricBusWarning` says which). Committed steps are never lost.
        """
        timeout_s = check_wait_s("close", timeout_s)  # before anything closes: a bad one leaves the bus open
        if status not in ("finished", "failed"):  # (MLflow's adapter could not end its run with another one)
            raise ConfigError(
                f"close(status={status!r}): status must be 'finished' or 'failed'; the bus was left as it was"
            )
        if self._closed:
            return
        self._on_delivery_thread("close()")
        before, self._before_close = self._before_close, None
        if before is not None:
            before()
        alone = None
        if self._ranks.collective and status == "failed":
            alone = "close(status='failed') (or an exception leaving a `with` block) runs no collective"
        elif self._ranks.collective and not self._ranks.usable():
            alone = self._ranks.ended or "the process group was destroyed before bus.close()"
        self._close(status=status, timeout_s=timeout_s, alone=alone)

    def _close_at_exit(self, status: Status) -> None:
        """The interpreter is exiting with this bus open (see :mod:`metricbus.shutdown`): no collective."""
        alone = "the bus was still open at interpreter exit" if self._ranks.collective else None
        self._close(status=status, timeout_s=CLOSE_TIMEOUT_S, alone=alone)

    def _pending(self) -> bool:
        return bool(self._ingested) or bool(self._held) or bool(self._collector.pending_names())

    def _close(self, *, status: Status, timeout_s: float, alone: str | None) -> None:
        """Close; ``alone`` (why) set: without collectives, leaving this rank's pending records uncommitted."""
        with self._lock:
            if self._closed:
                return
            # first stop taking records: one another thread logs from now on raises ClosedError, where it would
            # land after the last commit took the buffers and be lost (log() returned, nothing committed it)
            self._fast = {}
            self._collector.stop()
            try:
                failure: Exception | None = None
                if alone is not None:
                    self._warn_uncommitted(alone)
                else:
                    try:
                        if self._ranks.any_pending(self._close_check()):
                            self.commit()
                    except Exception as exc:  # the window's committed steps are still emitted, then this raises
                        failure = exc
                        if self._ranks.ended is not None:  # closed alone: name what could not be committed
                            failure = _uncommitted(exc, sorted(self._collector.pending_names()))
                if self._reducer.pending and self._last_step is not None:
                    self._emit(self._last_step, self._reducer.finish())  # rank-level results: same on every rank
                if failure is not None:
                    raise failure
            finally:
                self._closed = True
                self._collector.drained()
                try:
                    self._ranks.settle()
                    self._sink.close(status=status, timeout_s=timeout_s)
                finally:  # last: a SIGINT or SIGTERM while the adapters drain waits for close() to end (see shutdown)
                    shutdown.untrack(id(self))

    def _close_check(self) -> Commit:
        """close()'s question to the other ranks, whether any has records left: a commit of nothing (see
        ``RankTransport.any_pending``)."""
        doing = step_check.CLOSE_PENDING if self._pending() else step_check.CLOSE
        step = -(2**63) if self._last_step is None else self._last_step  # (not compared: nothing is committed)
        return Commit(
            own=_NOTHING, own_updates=[], ingested=[], table=self._table, reducer=self._reducer, journaled=False,
            rejected=[], step=step, doing=doing,
        )

    def _warn_uncommitted(self, why: str) -> None:
        listed = sorted(self._collector.pending_names())
        if not listed:
            return
        shown = ", ".join(repr(n) for n in listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
        since = "the bus was built" if self._last_step is None else f"the last commit (step {self._last_step})"
        warnings.warn(
            f"rank {self._ranks.rank}: records of {shown} logged since {since} were not committed: {why}. "
            "Call bus.commit() or bus.close() on every rank before torch.distributed.destroy_process_group()",
            MetricBusWarning,
            stacklevel=5,
        )

    def __enter__(self) -> MetricBus:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(status="failed" if exc_type is not None else "finished")


_LIVE: weakref.WeakSet[MetricBus] = weakref.WeakSet()  # the buses of this process, for the fork hook
_FORK_HOOKED = False


def _watch_forks(bus: MetricBus) -> None:
    """Close ``bus``'s copy in a child of ``os.fork()`` (:meth:`MetricBus._fork_child`); the hook is installed by the
    first bus built, not at import."""
    global _FORK_HOOKED
    _LIVE.add(bus)
    if not _FORK_HOOKED and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forked)
        _FORK_HOOKED = True


def _forked() -> None:
    for bus in list(_LIVE):
        bus._fork_child()


def _resolve(index: int, adapter: Any) -> Any:
    """The adapter object for ``adapters[index]``; a bad spec's error says which entry it is."""
    try:
        return resolve_adapter(adapter)
    except (ConfigError, AdapterNotFoundError) as exc:
        if str(exc).startswith("adapters["):
            raise
        raise type(exc)(f"adapters[{index}]: {exc}") from exc


# what a refusal of one metric says of its own ingest() call, not of the call that went on without it
_NOTHING_TAKEN = re.compile(r"[;.] [Nn]othing of this ingest\(\) was taken\.?|\. Nothing of the call was ingested")


class _DryRunError(Exception):
    """ingest()'s check of one metric passed: nothing is adopted."""


def _only(part: Partial, names: set[str] | frozenset[str]) -> Partial:
    """``part`` holding only the records of ``names`` (each update's order kept)."""
    return Partial(tuple(e for e in part.entries if e[0] in names), part.undeclared & names)


class _Apart:
    """A ``commit(only=...)``'s records as taken: its own ``updates`` and the ingested partials (``workers``, one per
    worker in ingest order, those a refused commit kept joined in), to put back whole where the commit is refused,
    or without the committed names where it is not."""

    __slots__ = ("kept", "updates", "workers")

    def __init__(self, kept: frozenset[str], updates: Updates, workers: list[Partial]) -> None:
        self.kept, self.updates, self.workers = kept, updates, workers

    def keep(self, bus: MetricBus, *, dropped: set[str]) -> None:
        """The commit went through: the other names' records go back, in their updates (the open one stays open),
        and each worker's partial without the committed names waits to be joined with its next one."""
        gone = self.kept | dropped
        bus._collector.restore([{n: s for n, s in u.items() if n not in gone} for u in self.updates])
        rest = [_only(part, set(part.names()) - gone) for part in self.workers]
        if any(len(part) for part in rest):
            bus._held = rest


def _check_once(batch: Sequence[Partial], *, held: Sequence[Partial]) -> None:
    """Refuse a Partial object ingested twice before a commit reduced it (in ``batch``, or ``held``: ingested since
    the last commit, or kept by a refused one), which would count that worker's records twice. An empty Partial
    holds no records: the same one may stand for several workers."""
    seen = {id(part): "ingested since the last commit (a refused commit keeps them for the next)" for part in held}
    for i, part in enumerate(batch):
        if not len(part):
            continue
        where = seen.get(id(part))
        if where is not None:
            raise MetricValueError(
                f"ingest(): partial {i} of this call (holding {', '.join(map(repr, part.names()[:3]))}"
                f"{' ...' if len(part) > 3 else ''}) is the same Partial object as one {where}; each export() is one "
                "worker's records, to be ingested once (else they count twice). Nothing of this call was ingested"
            )
        seen[id(part)] = f"earlier in this call (partial {i})"


def check_wait_s(call: str, timeout_s: Any) -> float:
    """``timeout_s`` of ``close()``/``flush()`` as a float >= 0 (``math.inf``: no bound); else a ConfigError, where a
    NaN or negative one gave the adapters no time at all (their steps left to ``metricbus sync``, their runs not
    ended) and a string raised a TypeError from inside close(), with the bus marked closed and half of it open."""
    seconds = as_seconds(timeout_s)  # (an int beyond the double range: no bound, as math.inf)
    if seconds is None or not seconds >= 0:
        raise ConfigError(
            f"{call}(timeout_s={timeout_s!r}): timeout_s must be a number of seconds >= 0 (math.inf: no bound); "
            "the bus was left as it was"
        )
    return seconds


def _uncommitted(exc: Exception, names: Sequence[str]) -> Exception:
    """``exc`` (close() on a rank that had to close alone), naming the records it left uncommitted."""
    if not names or not isinstance(exc, DistributedError):
        return exc
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return DistributedError(f"{exc}; the records of {shown} logged since the last commit were not committed")


def _rejected(errors: Mapping[str, MetricValueError], *, what: str, kept: str) -> MetricValueError:
    """One error naming every metric whose records were rejected, and what happened to the others."""
    reasons = "; ".join(str(e) for e in errors.values())
    names = ", ".join(repr(n) for n in errors)
    return MetricValueError(f"{what}: the records of {names} were dropped ({reasons}); the other metrics were {kept}")
