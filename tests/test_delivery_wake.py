"""The delivery queue's wake-ups (``metricbus.delivery_worker.Bounded``): while steps keep coming, a put wakes the
worker's thread only once ``RING_AT`` wait, and a getter that found nothing dozes ``DOZE_S`` at most; one that then
still found nothing is woken by the next put; a flush, close's sentinel or a full queue wake it at once; a put that
finds the getter not yet woken from the last wake-up hands it the GIL, ``HANDOFF_S`` at most.

The tests set ``DOZE_S`` to a minute where a get that returned within the join's few seconds must have been woken
(liveness checks, not timings)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.delivery_worker import Bounded, _Step, _Stop, _Sync
from metricbus.testing import MemoryAdapter

LONG_S = 60.0
JOIN_S = 10.0


def step(n: int) -> _Step:
    return _Step(step=n, metrics={"loss": float(n)})


def collector(q: Bounded, count: int) -> tuple[threading.Thread, list[Any]]:
    """A thread taking ``count`` items from ``q`` (as the worker's), and the list they land in."""
    got: list[Any] = []
    thread = threading.Thread(target=lambda: [got.append(q.get(timeout=2 * LONG_S)) for _ in range(count)], daemon=True)
    thread.start()
    return thread, got


def both_end(puts: Any, getter: threading.Thread) -> None:
    """Run ``puts`` on a thread of its own; it and ``getter`` must both end within the join."""
    putter = threading.Thread(target=puts, daemon=True)
    putter.start()
    for thread in (putter, getter):
        thread.join(JOIN_S)
        assert not thread.is_alive()


def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def dozing(q: Bounded, count: int) -> tuple[threading.Thread, list[Any]]:
    """:func:`collector` of ``count`` items, whose getter took a first step (-1, not in the list) and now dozes
    (a getter that has taken nothing yet sleeps until the first put instead)."""
    thread, got = collector(q, count + 1)
    q.put_nowait(step(-1))
    until(lambda: got == [step(-1)] and q._state == Bounded._DOZING, "the getter never dozed")
    got.clear()
    return thread, got


def test_a_dozing_getter_takes_the_steps_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Bounded, "DOZE_S", LONG_S)
    monkeypatch.setattr(Bounded, "RING_AT", 4)
    q = Bounded(64)
    thread, got = dozing(q, 4)
    for n in range(3):
        q.put_nowait(step(n))
    time.sleep(0.2)
    assert got == []  # three of four: no wake-up, and the doze is a minute
    q.put_nowait(step(3))
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(0), step(1), step(2), step(3)]


@pytest.mark.parametrize("wake", [_Sync(threading.Event()), _Stop("finished")], ids=["flush", "close"])
def test_a_flush_or_close_wakes_a_dozing_getter_at_once(monkeypatch: pytest.MonkeyPatch, wake: Any) -> None:
    monkeypatch.setattr(Bounded, "DOZE_S", LONG_S)
    q = Bounded(64)
    thread, got = dozing(q, 2)
    q.put_nowait(step(1))  # a step alone does not wake it
    q.put_nowait(wake)
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(1), wake]


def test_a_half_full_queue_wakes_a_dozing_getter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Bounded, "DOZE_S", LONG_S)
    q = Bounded(4)  # RING_AT 16, but half of four is two
    thread, got = dozing(q, 2)
    q.put_nowait(step(1))
    q.put_nowait(step(2))
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(1), step(2)]


def test_a_step_waits_out_one_doze_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Bounded, "DOZE_S", 0.05)
    q = Bounded(64)
    thread, got = dozing(q, 1)
    q.put_nowait(step(1))  # no wake-up: taken when the doze ends
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(1)]


def test_an_asleep_getter_is_woken_by_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Bounded, "DOZE_S", 0.05)
    q = Bounded(64)
    thread, got = dozing(q, 1)
    until(lambda: q._state == Bounded._ASLEEP, "the getter never fell asleep after its doze")
    monkeypatch.setattr(Bounded, "DOZE_S", LONG_S)  # (asleep, it waits for a put whatever the doze)
    q.put_nowait(step(1))
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(1)]


