"""What handing steps to an adapter's delivery thread costs a trainer that commits in a tight loop: the thread
woken at every put (``Bounded.RING_AT = 1``, ``HANDOFF_S = 0``: the behaviour before batched wake-ups and
hand-offs) against the default, with no adapter at all (no delivery thread) as the floor.

Run: ``python benchmarks/bench_wake.py``. For each setting, in one run: ``commit()`` of 100 metrics x 8 records
(median and mean, the caller's thread), the whole process's CPU per step (every thread: ``log()`` x 800,
``commit()`` and the delivery thread's share) and the futex system calls per step (``/proc``: the voluntary
context switches of every thread), with an adapter whose calls do nothing and with ``MemoryAdapter``. The settings
alternate in one process, ``--repeats`` times; each figure is the median over the repeats. Then, with a 2 ms pause
after each commit (a trainer waiting on its GPU releases the GIL for that long) and a 30 ms one: the commit's
median and how long a step waited before its adapter's ``write`` (median and largest).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Mapping

from metricbus import MetricBus
from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.delivery_worker import Bounded
from metricbus.testing import MemoryAdapter

NAMES = [f"metric/{i:03d}" for i in range(100)]
SETTINGS = {"woken at every put": (1, 0.0), "default": (Bounded.RING_AT, Bounded.HANDOFF_S)}


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


class StampAdapter(NullAdapter):
    """Notes when each step reached ``write``, against ``queued`` (set by the loop just before the commit)."""

    def __init__(self) -> None:
        self.queued: dict[int, float] = {}
        self.waited: list[float] = []

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Note the wait."""
        self.waited.append(time.perf_counter() - self.queued[step])


def switches() -> int:
    """Voluntary context switches of every thread of this process so far (a thread blocks on a futex for each)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue
    return total


def fill(log: Callable[..., None]) -> None:
    """One step's records: 100 metrics x 8."""
    for name in NAMES:
        for j in range(8):
            log(name, 0.25 * j)


def tight(adapters: list[Adapter], *, steps: int) -> tuple[float, float, float, float]:
    """(median and mean ``commit()`` in µs, process CPU per step in µs, voluntary switches per step)."""
    bus = MetricBus(adapters=adapters, dist=None, strict=True)
    for _ in range(300):
        fill(bus.log)
        bus.commit()
    samples = []
    cpu, switched = time.process_time(), switches()
    for _ in range(steps):
        fill(bus.log)
        start = time.perf_counter_ns()
        bus.commit()
        samples.append(time.perf_counter_ns() - start)
    cpu, switched = time.process_time() - cpu, switches() - switched  # before close: its joins switch too
    bus.close()
    return statistics.median(samples) / 1e3, statistics.mean(samples) / 1e3, cpu / steps * 1e6, switched / steps


def paced(pause_s: float, *, steps: int) -> tuple[float, float, float]:
    """(median ``commit()`` in µs, median and largest wait of a step for its adapter in ms), ``pause_s`` apart."""
    stamp = StampAdapter()
    bus = MetricBus(adapters=[stamp], dist=None, strict=True)
    samples = []
    for step in range(steps):
        fill(bus.log)
        stamp.queued[step] = time.perf_counter()
        start = time.perf_counter_ns()
        bus.commit(step)
        samples.append(time.perf_counter_ns() - start)
        time.sleep(pause_s)
    bus.close()
    return statistics.median(samples) / 1e3, statistics.median(stamp.waited) * 1e3, max(stamp.waited) * 1e3


def use(setting: str) -> None:
    """Set the class attributes of ``setting``."""
    Bounded.RING_AT, Bounded.HANDOFF_S = SETTINGS[setting]


def main() -> None:
    """Alternate the settings in one process and print the median over the repeats of each figure."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    kinds: dict[str, Callable[[], list[Adapter]]] = {
        "null adapter": lambda: [NullAdapter()],
        "MemoryAdapter": lambda: [MemoryAdapter()],
    }
    runs: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    try:
        for _ in range(args.repeats):
            runs.setdefault(("no adapter", ""), []).append(tight([], steps=args.steps))
            for setting in SETTINGS:
                use(setting)
                for label, make in kinds.items():
                    runs.setdefault((label, setting), []).append(tight(make(), steps=args.steps))
        pacing = {}
        for pause_s, steps in ((0.002, 500), (0.03, 60)):
            for setting in SETTINGS:
                use(setting)
                pacing[(pause_s, setting)] = paced(pause_s, steps=steps)
    finally:
        use("default")

    def med(label: str, setting: str) -> tuple[float, ...]:
        return tuple(statistics.median(run[i] for run in runs[(label, setting)]) for i in range(4))

    print(f"{args.repeats} repeats of {args.steps} commits of 100 metrics x 8 records, settings alternating")
    print(f"{'':42s} commit() median  commit() mean  process CPU/step  switches/step")
    rows = [("no adapter (no delivery thread)", "no adapter", "")]
    rows += [(f"{label}, {setting}", label, setting) for label in kinds for setting in SETTINGS]
    for title, label, setting in rows:
        median, mean, cpu, switched = med(label, setting)
        print(f"{title:42s} {median:12.1f} us {mean:11.1f} us {cpu:13.1f} us {switched:13.2f}")
    floor = med("no adapter", "")
    for label in kinds:
        every, default = med(label, "woken at every put"), med(label, "default")
        print(
            f"  {label}: default against woken at every put: commit() median {every[0] / default[0]:.2f}x, mean "
            f"{every[1] / default[1]:.2f}x; CPU per step over no adapter {every[2] - floor[2]:.1f} -> "
            f"{default[2] - floor[2]:.1f} us"
        )
    for (pause_s, setting), (median, waited, longest) in pacing.items():
        print(
            f"{pause_s * 1e3:4.0f} ms between commits, {setting:20s}: commit() median {median:7.1f} us; a step waited "
            f"for its adapter {waited:6.2f} ms (median), {longest:6.2f} ms (largest)"
        )


if __name__ == "__main__":
    main()
