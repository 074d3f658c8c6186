"""What handing steps to an adapter's delivery thread costs a trainer committing in a tight loop, with the worker
woken at every put (``Bounded.POLL_S = 0``: the behaviour before coalesced wake-ups) and with the default poll.

Run: ``python benchmarks/bench_wake.py``. For each setting, in one run: ``commit()`` of 100 metrics x 8 records
(median and mean, the caller's thread) and the whole process's CPU per step (every thread: ``log()`` x 800,
``commit()`` and the delivery thread's share), with an adapter whose calls do nothing, with ``MemoryAdapter``
and with no adapter at all (no delivery thread: the floor). The settings alternate in one process,
``--repeats`` times; each figure is the median over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping

from metricbus import MetricBus
from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.delivery_worker import Bounded
from metricbus.testing import MemoryAdapter

NAMES = [f"metric/{i:03d}" for i in range(100)]


class NullAdapter:
    """Accepts every call and does nothing: what remains is the delivery machinery itself."""

    name = "null"

    def open(self, *, run: RunInfo) -> None:
        """Nothing."""

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Nothing."""

    def flush(self) -> None:
        """Nothing."""

    def close(self, *, status: Status) -> None:
        """Nothing."""


def measure(adapters: list[Adapter], *, steps: int) -> tuple[float, float, float]:
    """(median and mean ``commit()`` in µs, process CPU per step in µs) over ``steps`` steps after a warm-up."""
    bus = MetricBus(adapters=adapters, dist=None, strict=True)
    log = bus.log

    def fill() -> None:
        for name in NAMES:
            for j in range(8):
                log(name, 0.25 * j)

    for _ in range(300):
        fill()
        bus.commit()
    samples = []
    cpu = time.process_time()
    for _ in range(steps):
        fill()
        start = time.perf_counter_ns()
        bus.commit()
        samples.append(time.perf_counter_ns() - start)
    cpu = time.process_time() - cpu
    bus.close()
    return statistics.median(samples) / 1e3, statistics.mean(samples) / 1e3, cpu / steps * 1e6


def main() -> None:
    """Alternate the settings in one process and print the median over the repeats of each figure."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    default = Bounded.POLL_S
    kinds: dict[str, Callable[[], list[Adapter]]] = {
        "null adapter": lambda: [NullAdapter()],
        "MemoryAdapter": lambda: [MemoryAdapter()],
    }
    runs: dict[tuple[str, float], list[tuple[float, float, float]]] = {}
    try:
        for _ in range(args.repeats):
            Bounded.POLL_S = default
            runs.setdefault(("no adapter", default), []).append(measure([], steps=args.steps))
            for poll in (0.0, default):
                Bounded.POLL_S = poll
                for label, make in kinds.items():
                    runs.setdefault((label, poll), []).append(measure(make(), steps=args.steps))
    finally:
        Bounded.POLL_S = default

    def mid(key: tuple[str, float]) -> tuple[float, float, float]:
        median, mean, cpu = zip(*runs[key], strict=True)
        return statistics.median(median), statistics.median(mean), statistics.median(cpu)

    floor = mid(("no adapter", default))
    print(f"medians of {args.repeats} alternating repeats, {args.steps} steps each; commit() of 100 metrics x 8")
    print(f"{'':34s} {'commit() median':>15s} {'commit() mean':>14s} {'process CPU/step':>17s}")
    print(f"{'no adapter (no delivery thread)':34s} {floor[0]:12.1f} us {floor[1]:11.1f} us {floor[2]:14.1f} us")
    for label in kinds:
        for poll, what in ((0.0, "woken at every put"), (default, f"poll {default * 1e3:g} ms")):
            median, mean, cpu = mid((label, poll))
            print(f"{label + ', ' + what:34s} {median:12.1f} us {mean:11.1f} us {cpu:14.1f} us")
        old, new = mid((label, 0.0)), mid((label, default))
        print(f"  {label}: with the poll, commit() median {old[0] / new[0]:.2f}x, mean {old[1] / new[1]:.2f}x, "
              f"delivery's CPU per step over no adapter {old[2] - floor[2]:.1f} -> {new[2] - floor[2]:.1f} us")


if __name__ == "__main__":
    main()
