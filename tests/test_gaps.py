"""A step an adapter's backend rejected for good is recorded next to the journal and retried by the next sync."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.errors import AdapterError
from metricbus.replay import sync


class Picky:
    """An adapter whose backend rejects some steps permanently (a ValueError), until it is fixed."""

    name = "picky"
    cursor_key = "picky"  # the fixed adapter is the same target for the journal's cursors
    permanent_errors = (ValueError,)

    def __init__(self, *, reject: set[int]) -> None:
        self.reject = reject
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.status: Any = None

    def open(self, *, run: Any) -> None:
        """Nothing to open."""

    def write(self, *, step: int, metrics: Any) -> None:
        """Reject the steps in ``reject``; keep the others."""
        if step in self.reject:
            raise ValueError(f"the backend rejects step {step}")
        self.rows.append((step, dict(metrics)))

    def flush(self) -> None:
        """Rows are kept in memory."""

    def close(self, *, status: Any) -> None:
        """Remember how the run ended."""
        self.status = status


def test_a_rejected_step_is_retried_by_sync_after_a_fix(tmp_path: Path) -> None:
    """Live: step 3 rejected, the others delivered, the run ends failed; sync sends step 3 alone, then nothing."""
    journal = str(tmp_path / "j")
    live = Picky(reject={3})
    bus = MetricBus(dist=None, adapters=[live], journal=journal)
    for step in range(6):
        bus.log("x", float(step))
        bus.commit(step=step)
    bus.close()
    assert [s for s, _ in live.rows] == [0, 1, 2, 4, 5]
    assert live.status == "failed"
    fixed = Picky(reject=set())
    assert sync(journal, [fixed]) == {"picky": 1}
    assert fixed.rows == [(3, {"x": 3.0})]
    again = Picky(reject=set())
    assert sync(journal, [again]) == {"picky": 0}
    assert again.rows == []


def test_a_gap_that_is_still_rejected_stays_for_the_next_sync(tmp_path: Path) -> None:
    """A sync whose backend still rejects the step keeps the gap; a later, fixed sync delivers it."""
    journal = str(tmp_path / "j")
    bus = MetricBus(dist=None, adapters=[Picky(reject={1})], journal=journal)
    for step in range(3):
        bus.log("x", float(step))
        bus.commit(step=step)
    bus.close()
    still = Picky(reject={1})
    with pytest.raises(AdapterError, match=r"rejected step 1 for good \(ValueError: the backend rejects step 1\)"):
        sync(journal, [still])  # the other steps (none here) were sent; the gap stays
    fixed = Picky(reject=set())
    sync(journal, [fixed])
    assert fixed.rows == [(1, {"x": 1.0})]


class Unreachable(Picky):
    """An adapter whose backend cannot be reached when the run is opened."""

    def open(self, *, run: Any) -> None:
        """Fail as a backend that refuses the connection."""
        raise ConnectionRefusedError(f"{self.name}: the server refused the connection")


def test_sync_names_every_adapter_that_failed_not_only_the_first(tmp_path: Path) -> None:
    """Two fail (one cannot open, one rejects a step), one works: the error names both; the third gets all."""
    journal = str(tmp_path / "j")
    with MetricBus(dist=None, journal=journal) as bus:
        for step in range(3):
            bus.log("x", float(step))
            bus.commit(step=step)
    down, picky, fine = Unreachable(reject=set()), Picky(reject={1}), Picky(reject=set())
    down.name = down.cursor_key = "down"
    fine.name = fine.cursor_key = "fine"
    with pytest.raises(AdapterError) as raised:
        sync(journal, [down, picky, fine])
    said = str(raised.value)
    assert said.startswith("2 adapters failed in this sync: ")
    assert "adapter 'down' failed (ConnectionRefusedError: down: the server refused the connection)" in said
    assert "adapter 'picky' rejected step 1 for good (ValueError: the backend rejects step 1)" in said
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)
    assert [s for s, _ in fine.rows] == [0, 1, 2]
    assert [s for s, _ in picky.rows] == [0, 2]
    assert picky.status == "failed"
    again = Picky(reject=set())
    assert sync(journal, [again]) == {"picky": 1}  # the rejected step, kept as a gap, is sent once fixed
    assert again.rows == [(1, {"x": 1.0})]


class Gate(Picky):
    """A Picky whose write waits until ``gate`` is set (a backend that stalls while steps arrive)."""

    def __init__(self, *, gate: Any) -> None:
        super().__init__(reject=set())
        self.gate = gate

    def write(self, *, step: int, metrics: Any) -> None:
        """Wait for the gate, then keep the row."""
        self.gate.wait(30)
        super().write(step=step, metrics=metrics)


def test_steps_dropped_at_a_full_queue_are_delivered_by_sync(tmp_path: Path) -> None:
    """queue_policy="drop": steps dropped while the backend stalled are kept as gaps (the cursor passes them),
    and sync delivers exactly those."""
    import threading

    journal, gate = str(tmp_path / "j"), threading.Event()
    live = Gate(gate=gate)
    bus = MetricBus(dist=None, adapters=[live], journal=journal, queue_size=1, queue_policy="drop")
    for step in range(6):
        bus.log("x", float(step))
        bus.commit(step=step)
    gate.set()
    bus.close()
    delivered = [s for s, _ in live.rows]
    dropped = sorted(set(range(6)) - set(delivered))
    assert dropped  # the stalled write holds step 0, the queue one more: the rest were dropped
    assert delivered[-1] == 5 or 5 in dropped
    fixed = Picky(reject=set())
    assert sync(journal, [fixed]) == {"picky": len(dropped)}
    assert [s for s, _ in fixed.rows] == dropped
