"""The public API under hostile and concurrent use, as a demanding trainer author would hit it (second review):
records logged on another thread while ``close()`` runs are either in its last commit or refused."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from metricbus import MetricBus
from metricbus.errors import ClosedError
from metricbus.testing import MemoryAdapter


def _log_while_closing(call: Any) -> tuple[int, float]:
    """Two threads log ``call(bus)`` in a loop while the main thread closes the bus: how many records the calls
    that returned logged, and how many the bus delivered (every metric is a count)."""
    mem = MemoryAdapter()
    bus = MetricBus(dist=None, adapters=[mem], rules={"*": "count"})
    returned = [0, 0]
    running = [threading.Event(), threading.Event()]

    def logger(i: int) -> None:
        calls = 0
        while True:
            try:
                returned[i] += call(bus)
            except ClosedError:
                return
            calls += 1
            if calls == 100:  # both threads are logging when close() begins, and go on until it refuses them
                running[i].set()

    threads = [threading.Thread(target=logger, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for event in running:
        event.wait()
    bus.close()
    for thread in threads:
        thread.join()
    return sum(returned), sum(value for _, row in mem.rows for value in row.values())


def _float(bus: MetricBus) -> int:
    bus.log("x", 1.0)
    return 1


def _dict(bus: MetricBus) -> int:
    bus.log({"x": 1.0, "y": 2.0})
    return 2


def _list(bus: MetricBus) -> int:
    bus.log("x", [1.0, 2.0])
    return 2


def _array(bus: MetricBus) -> int:
    bus.log("x", np.ones(3))
    return 3


@pytest.mark.parametrize("call", [_float, _dict, _list, _array], ids=["float", "dict", "list", "array"])
def test_a_record_logged_on_another_thread_while_close_runs_is_committed_or_refused(call: Any) -> None:
    """A log() racing close() on another thread is in close()'s last commit or raises ClosedError, never lost."""
    for _ in range(20):
        returned, delivered = _log_while_closing(call)
        assert delivered == returned
