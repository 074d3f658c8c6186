"""Background delivery: slow, raising, recovering and blocked backends; queue policies; draining at close."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import pytest

from metricbus import AdapterError, MetricBus
from metricbus.adapter import RunInfo
from metricbus.delivery import Delivery
from metricbus.testing import FlakyAdapter, MemoryAdapter

FAST_RETRY = {"retry_base_s": 0.001, "retry_cap_s": 0.005}


class SlowAdapter(MemoryAdapter):
    """A backend that takes ``delay_s`` per write and notes whether ``loop_done`` was set when each write ended."""

    name = "slow"

    def __init__(self, delay_s: float, loop_done: threading.Event | None = None) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.loop_done = loop_done or threading.Event()
        self.done_at_write: list[bool] = []

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Sleep, then keep the step."""
        time.sleep(self.delay_s)
        super().write(step=step, metrics=metrics)
        self.done_at_write.append(self.loop_done.is_set())


class GatedAdapter(MemoryAdapter):
    """A backend whose writes wait until ``gate`` is set; ``entered`` is set when the first write starts."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Wait for the gate, then keep the step."""
        self.entered.set()
        self.gate.wait(timeout=30)
        super().write(step=step, metrics=metrics)


class BrokenAdapter(MemoryAdapter):
    """A backend that raises on every write."""

    name = "broken"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Always fail."""
        self.calls += 1
        raise OSError(f"backend down (step {step})")


class NoOpen(MemoryAdapter):
    """A backend whose open raises."""

    name = "noopen"

    def open(self, *, run: RunInfo) -> None:
        """Fail to start."""
        raise PermissionError("no credentials")


def _steps(adapter: MemoryAdapter) -> list[int]:
    return [step for step, _ in adapter.rows]


def _bus(*adapters: object, **options: object) -> MetricBus:
    return MetricBus(adapters=list(adapters), dist=None, **options)  # type: ignore[arg-type]


def _run(bus: MetricBus, steps: int) -> None:
    for i in range(steps):
        bus.log("loss", float(i))
        bus.commit()


def test_slow_adapter_does_not_hold_commits() -> None:
    """Every commit returns before a 200 ms backend finishes its first write; all steps arrive after close."""
    slow = SlowAdapter(0.2)
    bus = _bus(slow)
    _run(bus, 10)
    slow.loop_done.set()
    bus.close()
    assert _steps(slow) == list(range(10))
    assert all(slow.done_at_write)


def test_blocked_adapter_does_not_hold_commits() -> None:
    """A backend stuck in write() does not stop the loop; released, it receives every step in order."""
    gated, mem = GatedAdapter(), MemoryAdapter()
    bus = _bus(gated, mem)
    _run(bus, 50)
    assert gated.rows == []
    gated.gate.set()
    bus.close()
    assert _steps(gated) == _steps(mem) == list(range(50))


def test_raising_adapter_leaves_others_complete(caplog: pytest.LogCaptureFixture) -> None:
    """An adapter that raises on every write is reported (name, step, exception); the others get every step."""
    broken, mem = BrokenAdapter(), MemoryAdapter()
    bus = _bus(broken, mem)
    with caplog.at_level(logging.WARNING, logger="metricbus.delivery"):
        _run(bus, 30)
        bus.close(timeout_s=0.5)
    assert _steps(mem) == list(range(30))
    assert mem.status == "finished"
    messages = [r.getMessage() for r in caplog.records if r.name == "metricbus.delivery"]
    degraded = [m for m in messages if "degraded" in m]
    assert len(degraded) == 1
    assert "'broken'" in degraded[0]
    assert "step 0" in degraded[0]
    assert "OSError" in degraded[0]


def test_reports_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """Many failures of one adapter produce one report of each kind, not one per failure."""
    broken = BrokenAdapter()
    delivery = Delivery([broken], strict=False, retry_tries=2, **FAST_RETRY)
    with caplog.at_level(logging.WARNING, logger="metricbus.delivery"):
        delivery.open(run=RunInfo())
        for step in range(5):
            delivery.submit(step=step, metrics={"x": 1.0})
        deadline = time.monotonic() + 10
        while broken.calls < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        delivery.close(status="finished", timeout_s=0.2)
    assert broken.calls >= 50
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failed to write" in m for m in messages) == 1
    assert sum("degraded" in m for m in messages) == 1
    assert delivery.failures["broken"] == broken.calls


def test_recovering_backend_receives_every_step_in_order(caplog: pytest.LogCaptureFixture) -> None:
    """A backend that fails 10 calls, then recovers, receives all steps once each, in order."""
    flaky, mem = FlakyAdapter(outage=10), MemoryAdapter()
    delivery = Delivery([flaky, mem], strict=False, **FAST_RETRY)
    with caplog.at_level(logging.WARNING, logger="metricbus.delivery"):
        delivery.open(run=RunInfo())
        for step in range(100):
            delivery.submit(step=step, metrics={"x": float(step)})
        delivery.close(status="finished", timeout_s=30)
    assert _steps(flaky) == _steps(mem) == list(range(100))
    assert [m["x"] for _, m in flaky.rows] == [float(s) for s in range(100)]
    assert flaky.calls == 110
    assert delivery.degraded == []
    assert delivery.dropped == 0
    assert any("recovered at step 0" in r.getMessage() for r in caplog.records)


def test_recovering_backend_through_the_bus() -> None:
    """With the bus's default retry settings (backoff from 0.05 s), a 5-call outage loses no step."""
    flaky = FlakyAdapter(outage=5)
    bus = _bus(flaky)
    _run(bus, 20)
    bus.close(timeout_s=60)
    assert _steps(flaky) == list(range(20))


