"""Background delivery of emitted steps: one thread and one bounded queue per adapter.

``submit()`` only enqueues, so a slow backend never slows the training loop. Each adapter's thread opens it,
writes its steps in increasing order (once each), then flushes and closes it when ``close()`` sends the sentinel.

A write that raises is retried, the *same* step, with exponential backoff (``retry_base_s`` doubling, capped at
``retry_cap_s``). After ``retry_tries`` consecutive failures the adapter is *degraded*: reported through
``logging`` (logger ``metricbus.delivery``: adapter name, step, exception; each kind of report at most once per
adapter per minute) while the other adapters go on. A degraded adapter keeps retrying, so a backend that is down
for a while and comes back receives every step, in order. While degraded, a full queue drops the newest step at once
instead of blocking the loop. On a strict bus the failure is kept and re-raised as
:class:`~metricbus.errors.AdapterError` at the next ``commit()`` or ``close()``; a strict bus stops writing to that
adapter instead of retrying forever.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.errors import AdapterError

logger = logging.getLogger("metricbus.delivery")
REPORT_EVERY_S = 60.0
QUEUE_POLICIES = ("block", "drop")
OnDelivered = Callable[[int, Adapter, int], None]


def check_queue_options(*, queue_size: object, queue_policy: object, queue_timeout_s: object) -> None:
    """Raise ValueError naming the bad queue option and what is valid."""
    if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
        raise ValueError(f"queue_size must be an int >= 1, got {queue_size!r}")
    if queue_policy not in QUEUE_POLICIES:
        raise ValueError(f"unknown queue_policy {queue_policy!r}; use one of {', '.join(QUEUE_POLICIES)}")
    if isinstance(queue_timeout_s, bool) or not isinstance(queue_timeout_s, (int, float)) or queue_timeout_s < 0:
        raise ValueError(f"queue_timeout_s must be a number >= 0, got {queue_timeout_s!r}")


@dataclass(frozen=True, slots=True)
class _Step:
    step: int
    metrics: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class _Stop:
    status: Status


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


class _Worker:
    """One adapter, its queue and its thread. Counters are written only by this worker's thread (or before it)."""

    def __init__(self, delivery: Delivery, index: int, adapter: Adapter, label: str, queue_size: int) -> None:
        self.delivery = delivery
        self.index = index
        self.adapter = adapter
        self.label = label
        self.queue: queue.Queue[_Step | _Stop] = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._run, name=f"metricbus-{label}", daemon=True)
        self.opened = threading.Event()
        self.abandon = threading.Event()  # close() ran out of time: stop retrying, discard the rest
        self.open_error: BaseException | None = None
        self.failed = False  # open failed, or a strict bus gave up on it: no more writes
        self.degraded = False
        self.failures = 0  # failed calls, retries included
        self.delivered = 0
        self.dropped = 0
        self.submitted = 0  # written by the caller's thread only
        self.lost = 0  # steps taken off the queue but never written (failed or abandoned adapter)
        self.last_step: int | None = None

    # -- the adapter's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.adapter.open(run=self.delivery.run)
        except Exception as exc:
            self.open_error = exc
            self.failed = True
            self._fail("open", None, exc, kind="open")
        finally:
            self.opened.set()
        status: Status = "failed"
        while True:
            try:
                item = self.queue.get_nowait() if self.abandon.is_set() else self.queue.get()
            except queue.Empty:
                break
            if isinstance(item, _Stop):
                status = item.status
                break
            if self.failed or self.abandon.is_set():
                self.lost += 1
            else:
                self._deliver(item)
        if self.open_error is None:
            self._call("flush", self.adapter.flush)
            self._call("close", lambda: self.adapter.close(status=status))

    def _deliver(self, item: _Step) -> None:
        d = self.delivery
        tries = 0
        while True:
            try:
                self.adapter.write(step=item.step, metrics=item.metrics)
                break
            except Exception as exc:
                tries += 1
                self.failures += 1
                if tries == 1:
                    d.report(logging.WARNING, self.label, "retry", "adapter %r failed to write step %d: %r; retrying",
                             self.label, item.step, exc)
                if tries == d.retry_tries and not self.degraded:
                    self.degraded = True
                    d.report(logging.ERROR, self.label, "degraded",
                             "adapter %r degraded: %d failed tries at step %d, last %r; the other adapters go on"
                             "%s", self.label, tries, item.step, exc,
                             "" if d.strict else f"; retrying every {d.retry_cap_s:g} s at most")
                if tries >= d.retry_tries and d.strict:
                    self._fail("write", item.step, exc, kind="strict")
                    self.failed = True
                    self.lost += 1
                    return
            delay = min(d.retry_cap_s, d.retry_base_s * 2 ** (tries - 1))
            if self.abandon.wait(delay):
                self.lost += 1
                return
        if self.degraded:
            self.degraded = False
            d.report(logging.WARNING, self.label, "recovered", "adapter %r recovered at step %d after %d failed tries",
                     self.label, item.step, tries)
        self.delivered += 1
        self.last_step = item.step
        if d.on_delivered is not None:
            self._call("on_delivered", lambda: d.on_delivered(self.index, self.adapter, item.step))  # type: ignore[misc]

    def _call(self, verb: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as exc:
            self.failures += 1
            self._fail(verb, self.last_step, exc, kind=verb)

    def _fail(self, verb: str, step: int | None, exc: BaseException, *, kind: str) -> None:
        self.delivery.report(logging.ERROR, self.label, kind, "adapter %r failed in %s at step %s: %r",
                             self.label, verb, step, exc)
        self.delivery.keep(AdapterError(f"adapter {self.label!r} failed in {verb} at step {step}: {exc!r}"), exc)

    # -- the caller's thread -----------------------------------------------------------------------------------

    def put(self, item: _Step, *, deadline: float | None) -> bool:
        """Enqueue without blocking (``deadline`` None, or degraded) or until ``deadline``; False when full."""
        try:
            if deadline is None or self.degraded:
                self.queue.put_nowait(item)
            else:
                self.queue.put(item, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            return False
        return True


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
        on_delivered: OnDelivered | None = None,
        retry_tries: int = 3,
        retry_base_s: float = 0.05,
        retry_cap_s: float = 2.0,
    ) -> None:
        check_queue_options(queue_size=queue_size, queue_policy=queue_policy, queue_timeout_s=queue_timeout_s)
        if isinstance(retry_tries, bool) or not isinstance(retry_tries, int) or retry_tries < 1:
            raise ValueError(f"retry_tries must be an int >= 1, got {retry_tries!r}")
        self.strict = strict
        self.on_delivered = on_delivered
        self.retry_tries = retry_tries
        self.retry_base_s = retry_base_s
        self.retry_cap_s = retry_cap_s
        self._policy = queue_policy
        self._timeout_s = float(queue_timeout_s)
        self.run = RunInfo()
        self.report = _Reporter()
        self._errors: list[AdapterError] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        names = [getattr(a, "name", type(a).__name__) for a in adapters]
        labels = [n if names.count(n) == 1 else f"{n}[{i}]" for i, n in enumerate(names)]
        self._workers = [_Worker(self, i, a, labels[i], queue_size) for i, a in enumerate(adapters)]

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
    def degraded(self) -> list[str]:
        """Adapters whose last tries failed (they are still being retried unless failed)."""
        return [w.label for w in self._workers if w.degraded]

    @property
    def failed(self) -> list[str]:
        """Adapters that no longer receive steps (open failed, or a strict bus gave up on them)."""
        return [w.label for w in self._workers if w.failed]

    def keep(self, err: AdapterError, cause: BaseException) -> None:
        """Remember ``err`` (caused by ``cause``) for the next check() on a strict bus."""
        if self.strict:
            err.__cause__ = cause
            with self._lock:
                self._errors.append(err)

    # -- the bus's verbs ---------------------------------------------------------------------------------------

    def open(self, *, run: RunInfo) -> None:
        """Start one thread per adapter; each opens its adapter. A strict bus waits and raises an open failure."""
        if self._started:
            raise RuntimeError("Delivery.open() called twice")
        self._started = True
        self.run = run
        for worker in self._workers:
            worker.thread.start()
        if not self.strict:
            return  # writes queue behind the open; a failed open is reported from the adapter's thread
        for worker in self._workers:
            worker.opened.wait()
        if any(w.open_error is not None for w in self._workers):
            with self._lock:
                first = self._errors.pop(0) if self._errors else None
            self.close(status="failed", timeout_s=self._timeout_s, check=False)
            if first is not None:
                raise first

    def submit(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Enqueue one emitted step for every adapter (a read-only copy of ``metrics``, shared)."""
        item = _Step(step, MappingProxyType(dict(metrics)))
        deadline = time.monotonic() + self._timeout_s if self._policy == "block" else None
        for worker in self._workers:
            if worker.failed:
                continue
            worker.submitted += 1
            if not worker.put(item, deadline=deadline):
                worker.dropped += 1
                why = "degraded" if worker.degraded else self._policy
                self.report(logging.WARNING, worker.label, "drop",
                            "adapter %r: queue full, dropped step %d (%s); drops are counted and reported at close",
                            worker.label, step, why)

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
            with contextlib.suppress(queue.Full):  # joined below; still busy at the deadline: abandoned
                worker.queue.put(_Stop(status), timeout=max(0.0, deadline - time.monotonic()))
        for worker in started:
            worker.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in started:
            if worker.thread.is_alive():
                left = worker.submitted - worker.dropped - worker.delivered
                worker.abandon.set()
                with contextlib.suppress(queue.Full):  # wakes a thread that emptied its queue meanwhile
                    worker.queue.put_nowait(_Stop(status))
                logger.error("adapter %r did not drain within %g s: %d steps not delivered (last delivered step %s)",
                             worker.label, timeout_s, left, worker.last_step)
            if worker.dropped:
                logger.warning("adapter %r: %d steps dropped at a full queue (queue_policy %r)", worker.label,
                               worker.dropped, self._policy)
            if worker.lost:
                logger.warning("adapter %r: %d steps were not delivered (adapter failed)", worker.label, worker.lost)
        if check:
            self.check()