def test_a_getter_that_took_nothing_yet_is_woken_by_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's first get (or one after a doze found nothing) does not doze: the first step of a run is handed
    over at once."""
    monkeypatch.setattr(Bounded, "DOZE_S", LONG_S)
    q = Bounded(64)
    thread, got = collector(q, 1)
    until(lambda: q._state == Bounded._ASLEEP, "the getter never waited")
    q.put_nowait(step(0))
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(0)]


def test_a_get_keeps_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's get times out when its owed flush falls due, doze or not."""
    monkeypatch.setattr(Bounded, "DOZE_S", LONG_S)
    q = Bounded(16)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.0)


def test_a_put_hands_the_gil_to_a_getter_not_yet_woken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The put after a wake-up, before the getter ran, waits for it to run (a minute at most here): it returns as
    soon as the getter took its wake-up, and every step arrives."""
    monkeypatch.setattr(Bounded, "DOZE_S", LONG_S)
    monkeypatch.setattr(Bounded, "RING_AT", 2)
    monkeypatch.setattr(Bounded, "HANDOFF_S", LONG_S)
    q = Bounded(64)
    thread, got = dozing(q, 3)

    def puts() -> None:
        q.put_nowait(step(0))
        q.put_nowait(step(1))  # wakes the getter
        q.put_nowait(step(2))  # (the getter has not run yet: it needs this thread's GIL) hands it over

    both_end(puts, thread)
    assert got == [step(0), step(1), step(2)]


def test_a_hand_off_to_a_getter_that_never_runs_is_bounded_and_not_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Bounded, "RING_AT", 2)
    monkeypatch.setattr(Bounded, "HANDOFF_S", 0.05)
    q = Bounded(64)
    q._state = Bounded._DOZING  # as a getter that then never runs again
    q.put_nowait(step(0))
    q.put_nowait(step(1))  # wakes it: a token waits
    assert q._rung
    assert q._bell.qsize() == 1
    q.put_nowait(step(2))  # hands off: waits 0.05 s, then gives up
    assert not q._rung
    for n in range(3, 50):  # no further wake-up or hand-off: the getter is not waiting
        q.put_nowait(step(n))
    assert q._bell.qsize() == 1
    assert [q.get_nowait() for _ in range(50)] == [step(n) for n in range(50)]


def test_a_put_after_a_doze_ended_hands_off_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A getter whose doze ended is awake, waiting for the GIL: the next put hands it over (here to a getter that
    never runs: 0.05 s, then not again until the getter waits anew)."""
    monkeypatch.setattr(Bounded, "HANDOFF_S", 0.05)
    q = Bounded(64)
    q._state = Bounded._DOZING
    q._wakes_at = time.monotonic() - 1.0  # its doze ended a second ago
    q.put_nowait(step(0))
    assert q._wakes_at == float("inf")
    assert q._bell.qsize() == 0  # a hand-off, not a wake-up
    for n in range(1, 10):
        q.put_nowait(step(n))
    assert [q.get_nowait() for _ in range(10)] == [step(n) for n in range(10)]


def test_a_getter_starved_past_its_doze_gets_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The putter holds the GIL in one C call past the getter's doze, then puts: every step arrives."""
    monkeypatch.setattr(Bounded, "DOZE_S", 0.02)
    monkeypatch.setattr(Bounded, "HANDOFF_S", LONG_S)
    q = Bounded(64)
    thread, got = dozing(q, 3)

    def puts() -> None:
        for n in range(3):
            sum(range(3_000_000))  # ~0.05-0.1 s in C, the GIL held: the doze ends meanwhile
            q.put_nowait(step(n))

    both_end(puts, thread)
    assert got == [step(0), step(1), step(2)]


def test_puts_at_a_full_queue_leave_at_most_one_wake_token() -> None:
    q = Bounded(4)
    q._state = Bounded._DOZING
    for n in range(4):
        q.put_nowait(step(n))
    with pytest.raises(queue.Full):
        q.put(step(4), timeout=0.01)
    assert q._bell.qsize() == 1


