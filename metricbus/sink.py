"""The sink: where a committed step goes. The journal first (before ``commit()`` returns), then the adapters.

The journal is written on every rank (each its own file); adapters run only on the writer rank, each from its own
delivery thread (:mod:`metricbus.delivery`), and the journal keeps their delivery cursors (advanced only once a
step is durable in the backend: written, then flushed).

At interpreter exit and on SIGTERM (:mod:`metricbus.shutdown`) the journal is closed first, then the adapters get
what is left of ``exit_timeout_s`` (counted from when the exit began, shared by every open bus) to drain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from metricbus import shutdown
from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.delivery import Delivery
from metricbus.errors import JournalError
from metricbus.partial import Partial
from metricbus.spec import Spec

if TYPE_CHECKING:
    from metricbus.journal.reader import Journal, JournalStream


class Sink:
    """The journal (optional) and the delivery of emitted steps to the adapters."""

    def __init__(
        self,
        *,
        adapters: Sequence[Adapter],
        journal: str | None,
        fsync: str,
        rank: int,
        run: RunInfo,
        world: int = 1,
        rules: list[tuple[str, Spec]],
        log_every: int,
        strict: bool,
        queue_size: int,
        queue_policy: str,
        queue_timeout_s: float,
        write_timeout_s: float,
        exit_timeout_s: float,
        on_open_error: str = "raise",
        previous: Journal | JournalStream | None = None,
        opened_unix_ns: int | None = None,
    ) -> None:
        self._exit_timeout_s = exit_timeout_s
        self._previous = previous  # the journal this run resumes, until its first commit
        self._journal: Any = None
        # Journals one worker's commit held in columns, without a Partial (JournalWriter.append_columns); False
        # where it wrote nothing: then record() journals it. Writes nothing until a resumed run's first record().
        self.columns: Callable[..., bool] = _nothing_written
        if journal is not None:
            from metricbus.journal import open_journal

            self._journal = open_journal(
                path=journal, fsync=fsync, rank=rank, run=run, rules=rules, log_every=log_every, world=world,
                opened_unix_ns=opened_unix_ns,
            )
            if previous is None:
                self.columns = self._journal.append_columns
        self.delivery = Delivery(
            list(adapters),
            strict=strict,
            queue_size=queue_size,
            queue_policy=queue_policy,
            queue_timeout_s=queue_timeout_s,
            write_timeout_s=write_timeout_s,
            on_delivered=None if self._journal is None else self._journal.delivered,
            on_gap=None if self._journal is None else self._journal.skipped,
            on_opened=None if self._journal is None else self._journal.opened,
            on_rewound=None if self._journal is None else self._journal.rewound,
            on_open_error=on_open_error,
        )
        if self._journal is not None:  # an adapter that keeps unacknowledged data (jsonl) drops it before appending
            from metricbus.journal.cursors import resume_adapter

            store = self._journal.cursors
            for adapter in adapters:
                cursor, identity = store.get(adapter), store.identity(adapter)
                if cursor is not None or identity is not None:  # only a backend this journal wrote to before
                    resume_adapter(adapter, cursor, identity)
        try:
            self.delivery.open(run=run)
        except BaseException:
            if self._journal is not None:
                self._journal.close()
            raise
        self._has_adapters = bool(adapters)

    @property
    def journaled(self) -> bool:
        """True when commits are journaled."""
        return self._journal is not None

    @property
    def durable(self) -> bool:
        """True when there is something to close at interpreter exit (a journal or adapters)."""
        return self._journal is not None or self._has_adapters

    def record(self, *, step: int, entries: list[tuple[int, Partial]]) -> None:
        """Journal one commit (every worker's partial this process keeps), before commit() returns.

        The first commit of a resumed run first tells each adapter what it missed (see :mod:`metricbus.resume`);
        cursors move back before the commit is journaled, so a crash in between sends steps again, never skips them.
        """
        failure = None
        if self._previous is not None:
            previous, self._previous = self._previous, None
            self.columns = self._journal.append_columns
            failure = self._catch_up(previous, step)
        if self._journal is not None:
            try:
                self._journal.append(step=step, entries=entries)
            except JournalError as exc:
                if failure is None:
                    raise
                raise JournalError(f"{exc}; before it, {failure}") from exc
        if failure is not None:
            raise failure

    def _catch_up(self, previous: Journal | JournalStream, step: int) -> JournalError | None:
        """Tell each adapter what it missed. Where that fails (the old journal unreadable, a cursor not
        writable), the adapters not caught up yet are stopped for this run, their cursors moved below ``step``
        where they can be (so ``metricbus sync`` sends the new timeline from there): the commit is journaled, and
        the returned error is raised after it."""
        from metricbus.resume import catch_up

        store = self._journal.cursors
        adapters = self.delivery.adapters
        # Backends this journal delivered to whose adapter this bus lacks: a rewind moves their cursors back too, so
        # `metricbus sync` later sends them the resumed timeline (else they keep the abandoned one's steps).
        rewinding = previous.last_step is not None and step <= previous.last_step
        others = store.others(adapters) if rewinding else {}
        if not adapters and not others:
            return None
        done = 0
        try:
            cursors = [store.get(a) for a in adapters]
            plans = catch_up(previous, step=step, cursors=cursors, others=list(others.values()))
            for key, plan in zip(others, plans[len(adapters) :], strict=True):
                if plan.rewind is not None:
                    store.rewind_other(key, plan.cursor)
            for index, (adapter, plan) in enumerate(zip(adapters, plans[: len(adapters)], strict=True)):
                # a rewind an earlier run left pending (its backend holds an abandoned timeline from there on,
                # below this plan's cursor): done first, as this plan's own would be
                rewind = plan.rewind if plan.rewind is not None else store.pending_rewind(adapter)
                if plan.rewind is not None:
                    store.rewind(adapter, plan.cursor, abandoned=True)
                if rewind is not None or plan.steps:
                    self.delivery.resume(index, rewind=rewind, steps=plan.steps)
                done = index + 1
        except Exception as exc:
            stuck = []
            for key in others if not done else ():
                try:
                    store.rewind_other(key, step - 1)
                except Exception:
                    stuck.append(key)
            for index in range(done, len(adapters)):
                try:
                    store.rewind(adapters[index], step - 1, abandoned=rewinding)
                except Exception:
                    stuck.append(self.delivery.label(index))
                why = f"could not catch it up with the resumed journal ({type(exc).__name__}: {exc})"
                self.delivery.give_up(index, why=why, cause=exc)
            also = (
                f"; the delivery cursors of {', '.join(stuck)} could not be moved below step {step} either"
                if stuck
                else ""
            )
            error = JournalError(
                f"resumed run, commit at step {step}: could not catch the adapters up with the journal "
                f"({type(exc).__name__}: {exc}); the step is journaled, and the adapters not caught up are stopped "
                f"for this run: once the cause is fixed, `metricbus sync {self._journal.directory}` sends them what "
                f"they miss{also}"
            )
            error.__cause__ = exc
            return error
        return None

    def submit(self, *, step: int, metrics: Mapping[str, float], repeat: bool = False) -> None:
        """Hand an emitted step to the adapters (enqueue only); ``repeat``: the commit :meth:`hold` was for."""
        self.delivery.submit(step=step, metrics=metrics, repeat=repeat)

    def hold(self, step: int) -> bool:
        """Before journaling a second commit at ``step``: keep every adapter's delivery cursor below it until that
        commit's emission was written (Delivery.hold). True where there is a cursor to hold (a journal)."""
        if self._journal is None or not self._has_adapters:
            return False
        self.delivery.hold(step)
        return True

    def release(self, step: int) -> None:
        """End :meth:`hold`: the commit at ``step`` emitted nothing there."""
        self.delivery.release(step)

    def check(self) -> None:
        """Re-raise a strict bus's adapter failure."""
        self.delivery.check()

    def flush(self, *, timeout_s: float) -> bool:
        """Wait until every running adapter acknowledged every submitted step; False on timeout."""
        return self.delivery.flush(timeout_s=shutdown.bounded(timeout_s, self._exit_timeout_s))

    def close(self, *, status: Status, timeout_s: float) -> None:
        """Close the journal, then drain, flush and close the adapters (at exit: within ``exit_timeout_s``)."""
        timeout_s = shutdown.bounded(timeout_s, self._exit_timeout_s)
        try:
            if self._journal is not None:
                self._journal.close()
        finally:
            try:
                self.delivery.close(status=status, timeout_s=timeout_s)
            finally:
                if self._journal is not None:
                    self._journal.release_cursors()


def _nothing_written(*, step: int, rank: int, layout: bytes, fields: Any) -> bool:
    """:attr:`Sink.columns` where it writes nothing."""
    return False
