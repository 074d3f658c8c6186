"""One adapter's delivery worker: its queue, its thread, its counters (see :mod:`metricbus.delivery`)."""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from metricbus.adapter import Adapter, Status
from metricbus.errors import AdapterError, RejectedMetricsError
from metricbus.errors_classify import backoff_s, classify, metric_named, permanent_errors_of

if TYPE_CHECKING:
    from metricbus.delivery import Delivery

FLUSH_EVERY_STEPS = 256  # acknowledge at least every this many written steps ...
FLUSH_EVERY_S = 1.0  # ... and at most this long after the first unacknowledged write
WAIT_SLICE_S = 0.25  # how often a blocked submit/flush/close looks at the write deadline again


@dataclass(frozen=True, slots=True)
class _Step:
    step: int
    metrics: Mapping[str, float]
    repeat: bool = False  # a second commit at its step: the cursor is held below it until it is written


@dataclass(frozen=True, slots=True)
class _Stop:
    status: Status


@dataclass(frozen=True, slots=True)
class _Sync:
    done: threading.Event  # set once everything queued before it is written, flushed and acknowledged


@dataclass(frozen=True, slots=True)
class _Resume:
    """A resumed run's first delivery: ``rewind`` (None: none) the backend to a step, then write ``steps``."""

    rewind: int | None
    steps: tuple[_Step, ...]


_Item = _Step | _Stop | _Sync | _Resume


