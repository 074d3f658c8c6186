"""The public API under hostile and concurrent use, as a demanding trainer author would hit it (second review):
records logged on another thread while ``close()`` runs are either in its last commit or refused; a Partial object
ingested twice before a commit is refused."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from metricbus import MetricBus
from metricbus.errors import ClosedError, MetricValueError, StepError
from metricbus.partial import Partial
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


def _worker_partial(values: list[float]) -> Partial:
    worker = MetricBus(dist=None, rules={"x": "sum"})
    for value in values:
        worker.log("x", value)
    part = worker.export()
    worker.close()
    return part


def test_the_same_partial_twice_in_one_ingest_is_refused_and_nothing_is_ingested() -> None:
    """ingest([p, p]) would count that worker's records twice: a MetricValueError, and nothing of the call is taken."""
    driver = MetricBus(dist=None)
    first, second = _worker_partial([1.0, 2.0]), _worker_partial([5.0])
    with pytest.raises(MetricValueError, match=r"partial 2 of this call \(holding 'x'\) is the same Partial"):
        driver.ingest([first, second, first])
    driver.ingest([first, second])
    assert driver.commit() == {"x": 8.0}
    driver.close()


def test_a_partial_a_refused_commit_kept_is_refused_when_ingested_again() -> None:
    """A refused commit keeps its ingested partials for the next one: ingesting them again is refused, not doubled."""
    driver = MetricBus(dist=None)
    driver.log("y", 1.0)
    driver.commit(step=5)
    part = _worker_partial([1.0, 2.0])
    driver.ingest([part])
    with pytest.raises(StepError):
        driver.commit(step=4)
    with pytest.raises(MetricValueError, match="ingested since the last commit"):
        driver.ingest([part])
    assert driver.commit(step=6) == {"x": 3.0}
    driver.ingest([part])  # reduced at step 6: a later commit may take it again, as a new worker's
    assert driver.commit(step=7) == {"x": 3.0}
    driver.close()


def test_one_empty_partial_may_stand_for_several_workers() -> None:
    """An empty Partial holds no records: the same object ingested for several absent workers counts nothing."""
    driver = MetricBus(dist=None)
    empty = Partial()
    driver.ingest([empty, _worker_partial([4.0]), empty])
    driver.ingest([empty])
    assert driver.commit() == {"x": 4.0}
    driver.close()
