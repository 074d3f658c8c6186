"""Stress of the delivery queue's wake-ups (``metricbus.delivery_worker.Bounded``) under a tiny switch interval:
several putting threads, flushes racing commits, small queues. Liveness and exactness only (no timings): every step
arrives once, in order, and a flush that returned True covers every step committed before it."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.delivery_worker import Bounded, _Step, _Stop, _Sync
from metricbus.testing import MemoryAdapter

JOIN_S = 60.0


@pytest.fixture
def tiny_switch() -> Iterator[None]:
    """Switch threads at nearly every bytecode boundary, to open every race between a put and the getter."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("maxsize", [1, 3, 128])
@pytest.mark.usefixtures("tiny_switch")
def test_steps_from_several_threads_arrive_once_in_order_and_every_flush_ends(maxsize: int) -> None:
    """Three threads put steps, with pauses about a doze long and flushes between, to one getter."""
    q = Bounded(maxsize)
    got: list[_Step] = []
    count, threads = 400, 3

    def getter() -> None:
        while True:
            item = q.get(timeout=None)  # (no timeout to rescue a lost wake-up)
            if isinstance(item, _Stop):
                return
            if isinstance(item, _Sync):
                item.done.set()
            else:
                got.append(item)

    def putter(p: int) -> None:
        pause = random.Random(p)
        for n in range(count):
            q.put(_Step(p * count + n, {}), timeout=JOIN_S)
            if n % 10 == 9:  # about a doze: the getter falls asleep meanwhile, or just then
                time.sleep(pause.uniform(0.5, 1.5) * Bounded.DOZE_S)
            if n % 20 == 19:
                done = threading.Event()
                q.put(_Sync(done), timeout=JOIN_S)
                assert done.wait(JOIN_S), "a flush never ended"

    taker = threading.Thread(target=getter, daemon=True)
    taker.start()
    putters = [threading.Thread(target=putter, args=(p,), daemon=True) for p in range(threads)]
    for thread in putters:
        thread.start()
    for thread in putters:
        thread.join(JOIN_S)
        assert not thread.is_alive()
    q.put(_Stop("finished"), timeout=JOIN_S)
    taker.join(JOIN_S)
    assert not taker.is_alive()
    for p in range(threads):
        assert [s.step for s in got if s.step // count == p] == list(range(p * count, (p + 1) * count))
    assert len(got) == threads * count
    assert q._bell.qsize() <= 1


class _Flaky(MemoryAdapter):
    """Fails a few writes with a transient error, then writes the step on the retry."""

    name = "flaky"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def write(self, *, step: int, metrics: Any) -> None:
        self.calls += 1
        if self.calls in (50, 300):
            raise ConnectionError("transient")
        super().write(step=step, metrics=metrics)


class _Logging(MemoryAdapter):
    """Logs into the bus from its write() (a backend's own metric)."""

    name = "logging"
    bus: MetricBus | None = None

    def write(self, *, step: int, metrics: Any) -> None:
        super().write(step=step, metrics=metrics)
        if self.bus is not None and not self.bus.closed:
            self.bus.log("backend/writes", 1.0)


@pytest.mark.parametrize("queue_size", [1, 3, 1024])
@pytest.mark.usefixtures("tiny_switch")
def test_flushes_from_another_thread_cover_every_step_committed_before(queue_size: int) -> None:
    """Commits in a loop while another thread flushes: each True flush covers the steps committed before it, and
    close delivers every step once, in order, to each of three adapters (no drop under the block policy)."""
    adapters = [MemoryAdapter(), _Flaky(), _Logging()]
    bus = MetricBus(adapters=adapters, dist=None, queue_size=queue_size, queue_policy="block")
    adapters[2].bus = bus  # type: ignore[attr-defined]
    committed = -1
    ended = threading.Event()
    short: list[str] = []

    def flusher() -> None:
        while not ended.is_set():
            before = committed
            if bus.flush(timeout_s=JOIN_S):
                for adapter in adapters:
                    have = {s for s, _ in list(adapter.rows)}
                    short.extend(f"{adapter.name} lacks step {s}" for s in range(before + 1) if s not in have)
            time.sleep(0.002)

    thread = threading.Thread(target=flusher, daemon=True)
    thread.start()
    for n in range(600):
        bus.log("loss", float(n))
        bus.commit(step=n)
        committed = n
        if n % 100 == 99:
            time.sleep(0.03)
    ended.set()
    thread.join(JOIN_S)
    assert not thread.is_alive()
    bus.close()
    assert short == []
    for adapter in adapters:  # (step 600: close commits what the logging adapter logged after the last commit)
        assert [s for s, _ in adapter.rows] in (list(range(600)), list(range(601))), adapter.name
    assert bus._sink.delivery.dropped == 0
