"""A metric read as ``std`` whose records sit at the top of the double range, split across workers: its Σw·x goes
beyond the range (further components whose sum overflows). The commit reduces it (mean exact, std inf: the
per-worker ``t = m2 + S²/W`` overflows, the documented limit) instead of raising OverflowError, live and in replay."""

from __future__ import annotations

from pathlib import Path

from metricbus import MetricBus
from metricbus.replay import replay
from metricbus.testing import MemoryAdapter

TOP = 1.7976931348623157e308


def partial_of(records: list[float]) -> object:
    worker = MetricBus(dist=None)
    worker.define("x", ["mean", "std"])
    for x in records:
        worker.log("x", x)
    part = worker.export()
    worker.close()
    return part


def test_workers_at_the_top_of_the_range_commit_and_replay(tmp_path: Path) -> None:
    live = MemoryAdapter()
    driver = MetricBus(adapters=[live], dist=None, strict=True, journal=tmp_path / "j")
    driver.define("x", ["mean", "std"])
    driver.log("y", 1.0)
    driver.ingest([partial_of([TOP] * 4), partial_of([TOP] * 4)])
    out = driver.commit(step=1)
    assert out == {"x/mean": TOP, "x/std": float("inf"), "y": 1.0}
    driver.ingest([partial_of([TOP, -TOP]), partial_of([1.0])])  # the next step is unaffected
    assert driver.commit(step=2)["x/mean"] == 1.0 / 3.0
    driver.close()
    again = MemoryAdapter()
    replay(tmp_path / "j", [again])
    assert again.rows == live.rows