def test_strict_reraises_at_next_commit() -> None:
    """On a strict bus a failing write re-raises as AdapterError, with the cause, at a later commit."""
    bus = _bus(BrokenAdapter(), strict=True)
    bus.log("loss", 1.0)
    bus.commit()
    deadline = time.monotonic() + 10
    with pytest.raises(AdapterError, match="'broken' failed in write at step 0") as info:  # noqa: PT012
        while time.monotonic() < deadline:
            time.sleep(0.01)
            bus.log("loss", 1.0)
            bus.commit()
    assert isinstance(info.value.__cause__, OSError)
    bus.close()


def test_strict_reraises_at_close() -> None:
    """A failure that happens while closing a strict bus is raised by close()."""
    mem = MemoryAdapter()
    bus = _bus(BrokenAdapter(), mem, strict=True)
    bus.log("loss", 1.0)
    with pytest.raises(AdapterError, match="broken"):
        bus.close()
    assert mem.status == "finished"
    assert _steps(mem) == [0]


def test_drop_policy_counts_drops(caplog: pytest.LogCaptureFixture) -> None:
    """With queue_policy='drop' a full queue drops the newest step, counts it, and close reports the count."""
    gated = GatedAdapter()
    delivery = Delivery([gated], strict=True, queue_size=2, queue_policy="drop")
    delivery.open(run=RunInfo())
    delivery.submit(step=0, metrics={"x": 0.0})
    assert gated.entered.wait(10)
    for step in range(1, 10):
        delivery.submit(step=step, metrics={"x": float(step)})
    assert delivery.drops == {"gated": 7}
    assert delivery.dropped == 7
    gated.gate.set()
    with caplog.at_level(logging.WARNING, logger="metricbus.delivery"):
        delivery.close(status="finished", timeout_s=10)
    assert _steps(gated) == [0, 1, 2]
    assert any("7 steps dropped" in r.getMessage() for r in caplog.records)


def test_block_policy_waits_then_drops() -> None:
    """With queue_policy='block' a full queue waits queue_timeout_s, then counts a drop."""
    gated = GatedAdapter()
    delivery = Delivery([gated], strict=True, queue_size=1, queue_policy="block", queue_timeout_s=0.05)
    delivery.open(run=RunInfo())
    delivery.submit(step=0, metrics={"x": 0.0})
    assert gated.entered.wait(10)
    delivery.submit(step=1, metrics={"x": 1.0})
    delivery.submit(step=2, metrics={"x": 2.0})
    assert delivery.drops == {"gated": 1}
    gated.gate.set()
    delivery.close(status="finished", timeout_s=10)
    assert _steps(gated) == [0, 1]


def test_block_policy_waits_for_room() -> None:
    """A slow backend behind a small blocking queue loses nothing: submit waits for room."""
    slow = SlowAdapter(0.005)
    bus = _bus(slow, queue_size=2, queue_policy="block")
    _run(bus, 40)
    bus.close()
    assert _steps(slow) == list(range(40))


@pytest.mark.parametrize("policy", ["wait", "", "Drop"])
def test_invalid_queue_policy(policy: str) -> None:
    """An unknown queue policy is a ValueError that lists the valid ones."""
    with pytest.raises(ValueError, match="use one of block, drop"):
        Delivery([], strict=False, queue_policy=policy)
    with pytest.raises(ValueError, match="use one of block, drop"):
        _bus(MemoryAdapter(), queue_policy=policy)


def test_close_drains_flushes_and_closes() -> None:
    """close() waits for queued steps, then flushes and closes each adapter with the given status."""
    slow, mem = SlowAdapter(0.01), MemoryAdapter()
    bus = _bus(slow, mem)
    _run(bus, 30)
    bus.close(status="failed", timeout_s=30)
    assert _steps(slow) == _steps(mem) == list(range(30))
    assert slow.flushes == mem.flushes == 1
    assert slow.status == mem.status == "failed"


