"""Cost of ``MetricBus.log()`` and ``commit()``, each also as a ratio to the floor ``d[name].append(x)``.

Run: ``python benchmarks/bench_log.py``. Every figure is the median over many repeats of one batch of calls,
timed with ``time.perf_counter_ns``, all in this one run (so the ratios compare like with like).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from metricbus import MetricBus
from metricbus.reduce import StepReducer
from metricbus.testing import MemoryAdapter

REPEATS = 301


def samples_ns(
    batch: Callable[[], None],
    calls: int,
    *,
    repeats: int = REPEATS,
    setup: Callable[[], None] | None = None,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> list[float]:
    """(time of one ``batch()``) / ``calls`` in ns, ``repeats`` times; ``setup`` runs untimed before each.
    ``clock``: ``time.thread_time_ns`` counts this thread's CPU time only (steady on a loaded machine)."""
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = clock()
        batch()
        samples.append((clock() - start) / calls)
    return samples


def median_ns(
    batch: Callable[[], None],
    calls: int,
    *,
    repeats: int = REPEATS,
    setup: Callable[[], None] | None = None,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> float:
    """The median of :func:`samples_ns`."""
    return statistics.median(samples_ns(batch, calls, repeats=repeats, setup=setup, clock=clock))


def main() -> None:
    """Measure and print the figures and the floor."""
    inner = 200
    d: defaultdict[str, list[float]] = defaultdict(list)

    def floor() -> None:
        for _ in range(inner):
            d["loss"].append(0.5)
        d["loss"].clear()

    floor_ns = median_ns(floor, inner)

    bus = MetricBus(adapters=[MemoryAdapter()], dist=None, strict=True)
    log = bus.log

    def one_float() -> None:
        for _ in range(inner):
            log("loss", 0.5)

    def after_batch() -> None:
        bus.commit()

    bus.log("loss", 0.5)
    one_ns = median_ns(one_float, inner, setup=after_batch)

    ten = {f"m{i}": 0.1 * i for i in range(10)}

    def dict_of_ten() -> None:
        for _ in range(inner):
            log(ten)

    dict_ns = median_ns(dict_of_ten, inner, setup=after_batch)

    array = np.linspace(0.0, 1.0, 1024)

    def one_array() -> None:
        for _ in range(20):
            log("lengths", array)

    array_ns = median_ns(one_array, 20, setup=after_batch)

    def arrays_and_commit() -> None:  # the honest figure: the arrays are summarised at the commit (the fold)
        for _ in range(20):
            log("lengths", array)
        bus.commit()

    def commit_only() -> None:  # what the commit itself costs for the metrics of one_array(), to subtract
        log("lengths", 0.5)
        bus.commit()

    array_fold_ns = median_ns(arrays_and_commit, 20, setup=after_batch)
    array_commit_ns = median_ns(commit_only, 1, setup=after_batch)

    # The same arrays into a distribution metric: the fold also buckets them into the metric's sketch.
    bus.define("lengths_d", ["mean", "p50", "p90", "p99"])
    lengths = np.random.default_rng(1).lognormal(5.0, 1.0, 1024)

    def sketch_arrays_and_commit() -> None:
        for _ in range(20):
            log("lengths_d", lengths)
        bus.commit()

    def sketch_commit_only() -> None:
        log("lengths_d", 5.0)
        bus.commit()

    sketch_fold_ns = median_ns(sketch_arrays_and_commit, 20, setup=after_batch)
    sketch_commit_ns = median_ns(sketch_commit_only, 1, setup=after_batch)

    cbus = MetricBus(adapters=[MemoryAdapter()], dist=None, strict=True)
    names = [f"metric/{i:03d}" for i in range(100)]

    def fill() -> None:
        for name in names:
            for j in range(8):
                cbus.log(name, 0.25 * j)

    def commit() -> None:
        cbus.commit()

    commits = samples_ns(commit, 1, setup=fill)
    commit_ns, commit_mean_ns = statistics.median(commits), statistics.mean(commits)
    commit_cpu_ns = median_ns(commit, 1, setup=fill, clock=time.thread_time_ns)

    # The same with random values: their exact sums need a remainder (lo != 0), so the mean is the exact division.
    rng = np.random.default_rng(0)
    noisy = rng.standard_normal((100, 8)).tolist()

    def fill_random() -> None:
        for name, row in zip(names, noisy, strict=True):
            for x in row:
                cbus.log(name, x)

    random_ns = median_ns(commit, 1, setup=fill_random)
    random_cpu_ns = median_ns(commit, 1, setup=fill_random, clock=time.thread_time_ns)

    # The same 800 random records in 4 optimizer updates of 2 records each: the update level merges per metric.
    def fill_updates() -> None:
        for update in range(4):
            for name, row in zip(names, noisy, strict=True):
                cbus.log(name, row[2 * update])
                cbus.log(name, row[2 * update + 1])
            cbus.end_update()

    updates_ns = median_ns(commit, 1, setup=fill_updates)
    real = StepReducer._merged_columns
    StepReducer._merged_columns = lambda *a, **k: None  # type: ignore[method-assign]  # one metric at a time
    try:
        per_metric_ns = median_ns(commit, 1, setup=fill_updates)
    finally:
        StepReducer._merged_columns = real  # type: ignore[method-assign]
    bus.close()
    cbus.close()

    print(f"floor d[name].append(x):              {floor_ns:10.1f} ns")
    print(f"log(name, float):                     {one_ns:10.1f} ns  ({one_ns / floor_ns:8.1f}x floor)")
    print(f"log(dict of 10 floats):               {dict_ns:10.1f} ns  ({dict_ns / floor_ns:8.1f}x floor)")
    print(f"log(name, numpy array of 1024):       {array_ns:10.1f} ns  ({array_ns / floor_ns:8.1f}x floor)")
    folded = (array_fold_ns * 20 - array_commit_ns) / 20
    print(
        f"  ... with its fold, per call:        {folded:10.1f} ns  ({folded / floor_ns:8.1f}x floor)  "
        "(20 arrays then commit(), less a one-record commit)"
    )
    sketched = (sketch_fold_ns * 20 - sketch_commit_ns) / 20
    print(
        f"  ... into a sketch (p50/p90/p99):    {sketched:10.1f} ns  ({sketched / floor_ns:8.1f}x floor)  "
        "(the same, the metric's spec reading quantiles)"
    )
    print(
        f"commit() of 100 metrics x 8 records:  {commit_ns:10.1f} ns  ({commit_ns / floor_ns:8.1f}x floor)  "
        f"thread CPU {commit_cpu_ns:10.1f} ns  mean {commit_mean_ns:10.1f} ns"
    )
    print(
        f"commit() as above, random values:     {random_ns:10.1f} ns  ({random_ns / floor_ns:8.1f}x floor)  "
        f"thread CPU {random_cpu_ns:10.1f} ns"
    )
    print(
        f"commit() as above, in 4 updates:      {updates_ns:10.1f} ns  ({updates_ns / floor_ns:8.1f}x floor)  "
        f"merged one metric at a time {per_metric_ns:10.1f} ns ({per_metric_ns / updates_ns:.1f}x)"
    )
    print(
        "targets: log(name, float) <= 500 ns; log(dict of 10) <= 1500 ns; log(array of 1024) <= 10000 ns "
        "(with its fold), into a sketch <= 20000 ns; commit() of 100 metrics <= 100000 ns"
    )
    gloo_sketches()


def _gloo_worker(rank: int, size: int, port: int, sketched: bool, out: Any) -> None:
    """Time commits of 10 metrics (a 256-record array each per rank), with or without distribution kinds."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        bus = MetricBus(dist="torch")
        spec = ["mean", "max", "p50", "p90", "p99", "hist"] if sketched else ["mean", "max"]
        for i in range(10):
            bus.define(f"m{i}", spec)
        rng = np.random.default_rng(rank)
        data = [rng.lognormal(5.0, 1.0, 256) for _ in range(10)]
        samples = []
        for step in range(COMMITS + 5):
            for i in range(10):
                bus.log(f"m{i}", data[i])
            tdist.barrier()
            start = time.perf_counter_ns()
            bus.commit(step=step)
            if step >= 5:  # the first commits agree on the names
                samples.append(time.perf_counter_ns() - start)
        bus.close()
        out.put((rank, statistics.median(samples)))
    finally:
        tdist.destroy_process_group()


COMMITS = 200


def gloo_sketches() -> None:
    """A commit of 10 metrics at 4 gloo ranks, with and without quantiles and a histogram (same records)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("gloo: torch is not installed, skipped")
        return
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("spawn")
    medians = {}
    for sketched in (False, True):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = ctx.Queue()
        procs = [ctx.Process(target=_gloo_worker, args=(r, 4, port, sketched, out)) for r in range(4)]
        for p in procs:
            p.start()
        times = [out.get(timeout=300)[1] for _ in procs]
        for p in procs:
            p.join()
        medians[sketched] = max(times)
    plain, with_sketches = medians[False], medians[True]
    print(f"gloo, 4 ranks, commit of 10 metrics (mean, max):            {plain / 1e3:10.1f} us")
    print(
        f"  ... the same metrics with p50, p90, p99 and hist as well:  {with_sketches / 1e3:10.1f} us  "
        f"({with_sketches / plain:5.2f}x)"
    )


if __name__ == "__main__":
    main()
