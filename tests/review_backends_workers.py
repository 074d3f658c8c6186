"""Adapters of the test's own (passed to the bus as objects) and a child trainer for tests/test_review_backends_2.py.

    python tests/review_backends_workers.py picky OUT    # 10 steps, flushed after step 5, then os._exit(0)
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metricbus import MetricBus


class Picky:
    """A backend that rejects step ``bad`` for good (a ValueError: permanent) and keeps every other write in a file.

    ``bad`` is not a constructor option: the delivery cursor's key hashes those, and a fix must keep the cursor."""

    name = "picky"
    bad = 3

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None

    def open(self, *, run: Any) -> None:
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        if step == self.bad:
            raise ValueError(f"picky rejects step {step}")
        self._file.write(json.dumps([step, dict(metrics)]) + "\n")

    def flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, *, status: str) -> None:
        self._file.write(json.dumps(["closed", status]) + "\n")
        self._file.close()


def picky_rows(path: Path) -> list[Any]:
    """What a Picky adapter wrote: ``[step, metrics]`` rows and ``["closed", status]`` markers, in order."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class Flaky:
    """A backend whose first ``fails`` writes raise ConnectionError (transient), then writes go to memory."""

    name = "flaky"
    fails = 2

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed: str | None = None

    def open(self, *, run: Any) -> None:
        pass

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        if self.fails > 0:
            self.fails -= 1
            raise ConnectionError("flaky backend away for a moment")
        self.steps.append(step)

    def flush(self) -> None:
        pass

    def close(self, *, status: str) -> None:
        self.closed = status


class Hung:
    """A backend whose write of step ``hang_at`` never returns (until ``release`` is set); keeps the rest in memory."""

    name = "hung"

    def __init__(self, hang_at: int) -> None:
        self.hang_at = hang_at
        self.release = threading.Event()
        self.steps: list[int] = []
        self.closed: str | None = None

    def open(self, *, run: Any) -> None:
        pass

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        if step == self.hang_at:
            self.release.wait()
        self.steps.append(step)

    def flush(self) -> None:
        pass

    def close(self, *, status: str) -> None:
        self.closed = status


def picky_child(out: str) -> None:
    """Commit steps 0..9 to a Picky backend, acknowledged through step 5, then die without closing anything."""
    bus = MetricBus(dist=None, journal=f"{out}/journal", adapters=[Picky(f"{out}/picky.jsonl")])
    for step in range(10):
        bus.log("x", float(step))
        bus.commit(step=step)
        if step == 5:
            assert bus.flush(timeout_s=60)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "picky":
        picky_child(sys.argv[2])
