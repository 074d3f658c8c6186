"""The delivery queue's coalesced wake-ups (``Bounded.POLL_S``): while steps keep coming, the worker's thread takes
them together after at most a poll instead of being woken by every put; a flush, close's sentinel, a half-full
queue or an idle worker still wake it at once, and the flush a worker owes by time still happens.

Each test sets the poll to a minute, so that a get which returned within the join's few seconds was woken (these
are liveness checks, not timings)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.delivery_worker import Bounded, _Step, _Stop, _Sync
from metricbus.testing import MemoryAdapter

LONG_POLL_S = 60.0
JOIN_S = 10.0


@pytest.fixture
def long_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Bounded, "POLL_S", LONG_POLL_S)


def step(n: int) -> _Step:
    return _Step(step=n, metrics={"loss": float(n)})


def getter(q: Bounded) -> tuple[threading.Thread, list[Any]]:
    """A thread blocked in ``q.get`` (as the worker's), and the list its item lands in."""
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(q.get(timeout=2 * LONG_POLL_S)), daemon=True)
    thread.start()
    return thread, got


def flowing(size: int) -> Bounded:
    """A queue whose getter has just taken a step: its next get waits out a poll unless woken."""
    q = Bounded(size)
    q.put_nowait(step(0))
    assert q.get(timeout=1.0) == step(0)
    return q


@pytest.mark.usefixtures("long_poll")
@pytest.mark.parametrize("wake", [_Sync(threading.Event()), _Stop("finished")], ids=["flush", "close"])
def test_a_flush_or_close_wakes_a_polling_getter_at_once(wake: Any) -> None:
    q = flowing(16)
    thread, got = getter(q)
    time.sleep(0.05)  # (either way the get must end: before it waits, or woken in its wait)
    q.put_nowait(step(1))  # a step alone does not wake it
    q.put_nowait(wake)
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(1)]
    assert q.get(timeout=1.0) == wake  # FIFO: the wake item after the step


@pytest.mark.usefixtures("long_poll")
def test_a_half_full_queue_wakes_a_polling_getter() -> None:
    q = flowing(4)
    thread, got = getter(q)
    time.sleep(0.05)
    q.put_nowait(step(1))
    q.put_nowait(step(2))  # two of four: half full
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(1)]


@pytest.mark.usefixtures("long_poll")
def test_an_idle_getter_is_woken_by_a_step() -> None:
    q = Bounded(16)  # nothing taken yet: the get waits on the items themselves
    thread, got = getter(q)
    time.sleep(0.05)
    q.put_nowait(step(1))
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(1)]


def test_a_getter_goes_idle_after_a_poll_without_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Bounded, "POLL_S", 0.05)
    q = flowing(16)
    thread, got = getter(q)
    time.sleep(0.5)  # the poll ran out: idle now, so the next step wakes it
    monkeypatch.setattr(Bounded, "POLL_S", LONG_POLL_S)
    q.put_nowait(step(1))
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert got == [step(1)]


@pytest.mark.usefixtures("long_poll")
def test_a_polling_get_keeps_its_timeout() -> None:
    """The worker's get times out when its owed flush falls due, poll or not."""
    q = flowing(16)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)


@pytest.mark.usefixtures("long_poll")
def test_a_bus_delivers_flushes_and_closes_every_step_while_polling() -> None:
    adapter = MemoryAdapter()
    bus = MetricBus(adapters=[adapter], dist=None, strict=True)
    for n in range(50):
        bus.log("loss", float(n))
        bus.commit()
    assert bus.flush(timeout_s=JOIN_S)  # a _Sync: wakes the polling worker
    assert [s for s, _ in adapter.rows] == list(range(50))
    bus.log("loss", 50.0)
    bus.commit()
    bus.close()  # close's sentinel wakes it too
    assert [s for s, _ in adapter.rows] == list(range(51))
    assert adapter.status == "finished"


def test_steps_are_written_and_flushed_without_a_call() -> None:
    """With the default poll, steps committed in a burst reach the adapter, and its flush owed by time comes."""
    adapter = MemoryAdapter()
    bus = MetricBus(adapters=[adapter], dist=None, strict=True)
    for n in range(20):
        bus.log("loss", float(n))
        bus.commit()
    deadline = time.monotonic() + JOIN_S
    while (len(adapter.rows) < 20 or not adapter.flushes) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [s for s, _ in adapter.rows] == list(range(20))
    assert adapter.flushes
    bus.close()


def test_a_lagging_adapter_leaves_at_most_one_wake_token() -> None:
    """While an adapter lags with its queue over half full, puts do not pile up wake tokens (one pending wakes it)."""
    gate, writing = threading.Event(), threading.Event()

    class Gated(MemoryAdapter):
        def write(self, *, step: int, metrics: Any) -> None:
            writing.set()
            gate.wait(JOIN_S)
            super().write(step=step, metrics=metrics)

    adapter = Gated()
    bus = MetricBus(adapters=[adapter], dist=None, strict=True, queue_size=64)
    q = bus._sink.delivery._workers[0].queue
    for n in range(60):  # the first is taken (its write waits at the gate); the rest stay queued, most over half
        bus.log("loss", float(n))
        bus.commit()
        if n == 0:
            assert writing.wait(JOIN_S)
    pending = q._wake.qsize()
    gate.set()
    bus.close()
    assert pending <= 1
    assert [s for s, _ in adapter.rows] == list(range(60))


def test_puts_at_a_full_queue_leave_at_most_one_wake_token() -> None:
    """A put that finds the queue half full, or waits for room, wakes the getter with one token, not one each."""
    q = Bounded(4)
    for n in range(4):
        q.put_nowait(step(n))
    with pytest.raises(queue.Full):
        q.put(step(4), timeout=0.01)
    assert q._wake.qsize() == 1


def test_steps_further_apart_than_a_poll_wake_an_idle_getter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A getter whose steps come further apart than a poll does not poll after each (it would find nothing)."""
    monkeypatch.setattr(Bounded, "POLL_S", 0.05)
    q = Bounded(16)
    got: list[Any] = []
    polls: list[float] = []
    wake = q._wake

    class Counted:  # the wake channel, counting the getter's polls
        def get(self, timeout: float) -> None:
            polls.append(timeout)
            return wake.get(timeout=timeout)

        def __getattr__(self, name: str) -> Any:
            return getattr(wake, name)

    q._wake = Counted()  # type: ignore[assignment]
    thread = threading.Thread(target=lambda: [got.append(q.get(timeout=JOIN_S)) for _ in range(3)], daemon=True)
    thread.start()
    for n in range(3):
        q.put_nowait(step(n))
        deadline = time.monotonic() + JOIN_S
        while len(got) <= n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the next step comes four polls after this one was taken
    thread.join(JOIN_S)
    assert got == [step(0), step(1), step(2)]
    assert polls == []