def test_a_lagging_adapter_leaves_at_most_one_wake_token() -> None:
    """While an adapter lags with its queue over half full, puts do not pile up wake tokens."""
    gate, writing = threading.Event(), threading.Event()

    class Gated(MemoryAdapter):
        def write(self, *, step: int, metrics: Any) -> None:
            writing.set()
            gate.wait(JOIN_S)
            super().write(step=step, metrics=metrics)

    adapter = Gated()
    bus = MetricBus(adapters=[adapter], dist=None, strict=True, queue_size=64)
    q = bus._sink.delivery._workers[0].queue
    for n in range(60):  # the first is taken (its write waits at the gate); the rest stay queued
        bus.log("loss", float(n))
        bus.commit()
        if n == 0:
            assert writing.wait(JOIN_S)
    pending = q._bell.qsize()
    gate.set()
    bus.close()
    assert pending <= 1
    assert [s for s, _ in adapter.rows] == list(range(60))


@pytest.mark.parametrize("queue_size", [1, 2, 3, 1024])
def test_a_bus_delivers_flushes_and_closes_every_step(queue_size: int) -> None:
    adapter = MemoryAdapter()
    bus = MetricBus(adapters=[adapter], dist=None, strict=True, queue_size=queue_size)
    for n in range(300):
        bus.log("loss", float(n))
        bus.commit()
    assert bus.flush(timeout_s=JOIN_S)  # a _Sync: wakes a dozing worker
    assert [s for s, _ in adapter.rows] == list(range(300))
    bus.log("loss", 300.0)
    bus.commit()
    bus.close()  # close's sentinel wakes it too
    assert [s for s, _ in adapter.rows] == list(range(301))
    assert adapter.status == "finished"


def test_steps_are_written_and_flushed_without_a_call() -> None:
    """Steps committed in a burst reach the adapter with no flush() (the doze ends), and the flush owed by time
    comes."""
    adapter = MemoryAdapter()
    bus = MetricBus(adapters=[adapter], dist=None, strict=True)
    for n in range(20):
        bus.log("loss", float(n))
        bus.commit()
    until(lambda: len(adapter.rows) == 20 and adapter.flushes, "the steps or their flush never came")
    assert [s for s, _ in adapter.rows] == list(range(20))
    bus.close()


def test_steps_further_apart_than_a_doze_are_each_handed_over_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asleep after a doze that found nothing, the worker is woken by the next step, not by its doze's end."""
    monkeypatch.setattr(Bounded, "DOZE_S", 0.05)
    adapter = MemoryAdapter()
    bus = MetricBus(adapters=[adapter], dist=None, strict=True)
    q = bus._sink.delivery._workers[0].queue
    for n in range(3):
        until(lambda: q._state == Bounded._ASLEEP, "the worker never fell asleep")
        monkeypatch.setattr(Bounded, "DOZE_S", LONG_S)  # a doze now would outlast the join: only a wake-up helps
        bus.log("loss", float(n))
        bus.commit()
        until(lambda n=n: len(adapter.rows) == n + 1, f"step {n} never reached the adapter")
        monkeypatch.setattr(Bounded, "DOZE_S", 0.05)
    bus.close()
    assert [s for s, _ in adapter.rows] == [0, 1, 2]


def test_settle_hands_off_only_to_a_getter_woken_and_not_yet_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """``settle()`` (a commit calls it before its reduction): nothing to do while the getter is busy, or dozing with
    time left; a hand-off once after a wake-up the getter has not taken (here it never runs: 0.05 s)."""
    monkeypatch.setattr(Bounded, "RING_AT", 2)
    monkeypatch.setattr(Bounded, "HANDOFF_S", 0.05)
    q = Bounded(64)
    assert not q.settle()  # busy
    q._state = Bounded._DOZING
    q._wakes_at = time.monotonic() + LONG_S
    assert not q.settle()  # dozing, its doze not over
    q.put_nowait(step(0))
    q.put_nowait(step(1))  # wakes it
    assert q.settle()
    assert not q.settle()  # not twice for one wake-up


def test_a_bus_with_two_adapters_hands_off_to_each() -> None:
    """Commits in a tight loop with two adapters: both get every step, in order."""
    first, second = MemoryAdapter(), MemoryAdapter()
    bus = MetricBus(adapters=[first, second], dist=None, strict=True)
    for n in range(500):
        for i in range(20):
            bus.log(f"m{i}", float(n))
        bus.commit()
    bus.close()
    assert [s for s, _ in first.rows] == list(range(500))
    assert [s for s, _ in second.rows] == list(range(500))