class Bounded:
    """``queue.Queue``'s bounded ``put``/``put_nowait`` and ``get``/``get_nowait`` (the same exceptions, FIFO), built
    for a getter thread that must not fight the putter for the GIL. The counts of items put and taken, under one
    condition, bound it; the items lie in a deque; the getter sleeps on a separate channel (``_bell``).

    Why: a thread that waits for the GIL while the committing thread runs numpy (``reduceat`` releases the GIL at
    every call, other ufuncs over 500 elements too) is woken at each release and loses the race to take it back,
    for up to the 5 ms switch interval: every release then costs a futex wake and an interrupt between the cores.
    Woken at every step, a delivery thread so added ~35 µs to a 100-metric commit's median and ~50 µs of process
    CPU a step, with an adapter that does nothing (``benchmarks/bench_wake.py``, which measures it). Here:

    - While steps keep coming, a put wakes the getter only once ``RING_AT`` items wait (half the queue, if less):
      it takes them in one go. A getter that found nothing waits ``DOZE_S`` at most before it looks again (a step
      waits in the queue that much longer at most); one that then still found nothing sleeps until the next put,
      which wakes it at once (steps further apart than ``DOZE_S``: each is handed over as it comes).
    - A put that finds the getter woken (by a put, or by its doze's end) but not yet running (it is waiting for the
      GIL: the caller's thread holds it, between releases too short to lose it) hands the GIL over: it blocks, at
      most ``HANDOFF_S``, until the getter runs. That costs the caller the getter's work, which a GIL-bound process
      pays in any case, and spares the wake-ups a starving getter costs. A getter that runs as soon as it wakes (the
      caller waits on the GPU or I/O, releasing the GIL for long) is never waited for.
    - Anything but a step (close's sentinel, a flush, a resume) wakes the getter at once.
    """

    __slots__ = ("_bell", "_flowing", "_items", "_lock", "_maxsize", "_put", "_ring_at", "_room", "_rung", "_started",
                 "_state", "_taken", "_waiting", "_wakes_at")

    RING_AT = 64  # steps waiting from which a put wakes a dozing getter (1, with HANDOFF_S 0: a wake at every put)
    DOZE_S = 0.02  # how long a getter that found nothing waits before it looks again, unless woken
    HANDOFF_S = 0.002  # how long a put waits at most for a getter that has not woken yet (0: never)

    _BUSY, _DOZING, _ASLEEP = 0, 1, 2  # the getter: taking items; waiting DOZE_S; waiting for the next put

    def __init__(self, maxsize: int) -> None:
        self._items: deque[_Item] = deque()
        self._bell: queue.SimpleQueue[None] = queue.SimpleQueue()  # a token wakes the getter
        self._started = threading.Lock()  # held while no hand-off is pending: the getter releases it as it wakes
        self._started.acquire()
        self._maxsize = maxsize
        self._ring_at = min(self.RING_AT, max(1, maxsize // 2))
        self._lock = threading.Lock()  # guards the counts
        self._room = threading.Condition(self._lock)  # a full put waits on it
        self._put = 0
        self._taken = 0
        self._waiting = 0  # puts waiting for room
        self._state = self._BUSY  # written by the getter, and by a put that wakes it (under the GIL)
        self._rung = False  # a token was put that the getter has not taken yet
        self._flowing = False  # the getter took an item since its last doze that found nothing: its next get dozes
        self._wakes_at = math.inf  # when the waiting getter's timeout ends (a doze, or its get's timeout)

    def put_nowait(self, item: _Item) -> None:
        """Enqueue, or raise ``queue.Full``."""
        with self._lock:
            if self._put - self._taken >= self._maxsize:
                raise queue.Full
            self._put += 1
            self._items.append(item)
        self._after_put(type(item) is _Step)

    def put(self, item: _Item, *, timeout: float) -> None:
        """Enqueue, waiting at most ``timeout`` seconds for room; else raise ``queue.Full``."""
        deadline = time.monotonic() + timeout
        with self._room:
            while self._put - self._taken >= self._maxsize:
                left = deadline - time.monotonic()
                if left <= 0.0:
                    raise queue.Full
                self._waiting += 1
                self._ring()  # a full queue: a dozing getter must not sleep out its doze
                try:
                    self._room.wait(left)
                finally:
                    self._waiting -= 1
            self._put += 1
            self._items.append(item)
        self._after_put(type(item) is _Step)

    def _after_put(self, step: bool) -> None:
        """Wake the getter, or hand it the GIL, as the class says."""
        if not step:
            self._ring()
        elif self.settle():
            return
        elif self._state == self._ASLEEP or (self._state == self._DOZING and len(self._items) >= self._ring_at):
            self._ring()

    def settle(self) -> bool:
        """Hand the GIL to a getter that is awake (woken by a put, or by its timeout) but not yet running, if there
        is one; True if so. The caller about to run work that releases the GIL often and briefly (a commit's numpy)
        calls it first: the getter then takes its items now instead of starving through that work."""
        if self._rung:
            self._rung = False
        elif self._state != self._BUSY and time.monotonic() >= self._wakes_at:  # its timeout woke it
            self._wakes_at = math.inf
        else:
            return False
        self._hand_off()
        return True

    def _ring(self) -> None:
        """Wake a waiting getter (one pending token is enough: it looks at the items after any)."""
        if self._state != self._BUSY:
            self._state = self._BUSY
            self._rung = True
            self._bell.put(None)

    def _hand_off(self) -> None:
        """Block until the woken getter runs, ``HANDOFF_S`` at most (the caller cleared what made it hand off, so not
        again until the next wake-up)."""
        if self.HANDOFF_S > 0.0:
            self._started.acquire(blocking=False)  # a late release of an earlier hand-off: not this one
            self._started.acquire(timeout=self.HANDOFF_S)

    def get(self, *, timeout: float | None) -> _Item:
        """The oldest item, waiting at most ``timeout`` seconds (None: for ever); else raise ``queue.Empty``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        items = self._items
        state = self._DOZING if self._flowing else self._ASLEEP
        while True:
            try:
                item = items.popleft()  # (one call: release() may empty the deque from another thread)
            except IndexError:
                pass
            else:
                self._flowing = True
                self._took()
                return item
            self._state = state  # (under the GIL: a put from now on sees it, and rings)
            if items:  # put between the look and the state
                self._state = self._BUSY
                continue
            now = time.monotonic()
            left = None if deadline is None else max(0.0, deadline - now)
            wait = left if state == self._ASLEEP else self.DOZE_S if left is None else min(self.DOZE_S, left)
            self._wakes_at = math.inf if wait is None else now + wait
            try:
                self._bell.get(timeout=wait)
            except queue.Empty:
                self._state = self._BUSY
                self._wakes_at = math.inf
                if self._started.locked():  # a put may be waiting for this hand-off
                    self._started.release()
                if items:  # a step waited out the doze: take it
                    continue
                if state == self._DOZING and wait == self.DOZE_S:  # a whole doze found nothing
                    self._flowing = False
                    state = self._ASLEEP
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            else:
                self._state = self._BUSY
                self._rung = False
                self._wakes_at = math.inf
                if self._started.locked():  # a put may be waiting for this hand-off
                    self._started.release()

    def get_nowait(self) -> _Item:
        """The oldest item, or raise ``queue.Empty``."""
        try:
            item = self._items.popleft()
        except IndexError:
            raise queue.Empty from None
        self._took()
        return item

    def _took(self) -> None:
        with self._lock:
            self._taken += 1
            if self._waiting:
                self._room.notify()


class Worker:
    """One adapter, its queue and its thread. Counters are written only by this worker's thread (or before it)."""

    def __init__(self, delivery: Delivery, index: int, adapter: Adapter, label: str, queue_size: int) -> None:
        self.delivery = delivery
        self.index = index
        self.adapter = adapter
        self.label = label
        self.permanent = permanent_errors_of(adapter)
        self.queue = Bounded(queue_size)
        self.thread = threading.Thread(target=self._run, name=f"metricbus-{label}", daemon=True)
        self.opened = threading.Event()
        self.abandon = threading.Event()  # close() ran out of time: stop retrying, discard the rest
        self.open_error: BaseException | None = None
        self.stopped: str | None = None  # why this adapter gets no more steps (open failed, strict, hung, died)
        self.dead = False  # stopped because a call hung or the thread died
        self.degraded = False  # its last tries failed with transient errors; still retried
        self.busy_since: float | None = None  # when the adapter call now running began (None: none running)
        self.busy_verb = ""
        self.failures = 0  # failed calls, retries included
        self.failure: BaseException | None = None  # the last exception a _call() reported
        self.delivered = 0  # steps written
        self.gaps = 0  # steps the backend rejected (skipped)
        self.refused: dict[str, str] = {}  # metric names the backend refuses (their steps' other metrics written)
        self.unacked: int | None = None  # the last step written but not yet flushed
        self.unacked_count = 0
        self.flush_due = 0.0
        self.acked: int | None = None
        # steps held (Delivery.hold): the cursor stays below each until its repeated commit was written, so a
        # crash before then never leaves a cursor covering a step whose second commit the adapter lacks
        self.holds: list[int] = []  # under delivery.cursor_lock, as ``acked`` is while a hold may change it
        self.dropped = 0
        self.submitted = 0  # written by the caller's thread only
        self.released = 0  # steps never handed to a stopped adapter, or taken out of its queue
        self.lost = 0  # steps taken off the queue but never written (stopped or abandoned adapter)
        self.last_step: int | None = None

    # -- the adapter's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, ...: this thread dies; the others go on
            self.delivery.stop(self, f"its thread died of {exc!r}", exc)
            if self.open_error is None:
                with contextlib.suppress(BaseException):  # best effort: do not leave the backend's run open
                    self.adapter.close(status="failed")
        finally:
            self.busy_since = None
            self.opened.set()

    def _serve(self) -> None:
        try:
            self._busy("open")
            self.adapter.open(run=self.delivery.run)
        except Exception as exc:
            self.open_error = exc
            self.stopped = "open failed"
            self._fail("open", None, exc, kind="open")
        finally:
            self.busy_since = None
        if self.open_error is None and self.delivery.on_opened is not None:
            on_opened = self.delivery.on_opened
            self._call("on_opened", lambda: on_opened(self.index, self.adapter))
        self.opened.set()
        status: Status = "failed"
        while (item := self._next()) is not None:
            if isinstance(item, _Stop):
                status = item.status
                break
            if isinstance(item, _Sync):
                self._flush()
                item.done.set()
            elif isinstance(item, _Resume):
                self._resume(item)
            elif self.stopped is not None or self.abandon.is_set():
                self.lost += 1
                if item.repeat:
                    self.unhold(item.step)
            else:
                self._deliver(item)
                if self.unacked_count >= FLUSH_EVERY_STEPS or time.monotonic() >= self.flush_due:
                    self._flush()
        if self.open_error is None:
            self._flush()
            short = self.gaps or self.refused or self.lost or self.dropped or self.stopped is not None
            final: Status = "failed" if short else status
            if self._call("close", lambda: self.adapter.close(status=final)) and self.last_step is not None:
                self._acknowledge(self.last_step)  # close made every written step durable

    def _next(self) -> _Item | None:
        """The next item; flushes when a flush falls due while waiting. None: abandoned and empty."""
        while True:
            if self.abandon.is_set():
                try:
                    return self.queue.get_nowait()
                except queue.Empty:
                    return None
            timeout = None if self.unacked_count == 0 else max(0.0, self.flush_due - time.monotonic())
            try:
                return self.queue.get(timeout=timeout)
            except queue.Empty:
                self._flush()

    def _busy(self, verb: str) -> None:
        self.busy_verb = verb
        self.busy_since = time.monotonic()

    def _resume(self, item: _Resume) -> None:
        """Rewind the backend (if it has the optional verb), then write the steps it missed, in order."""
        if self.stopped is not None or self.abandon.is_set():
            self.lost += len(item.steps)
            return
        rewind = getattr(self.adapter, "rewind", None)
        if item.rewind is not None and callable(rewind):
            step = item.rewind
            if not self._call("rewind", lambda: rewind(step=step)):
                # The backend still holds the abandoned timeline from ``step`` on: writing the new one after it would
                # leave both. Stop for this run; the cursor is already below ``step`` with a rewind to ``step`` kept
                # pending (Sink._catch_up), so `metricbus sync` rewinds it and sends the new steps once the cause is
                # fixed.
                self.lost += len(item.steps)
                self.delivery.stop(self, f"rewind(step={step}) failed, so none of the resumed steps is written over "
                                   "the old ones", self.failure, dead=False)
                return
        for step_item in item.steps:
            if self.stopped is not None or self.abandon.is_set():
                self.lost += 1
                continue
            self._deliver(step_item)
            if self.unacked_count >= FLUSH_EVERY_STEPS:
                self._flush()

    def unhold(self, step: int) -> None:
        """End one hold of ``step`` (its repeated commit was written, or will never be)."""
        with self.delivery.cursor_lock:
            if step in self.holds:
                self.holds.remove(step)

    def _deliver(self, item: _Step) -> None:
        try:
            self._write(item)
        finally:
            if item.repeat:
                self.unhold(item.step)

    def _write(self, item: _Step) -> None:
        d = self.delivery
        with d.cursor_lock:
            rewind = self.acked is not None and item.step <= self.acked
            if rewind:
                # A second commit at an acknowledged step: its cursor covers whole steps, so it goes back one step
                # until this part is durable too (a crash in between sends the whole step again).
                self.acked = item.step - 1
        on_rewound = d.on_rewound
        if rewind and on_rewound is not None:
            back = item.step - 1
            self._call("on_rewound", lambda: on_rewound(self.index, self.adapter, back))
        tries = 0
        while True:
            try:
                self._busy("write")
                self.adapter.write(step=item.step, metrics=item.metrics)
                break
            except RejectedMetricsError as exc:  # the step's other metrics were written: it is delivered
                d.refuse(self, item.step, exc)
                break
            except Exception as exc:
                if classify(exc, permanent=self.permanent) == "permanent":
                    self.gaps += 1
                    d.gap(self, item.step, metric_named(exc, lambda: list(item.metrics)), exc)
                    return
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
                    self.stopped = "strict bus: gave up after retries"
                    self.lost += 1
                    return
            finally:
                self.busy_since = None
            delay = backoff_s(tries=tries, base_s=d.retry_base_s, cap_s=d.retry_cap_s)
            if self.abandon.wait(delay) or self.stopped is not None:
                self.lost += 1
                return
        if self.degraded:
            self.degraded = False
            d.report(logging.WARNING, self.label, "recovered", "adapter %r recovered at step %d after %d failed tries",
                     self.label, item.step, tries)
        self.delivered += 1
        self.last_step = item.step
        if self.unacked_count == 0:
            self.flush_due = time.monotonic() + FLUSH_EVERY_S
        self.unacked = item.step
        self.unacked_count += 1

    def _flush(self) -> None:
        """Flush the adapter; once flush() returned, acknowledge the last step written before it."""
        if self.open_error is not None:
            return
        try:
            self._busy("flush")
            self.adapter.flush()
        except Exception as exc:
            self.failures += 1
            self.flush_due = time.monotonic() + FLUSH_EVERY_S  # the steps stay unacknowledged; tried again then
            self._fail("flush", self.last_step, exc, kind="flush")
            return
        finally:
            self.busy_since = None
        written, self.unacked, self.unacked_count = self.unacked, None, 0
        if written is not None:
            self._acknowledge(self._durable(written))

    def _durable(self, written: int) -> int | None:
        """The last step durable after a flush: ``written``, or less where the adapter's optional ``durable_step``
        says so (wandb keeps the last step's row open until a later step or close)."""
        if not hasattr(self.adapter, "durable_step"):
            return written
        try:
            durable = self.adapter.durable_step
        except Exception:
            return None
        return None if durable is None else min(written, int(durable))

    def _acknowledge(self, step: int | None) -> None:
        """Advance the cursor to ``step`` (never back), and never to a held step (see ``holds``)."""
        on_delivered = self.delivery.on_delivered
        with self.delivery.cursor_lock:
            if step is not None and self.holds:
                step = min(step, min(self.holds) - 1)
            if step is None or (self.acked is not None and step <= self.acked):
                return
            self.acked = step
            if on_delivered is not None:  # under the lock: a hold's rewind never lands before this advance
                self._call("on_delivered", lambda: on_delivered(self.index, self.adapter, step))

    def _call(self, verb: str, fn: Callable[[], object]) -> bool:
        try:
            self._busy(verb)
            fn()
        except Exception as exc:
            self.failures += 1
            self.failure = exc
            self._fail(verb, self.last_step, exc, kind=verb)
            return False
        finally:
            self.busy_since = None
        return True

    def _fail(self, verb: str, step: int | None, exc: BaseException, *, kind: str) -> None:
        self.delivery.report(logging.ERROR, self.label, kind, "adapter %r failed in %s at step %s: %r",
                             self.label, verb, step, exc)
        self.delivery.keep(AdapterError(f"adapter {self.label!r} failed in {verb} at step {step}: {exc!r}"), exc)

    # -- the caller's thread -----------------------------------------------------------------------------------

    def overdue(self, now: float) -> bool:
        """True when the adapter call now running has exceeded the write deadline."""
        since = self.busy_since
        return self.stopped is None and since is not None and now - since > self.delivery.write_timeout_s

    def put(self, item: _Item, *, deadline: float | None, even_degraded: bool = False) -> bool:
        """Enqueue without blocking (``deadline`` None, or degraded) or until ``deadline``; False when full.

        While blocked, gives up as soon as the adapter's running call is past the write deadline.
        ``even_degraded``: wait for room even while degraded (close's sentinel).
        """
        try:
            self.queue.put_nowait(item)  # (room, as mostly: no clock read)
        except queue.Full:
            if deadline is None or (self.degraded and not even_degraded):
                return False
        else:
            return True
        while True:
            try:
                self.queue.put(item, timeout=max(0.0, min(deadline - time.monotonic(), WAIT_SLICE_S)))
                return True
            except queue.Full:
                now = time.monotonic()
                if now >= deadline or self.overdue(now):
                    return False

    def release(self) -> int:
        """Empty the queue (the adapter is stopped): steps counted, flush waiters woken, close's sentinel kept."""
        steps, stop = 0, None
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Step):
                steps += 1
            elif isinstance(item, _Sync):
                item.done.set()
            else:
                stop = item
        if stop is not None:
            with contextlib.suppress(queue.Full):
                self.queue.put_nowait(stop)
        return steps
