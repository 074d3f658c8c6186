"""Background delivery of emitted steps: one thread and one bounded queue per adapter.

``submit()`` only enqueues, so a slow backend never slows the training loop. Each adapter's thread opens it,
writes its steps in increasing order (once each), then flushes and closes it when ``close()`` sends the sentinel.

**Acknowledgement means durable.** ``on_delivered(index, adapter, step)`` (the journal advances that adapter's
cursor with it) is called only after the adapter's ``flush()`` returned *after* ``step`` was written: it says
"every step up to ``step`` this adapter was given is durable in the backend". Flushes are batched: after
``FLUSH_EVERY_STEPS`` written steps, ``FLUSH_EVERY_S`` after the first unflushed write (also when the queue runs
empty meanwhile), at :meth:`Delivery.flush` and at close. A crash loses at most unacknowledged steps, which
``metricbus sync`` sends again from the journal.

**Errors are classified** (:mod:`metricbus.errors_classify`). A *transient* error (connection, timeout, HTTP 5xx,
429) is retried, the *same* step, with exponential backoff (``retry_base_s`` doubling, capped at ``retry_cap_s``).
After ``retry_tries`` consecutive failures the adapter is *degraded*: reported through ``logging`` (logger
``metricbus.delivery``: adapter name, step, exception; each kind of report at most once per adapter per minute)
while the other adapters go on. It keeps retrying, so a backend that is down for a while and comes back receives
every step, in order; meanwhile a full queue drops the newest step at once instead of blocking the loop (kept as
a gap next to the journal, so ``metricbus sync`` delivers it). A *permanent* error (the backend rejects this
step's data: HTTP 4xx, MLflow ``INVALID_PARAMETER_VALUE``, protobuf's ``Value out of range``, a ValueError/TypeError
of the adapter's own conversion, or a type in the adapter's
``permanent_errors``) skips the step for that adapter: it is reported (adapter, step, metric if known, reason),
kept in :attr:`Delivery.gaps` and passed to ``on_gap(index, adapter, step, reason)``. **An adapter that skipped a
step is closed with status "failed"** (MLflow ``FAILED``, wandb exit code 1), never left running as if complete; so
is one that lacks steps it was given (dropped at a full queue, or left unwritten when ``close()`` ran out of time).
An adapter that wrote a step but refused some of its metric names (:class:`~metricbus.errors.RejectedMetricsError`:
a name its backend keeps for itself) has delivered that step: each refused name is reported once
(:attr:`Delivery.refused`, and kept for a strict bus), never retried (it is refused every time), and its run is
closed as failed too.

**A hung or dead adapter never stalls training.** An adapter whose ``open``, ``write`` or ``flush`` call has run
longer than ``write_timeout_s`` (default :data:`WRITE_TIMEOUT_S`), or whose thread died of any ``BaseException``
(``SystemExit`` included), is *stopped*: reported once, its queued steps released from memory (the journal keeps
them, and its cursor says where ``metricbus sync`` resumes), and ``submit()`` skips it from then on. The deadline
is checked at each ``submit()`` (and while ``flush()``/``close()`` wait), so it costs no extra thread. Should the
stuck call return later, the thread closes the adapter with status "failed".

On a strict bus every failure is kept and re-raised as :class:`~metricbus.errors.AdapterError` at the next
``commit()`` or ``close()``; a strict bus stops writing to an adapter after ``retry_tries`` transient failures.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.delivery_worker import WAIT_SLICE_S, Worker, _Resume, _Step, _Stop, _Sync
from metricbus.errors import AdapterError, RejectedMetricsError
from metricbus.step_metrics import StepMetrics

logger = logging.getLogger("metricbus.delivery")
REPORT_EVERY_S = 60.0
QUEUE_POLICIES = ("block", "drop")
WRITE_TIMEOUT_S = 30.0  # an adapter call running longer than this stops the adapter (see the module docstring)
OPEN_ERROR_POLICIES = ("raise", "warn")
OnDelivered = Callable[[int, Adapter, int], None]
OnGap = Callable[[int, Adapter, int, str], None]
OnOpened = Callable[[int, Adapter], None]


def check_queue_options(*, queue_size: object, queue_policy: object, queue_timeout_s: object) -> None:
    """Raise ValueError naming the bad queue option and what is valid."""
    if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
        raise ValueError(f"queue_size must be an int >= 1, got {queue_size!r}")
    if queue_policy not in QUEUE_POLICIES:
        raise ValueError(f"unknown queue_policy {queue_policy!r}; use one of {', '.join(QUEUE_POLICIES)}")
    seconds = _seconds(queue_timeout_s)
    if seconds is None or not seconds >= 0:
        raise ValueError(
            f"queue_timeout_s must be a number of seconds >= 0 (at most {threading.TIMEOUT_MAX:g}), got "
            f"{queue_timeout_s!r}"
        )


def check_open_error(value: object) -> str:
    """``value`` if it is a valid ``on_open_error`` policy, else a ValueError saying what is valid."""
    if value not in OPEN_ERROR_POLICIES:
        raise ValueError(
            f"on_open_error must be 'raise' (an adapter that cannot open fails the bus's construction) or 'warn' "
            f"(log it and train without that adapter; the journal keeps its steps for `metricbus sync`), got {value!r}"
        )
    return str(value)


def check_seconds(option: str, value: object) -> float:
    """``value`` as a float number of seconds > 0; else a ValueError naming ``option``."""
    seconds = _seconds(value)
    if seconds is None or not seconds > 0:
        raise ValueError(f"{option} must be a number of seconds > 0 (at most {threading.TIMEOUT_MAX:g}), got {value!r}")
    return seconds


def as_seconds(value: object) -> float | None:
    """``value`` as a float (an int beyond the double range: ``math.inf``; NaN and negatives stay), or None for what
    is not a number (a bool included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond the double range
        return math.inf


def _seconds(value: object) -> float | None:
    """``value`` as a float a thread can wait (not NaN, at most ``threading.TIMEOUT_MAX``; negative stays), else
    None."""
    seconds = as_seconds(value)
    return seconds if seconds is not None and seconds <= threading.TIMEOUT_MAX else None


@dataclass(frozen=True, slots=True)
class Gap:
    """A step one adapter skipped because its backend rejected it (a permanent error)."""

    adapter: str
    step: int
    metric: str | None
    reason: str


class _Reporter:
    """Logs each (adapter, kind) report at most once per ``REPORT_EVERY_S``; counts what it held back."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def __call__(self, level: int, label: str, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get((label, kind), -REPORT_EVERY_S) < REPORT_EVERY_S:
                return
            self._last[(label, kind)] = now
        logger.log(level, msg, *args)


class Delivery:
    """Hands every emitted step to each adapter's background thread; failures stay with their adapter."""

    def __init__(
        self,
        adapters: Sequence[Adapter],
        *,
        strict: bool,
        queue_size: int = 1024,
        queue_policy: str = "block",
        queue_timeout_s: float = 10.0,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        on_delivered: OnDelivered | None = None,
        on_gap: OnGap | None = None,
        on_opened: OnOpened | None = None,
        on_rewound: OnDelivered | None = None,
        on_open_error: str = "raise",
        retry_tries: int = 3,
        retry_base_s: float = 0.05,
        retry_cap_s: float = 2.0,
    ) -> None:
        check_queue_options(queue_size=queue_size, queue_policy=queue_policy, queue_timeout_s=queue_timeout_s)
        if isinstance(retry_tries, bool) or not isinstance(retry_tries, int) or retry_tries < 1:
            raise ValueError(f"retry_tries must be an int >= 1, got {retry_tries!r}")
        self.strict = strict
        self.write_timeout_s = check_seconds("write_timeout_s", write_timeout_s)
        self.on_delivered = on_delivered
        self.on_gap = on_gap
        self.on_opened = on_opened  # after an adapter opened (the journal keeps its identity)
        self.on_rewound = on_rewound  # an adapter's cursor must go back to a step
        # What becomes of the steps an adapter misses, for the messages that report them (on_delivered: a journal).
        self.recovery = (
            "the journal keeps the steps it misses for `metricbus sync`" if on_delivered is not None
            else "the steps it misses are lost: this bus has no journal= to send them again from"
        )  # fmt: skip
        self.on_open_error = check_open_error(on_open_error)
        self.retry_tries = retry_tries
        self.retry_base_s = retry_base_s
        self.retry_cap_s = retry_cap_s
        self._policy = queue_policy
        self._timeout_s = float(queue_timeout_s)
        self.run = RunInfo()
        self.report = _Reporter()
        self.gaps: list[Gap] = []
        """Every step an adapter skipped because its backend rejected it, in the order they happened."""
        self.refused: list[Gap] = []
        """Every metric name an adapter's backend refuses (reserved, colliding), at the step it first came: the
        steps' other metrics were delivered (see :class:`~metricbus.errors.RejectedMetricsError`)."""
        self._errors: list[AdapterError] = []
        self._lock = threading.Lock()
        self.cursor_lock = threading.Lock()  # the workers' ``acked`` and ``holds``, and the cursor writes
        self._started = False
        self._closed = False
        names = [getattr(a, "name", type(a).__name__) for a in adapters]
        labels = [n if names.count(n) == 1 else f"{n}[{i}]" for i, n in enumerate(names)]
        self._workers = [Worker(self, i, a, labels[i], queue_size) for i, a in enumerate(adapters)]

    # -- what callers and tests read ---------------------------------------------------------------------------

    @property
    def failures(self) -> dict[str, int]:
        """Failed adapter calls (retries included) per adapter, for adapters that failed at least once."""
        return {w.label: w.failures for w in self._workers if w.failures}

    @property
    def drops(self) -> dict[str, int]:
        """Steps dropped because an adapter's queue was full, per adapter (0 for each adapter without drops)."""
        return {w.label: w.dropped for w in self._workers}

    @property
    def dropped(self) -> int:
        """All steps dropped at full queues, over all adapters."""
        return sum(w.dropped for w in self._workers)

    @property
    def delivered(self) -> dict[str, int]:
        """Steps written successfully, per adapter."""
        return {w.label: w.delivered for w in self._workers}

    @property
    def acknowledged(self) -> dict[str, int | None]:
        """Per adapter, the last step acknowledged (written, then flushed); None before the first."""
        return {w.label: w.acked for w in self._workers}

    @property
    def released(self) -> dict[str, int]:
        """Per stopped adapter, the steps it was never given live (``metricbus sync`` delivers them)."""
        return {w.label: w.released for w in self._workers if w.stopped is not None}

    @property
    def degraded(self) -> list[str]:
        """Adapters whose last tries failed (still retried), or that were stopped because a call hung or died."""
        return [w.label for w in self._workers if w.degraded or w.dead]

    @property
    def failed(self) -> list[str]:
        """Adapters that no longer receive steps (open failed, strict bus gave up, a call hung, thread died)."""
        return [w.label for w in self._workers if w.stopped is not None]

    def keep(self, err: AdapterError, cause: BaseException | None) -> None:
        """Remember ``err`` (caused by ``cause``) for the next check() on a strict bus."""
        if self.strict:
            err.__cause__ = cause
            with self._lock:
                self._errors.append(err)

    def gap(self, worker: Worker, step: int, metric: str | None, exc: Exception) -> None:
        """``worker``'s backend rejected ``step`` for good: report, record, tell ``on_gap``; the worker goes on."""
        reason = f"{type(exc).__name__}: {exc}"
        self.gaps.append(Gap(worker.label, step, metric, reason))
        self.report(logging.ERROR, worker.label, "gap", "adapter %r rejected step %d%s: %s; step skipped for this "
                    "adapter (%s; its run will be closed as failed)", worker.label, step,
                    "" if metric is None else f" (metric {metric!r})", reason,
                    "gap recorded" if self.on_gap is not None else "lost: this bus has no journal= to record it")
        self.keep(AdapterError(f"adapter {worker.label!r} rejected step {step}: {reason}"), exc)
        if self.on_gap is not None:
            try:
                self.on_gap(worker.index, worker.adapter, step, reason)
            except Exception:
                logger.exception("on_gap failed for adapter %r at step %d", worker.label, step)

    def refuse(self, worker: Worker, step: int, exc: RejectedMetricsError) -> None:
        """``worker``'s backend refuses some metric names of ``step`` and wrote the others: report each name the
        first time (it is refused at every step), keep it in :attr:`refused`; the step counts as delivered."""
        for metric, why in exc.rejected.items():
            if metric in worker.refused:
                continue
            worker.refused[metric] = why
            self.refused.append(Gap(worker.label, step, metric, why))
            logger.error("adapter %r refuses metric %r (first at step %d): %s; the other metrics of its steps are "
                         "delivered, this one is not sent to this backend (the journal and the other adapters keep "
                         "it; its run will be closed as failed); reported once", worker.label, metric, step, why)
            self.keep(AdapterError(f"adapter {worker.label!r} refuses metric {metric!r} (first at step {step}; the "
                                   f"step's other metrics were delivered): {why}"), exc)

    def stop(self, worker: Worker, why: str, cause: BaseException | None, *, dead: bool = True) -> None:
        """Give up on ``worker``: release its backlog, never wait for it again. ``dead``: a call hung or its thread
        died (else its thread is alive and idle, and closes the adapter as failed at close)."""
        with self._lock:
            if worker.stopped is not None:
                return
            worker.stopped, worker.dead = why, dead
        worker.released += worker.release()
        self.report(logging.ERROR, worker.label, "stopped", "adapter %r degraded: %s; %d queued steps released "
                    "(%s); commits no longer wait for it", worker.label, why, worker.released, self.recovery)
        self.keep(AdapterError(f"adapter {worker.label!r} stopped: {why}"), cause)

    def label(self, index: int) -> str:
        """The label of adapter ``index`` (its name, numbered where two share it)."""
        return self._workers[index].label

    def give_up(self, index: int, *, why: str, cause: BaseException | None) -> None:
        """Stop adapter ``index`` for this run (:meth:`stop`, its thread alive): it gets no more steps (the journal
        keeps them for ``metricbus sync``) and is closed as failed at close."""
        self.stop(self._workers[index], why, cause, dead=False)

    def _watch(self, worker: Worker, now: float) -> None:
        """Stop ``worker`` if its running call is past the write deadline."""
        if worker.overdue(now):
            self.stop(worker, f"{worker.busy_verb}() ran longer than write_timeout_s={self.write_timeout_s:g} s",
                      TimeoutError(f"{worker.busy_verb}() did not return"))

    # -- the bus's verbs ---------------------------------------------------------------------------------------

    def open(self, *, run: RunInfo) -> None:
        """Start one thread per adapter, each opening its adapter, and wait (up to ``write_timeout_s``) for them.

        An adapter that failed to open, or did not open in time, raises :class:`~metricbus.errors.AdapterError`
        naming it, the reason and the fix (every adapter is closed first), unless ``on_open_error="warn"``: then
        it is reported and left out, and the journal keeps its steps for ``metricbus sync``.
        """
        if self._started:
            raise RuntimeError("Delivery.open() called twice")
        self._started = True
        self.run = run
        for worker in self._workers:
            worker.thread.start()
        deadline = time.monotonic() + self.write_timeout_s + WAIT_SLICE_S
        for worker in self._workers:
            while not worker.opened.wait(WAIT_SLICE_S) and time.monotonic() < deadline:
                pass
            self._watch(worker, time.monotonic())
        failed = [w for w in self._workers if w.open_error is not None or (w.dead and not w.opened.is_set())]
        if not failed or self.on_open_error == "warn":
            return
        with self._lock:
            self._errors.clear()
        self.close(status="failed", timeout_s=self._timeout_s, check=False)
        worker = failed[0]
        exc = worker.open_error
        why = f"{type(exc).__name__}: {exc}" if exc is not None else str(worker.stopped)
        raise AdapterError(
            f"adapter {worker.label!r} could not open ({why}). Fix the cause, remove the adapter, or pass "
            f"on_open_error='warn' to train without it ({self.recovery})"
        ) from exc

    def resume(self, index: int, *, rewind: int | None, steps: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """A resumed run's first delivery to adapter ``index``: rewind its backend to ``rewind`` (None: no rewind),
        then write ``steps`` (what it missed), ahead of every step submitted later; one queue item whatever its size.
        """
        worker = self._workers[index]
        if worker.stopped is not None:
            worker.released += len(steps)
            return
        item = _Resume(rewind, tuple(_Step(s, StepMetrics(m)) for s, m in steps))
        worker.submitted += len(steps)
        if not worker.put(item, deadline=time.monotonic() + self._timeout_s, even_degraded=True):
            worker.dropped += len(steps)

    def label_of(self, thread: threading.Thread) -> str | None:
        """The label of the adapter whose delivery thread ``thread`` is, else None."""
        for worker in self._workers:
            if worker.thread is thread:
                return worker.label
        return None

    @property
    def adapters(self) -> list[Adapter]:
        """The adapters, in order (index = position)."""
        return [w.adapter for w in self._workers]

    def hold(self, step: int) -> None:
        """A second commit at ``step`` is about to be journaled (before it is): every adapter's cursor goes below
        ``step`` now and stays there until that commit's emission (``submit(repeat=True)``) was written, or
        :meth:`release` says none comes. So a crash in between never leaves a cursor covering a step the adapter
        did not get whole, and ``metricbus sync`` sends it again."""
        on_rewound = self.on_rewound
        for worker in self._workers:
            with self.cursor_lock:
                worker.holds.append(step)
                rewind = worker.acked is not None and worker.acked >= step
                if rewind:
                    worker.acked = step - 1
                    if on_rewound is not None:
                        try:
                            on_rewound(worker.index, worker.adapter, step - 1)
                        except Exception as exc:
                            self.report(logging.ERROR, worker.label, "on_rewound",
                                        "adapter %r: its cursor could not go back before step %d: %r",
                                        worker.label, step, exc)

    def release(self, step: int) -> None:
        """End :meth:`hold` of ``step``: that commit emitted nothing at it."""
        for worker in self._workers:
            worker.unhold(step)

    def settle(self) -> None:
        """Before a commit's reduction: hand the GIL to any adapter thread woken but not yet running
        (:meth:`metricbus.delivery_worker.Bounded.settle`)."""
        for worker in self._workers:
            if worker.stopped is None:
                worker.queue.settle()

    def submit(self, *, step: int, metrics: Mapping[str, float], repeat: bool = False) -> None:
        """Enqueue one emitted step for every adapter (a read-only copy of ``metrics``, shared: a
        :class:`~metricbus.step_metrics.StepMetrics`); ``repeat``: the commit :meth:`hold` held the cursors for."""
        item = _Step(step, StepMetrics(metrics), repeat)
        now = time.monotonic()
        deadline = now + self._timeout_s if self._policy == "block" else None
        for worker in self._workers:
            self._watch(worker, now)
            if worker.stopped is not None:
                if worker.dead:
                    worker.released += 1
                if repeat:
                    worker.unhold(step)
                continue
            worker.submitted += 1
            if worker.put(item, deadline=deadline):
                continue
            if repeat:  # not queued: never written by this worker
                worker.unhold(step)
            self._watch(worker, time.monotonic())
            if worker.stopped is not None:
                worker.released += 1
                continue
            worker.dropped += 1
            why = "degraded" if worker.degraded else self._policy
            self.report(logging.WARNING, worker.label, "drop",
                        "adapter %r: queue full, dropped step %d (%s); drops are counted and reported at close; "
                        "%s", worker.label, step, why, self.recovery)
            self._record_drop(worker, step, why)

    def _record_drop(self, worker: Worker, step: int, why: str) -> None:
        """Keep a dropped step as a gap next to the journal: the cursor passes it, so only the gap brings it back."""
        if self.on_gap is None:
            return
        try:
            self.on_gap(worker.index, worker.adapter, step, f"dropped at a full queue ({why})")
        except Exception:
            logger.exception("on_gap failed for adapter %r at dropped step %d", worker.label, step)

    def flush(self, *, timeout_s: float) -> bool:
        """Wait until every adapter still running wrote, flushed and acknowledged every step submitted so far.

        True when all did within ``timeout_s``; False on timeout. Stopped adapters (hung, dead, failed to open)
        are not waited for: the journal keeps their steps for ``metricbus sync``.
        """
        if not self._started or self._closed:
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        waits = []
        for worker in self._workers:
            done = threading.Event()
            if worker.stopped is None and worker.put(_Sync(done), deadline=deadline):
                waits.append((worker, done))
            elif worker.stopped is None:
                self._watch(worker, time.monotonic())
                if worker.stopped is None:
                    return False
        for worker, done in waits:
            while not done.wait(min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))):
                now = time.monotonic()
                self._watch(worker, now)
                if worker.stopped is not None:
                    break
                if now >= deadline:
                    return False
        return True

    def check(self) -> None:
        """Raise the first pending adapter failure (strict buses only)."""
        with self._lock:
            if not self._errors:
                return
            err = self._errors.pop(0)
            self._errors.clear()
        raise err

    def close(self, *, status: Status, timeout_s: float, check: bool = True) -> None:
        """Drain every queue, flush and close each adapter in its thread, all within ``timeout_s`` in total."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + max(0.0, timeout_s)
        started = self._workers if self._started else []
        for worker in started:
            self._watch(worker, time.monotonic())  # joined below; still busy at the deadline: abandoned
            worker.put(_Stop(status), deadline=None if worker.dead else deadline, even_degraded=True)
        for worker in started:
            while not worker.dead and worker.thread.is_alive() and time.monotonic() < deadline:
                worker.thread.join(timeout=min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic())))
                self._watch(worker, time.monotonic())
        for worker in started:
            self._report_close(worker, status=status, timeout_s=timeout_s)
        if check:
            self.check()

    def _report_close(self, worker: Worker, *, status: Status, timeout_s: float) -> None:
        if worker.dead:
            logger.error("adapter %r was stopped (%s): %d steps not delivered live (last acknowledged step %s); "
                         "%s", worker.label, worker.stopped, worker.released + worker.lost, worker.acked, self.recovery)
        elif worker.thread.is_alive():
            left = worker.submitted - worker.dropped - worker.delivered - worker.gaps
            worker.abandon.set()
            with contextlib.suppress(queue.Full):  # wakes a thread that emptied its queue meanwhile
                worker.queue.put_nowait(_Stop(status))
            logger.error("adapter %r did not drain within %.3g s: %d steps not delivered (last delivered step %s, "
                         "last acknowledged step %s); %s", worker.label, timeout_s, left, worker.last_step,
                         worker.acked, self.recovery)
        if worker.dropped:
            logger.warning("adapter %r: %d steps dropped at a full queue (queue_policy %r)", worker.label,
                           worker.dropped, self._policy)
        if worker.lost and not worker.dead:
            logger.warning("adapter %r: %d steps were not delivered (adapter failed)", worker.label, worker.lost)
        if worker.gaps:
            logger.error("adapter %r skipped %d rejected steps (see Delivery.gaps); its run was closed as failed",
                         worker.label, worker.gaps)
        if worker.refused:
            logger.error("adapter %r refused metric%s %s (see Delivery.refused): the other metrics of those steps "
                         "were delivered; its run was closed as failed", worker.label,
                         "s" if len(worker.refused) > 1 else "", ", ".join(map(repr, worker.refused)))
