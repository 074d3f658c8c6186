"""What handing steps to an adapter's delivery thread costs a trainer committing in a tight loop, with the worker
woken at every put (``Bounded.POLL_S = 0``: the behaviour before coalesced wake-ups) and with the default poll.

Run: ``python benchmarks/bench_wake.py``. For each setting, in one run: ``commit()`` of 100 metrics x 8 records
(median, the caller's thread) and the whole process's CPU per step (every thread: ``log()`` x 800, ``commit()`` and
the delivery thread's share), with an adapter whose calls do nothing, with ``MemoryAdapter`` and with no adapter at
all (no delivery thread: the floor). The settings alternate, ``--repeats`` times.
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


def measure(adapters: list[Adapter], *, steps: int) -> tuple[float, float]:
    """(median ``commit()`` in µs, process CPU per step in µs) over ``steps`` steps after a warm-up."""
    bus = MetricBus(adapters=adapters, dist=None, strict=True)
    log = bus.log

    def fill() -> None:
        for name in NAMES:
            for j in range(8):
                log(name, 0.25 * j)

    for _ in range(200):
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
    return statistics.median(samples) / 1e3, cpu / steps * 1e6


def main() -> None:
    """Alternate the settings and print each one's best figures and their ratios."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    default = Bounded.POLL_S
    kinds: dict[str, Callable[[], list[Adapter]]] = {
        "no adapter": list,
        "null adapter": lambda: [NullAdapter()],
        "MemoryAdapter": lambda: [MemoryAdapter()],
    }
    best: dict[tuple[str, float], tuple[float, float]] = {}
    try:
        for _ in range(args.repeats):
            for poll in (0.0, default):
                Bounded.POLL_S = poll
                for label, make in kinds.items():
                    if label == "no adapter" and poll != default:
                        continue  # no delivery thread: the poll does not matter
                    commit_us, cpu_us = measure(make(), steps=args.steps)
                    held = best.get((label, poll), (float("inf"), float("inf")))
                    best[(label, poll)] = (min(held[0], commit_us), min(held[1], cpu_us))
    finally:
        Bounded.POLL_S = default
    floor_commit, floor_cpu = best[("no adapter", default)]
    print(f"best of {args.repeats}, {args.steps} steps each; commit() of 100 metrics x 8 records")
    print(f"{'':28s} {'commit() median':>16s} {'process CPU/step':>17s} {'CPU over no adapter':>20s}")
    print(f"{'no adapter':28s} {floor_commit:13.1f} us {floor_cpu:14.1f} us")
    for label in ("null adapter", "MemoryAdapter"):
        for poll, what in ((0.0, "woken at every put"), (default, f"poll {default * 1e3:g} ms")):
            commit_us, cpu_us = best[(label, poll)]
            print(f"{label + ', ' + what:28s} {commit_us:13.1f} us {cpu_us:14.1f} us {cpu_us - floor_cpu:17.1f} us")
        old, new = best[(label, 0.0)], best[(label, default)]
        print(f"  {label}: commit() {old[0] / new[0]:.2f}x faster, delivery's CPU per step "
              f"{(old[1] - floor_cpu) / max(new[1] - floor_cpu, 1e-9):.2f}x less with the poll")


if __name__ == "__main__":
    main()