def test_close_timeout_reports_what_did_not_drain(caplog: pytest.LogCaptureFixture) -> None:
    """A backend that cannot drain within timeout_s is reported, and close() returns."""
    gated, mem = GatedAdapter(), MemoryAdapter()
    bus = _bus(gated, mem)
    _run(bus, 5)
    with caplog.at_level(logging.ERROR, logger="metricbus.delivery"):
        bus.close(timeout_s=0.2)
    gated.gate.set()
    assert _steps(mem) == list(range(5))
    assert any("'gated' did not drain within 0.2 s: 5 steps not delivered" in r.getMessage() for r in caplog.records)


def test_open_failure_is_reported_and_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    """With on_open_error="warn", an adapter whose open raises gets no writes; it is reported, the others go on."""
    bad, mem = NoOpen(), MemoryAdapter()
    with caplog.at_level(logging.ERROR, logger="metricbus.delivery"):
        bus = _bus(bad, mem, on_open_error="warn")
        _run(bus, 5)
        bus.close()
    assert bad.rows == []
    assert _steps(mem) == list(range(5))
    assert any("'noopen' failed in open" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("strict", [False, True])
def test_open_failure_raises_and_closes_the_others(strict: bool) -> None:
    """By default an open failure raises from the constructor, naming the adapter, the reason and the way out;
    the adapters that opened are closed as failed."""
    mem = MemoryAdapter()
    expected = "'noopen' could not open .PermissionError: no credentials.*on_open_error='warn'"
    with pytest.raises(AdapterError, match=expected) as info:
        _bus(NoOpen(), mem, strict=strict)
    assert isinstance(info.value.__cause__, PermissionError)
    assert mem.status == "failed"


def test_on_delivered_acknowledges_only_flushed_steps() -> None:
    """on_delivered(index, adapter, step) comes from the adapter's thread, after a flush() that followed the write."""
    calls: list[tuple[int, int, int, list[int], str]] = []
    first, second = MemoryAdapter(), FlakyAdapter(outage=2)

    def delivered(index: int, adapter: MemoryAdapter, step: int) -> None:
        calls.append((index, step, adapter.flushes, _steps(adapter), threading.current_thread().name))

    delivery = Delivery([first, second], strict=True, on_delivered=delivered, **FAST_RETRY)
    delivery.open(run=RunInfo())
    for step in range(3):
        delivery.submit(step=step, metrics={"x": 1.0})
    delivery.close(status="finished", timeout_s=10)
    for index in (0, 1):
        mine = [c for c in calls if c[0] == index]
        assert mine, f"adapter {index} never acknowledged"
        assert mine[-1][1] == 2  # the last step is acknowledged by the end
        for _, step, flushes, written, thread in mine:
            assert flushes >= 1  # a flush() returned before the acknowledgement
            assert step in written
            assert thread.startswith("metricbus-")
        assert [c[1] for c in mine] == sorted({c[1] for c in mine})  # increasing, each once
    assert delivery.acknowledged == {"memory": 2, "flaky": 2}


def test_no_thread_before_open() -> None:
    """Building a Delivery starts nothing; open() starts one named thread per adapter."""
    before = set(threading.enumerate())  # an earlier test's bus left open may still have its threads: not ours
    delivery = Delivery([MemoryAdapter()], strict=False)
    assert not set(threading.enumerate()) - before
    delivery.open(run=RunInfo())
    started = set(threading.enumerate()) - before
    assert [t.name for t in started] == ["metricbus-memory"]
    delivery.close(status="finished", timeout_s=10)
    assert not any(t.is_alive() for t in started)


def test_submit_copies_the_metrics() -> None:
    """Changing the caller's dict after submit() does not change what the adapter receives."""
    gated = GatedAdapter()
    delivery = Delivery([gated], strict=True)
    delivery.open(run=RunInfo())
    metrics = {"x": 1.0}
    delivery.submit(step=0, metrics=metrics)
    metrics["x"] = 2.0
    metrics["y"] = 3.0
    gated.gate.set()
    delivery.close(status="finished", timeout_s=10)
    assert gated.rows == [(0, {"x": 1.0})]


def test_bus_context_manager_closes_failed_on_exception() -> None:
    """A trainer that raises inside ``with bus`` ends each adapter's run as failed, after delivering its steps."""
    slow = SlowAdapter(0.01)
    with pytest.raises(RuntimeError, match="boom"), _bus(slow) as bus:  # noqa: PT012
        _run(bus, 5)
        raise RuntimeError("boom")
    assert _steps(slow) == list(range(5))
    assert slow.status == "failed"
