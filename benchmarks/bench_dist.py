"""Per-commit latency and collective count: metricbus vs torchmetrics vs Lightning's sync_dist, 4 gloo ranks.

Run: .venv/bin/python benchmarks/bench_dist.py
K in {10, 100, 1000} metrics x 8 micro-batches; same data for all three; checks the means agree.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

SIZE = 4
MICRO = 8
KS = (10, 100, 1000)
REPS = {"metricbus": 20, "lightning": 5, "torchmetrics": 3}
REPS_TM_1000 = 1  # torchmetrics at K=1000 takes seconds per step: one repetition


def _count(calls: dict[str, int]) -> None:
    names = ("all_gather_single", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast", "barrier",
             "all_gather")
    for n in names:
        fn = getattr(tdist, n)

        def wrap(*a: Any, _n: str = n, _fn: Any = fn, **k: Any) -> Any:
            calls[_n] = calls.get(_n, 0) + 1
            return _fn(*a, **k)

        setattr(tdist, n, wrap)


def _value(rank: int, step: int, m: int, i: int) -> float:
    return float((rank * 7919 + step * 104729 + m * 31 + i * 17) % 1000) / 7.0


def worker(rank: int, port: int, out: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    from torchmetrics.aggregation import MeanMetric

    from metricbus import MetricBus

    calls: dict[str, int] = {}
    _count(calls)
    res: dict[Any, Any] = {}
    for k in KS:
        names = [f"m{i}" for i in range(k)]
        bus = MetricBus(dist="torch")
        for step in range(REPS["metricbus"] + 1):
            for m in range(MICRO):
                for i, n in enumerate(names):
                    bus.log(n, _value(rank, step, m, i))
            tdist.barrier()
            calls.clear()  # the alignment barrier is not counted
            t0 = time.perf_counter()
            got = bus.commit(step=step)
            dt = time.perf_counter() - t0
            if step:  # step 0 agrees the key set
                res.setdefault(("metricbus", k), []).append((dt, sum(calls.values()), got))
        bus.close()
        reps = REPS_TM_1000 if k == 1000 else REPS["torchmetrics"]
        for step in range(reps):
            tms = {n: MeanMetric() for n in names}
            for m in range(MICRO):
                for i, n in enumerate(names):
                    tms[n].update(_value(rank, step + 1, m, i))
            tdist.barrier()
            calls.clear()  # the alignment barrier is not counted
            t0 = time.perf_counter()
            got = {n: float(tms[n].compute()) for n in names}
            dt = time.perf_counter() - t0
            res.setdefault(("torchmetrics", k), []).append((dt, sum(calls.values()), got))
        for step in range(REPS["lightning"]):
            sums = dict.fromkeys(names, 0.0)
            for m in range(MICRO):
                for i, n in enumerate(names):
                    sums[n] += _value(rank, step + 1, m, i)
            tdist.barrier()
            calls.clear()  # the alignment barrier is not counted
            t0 = time.perf_counter()
            got = {}
            for n in names:  # Lightning sync_dist: barrier + all_reduce of the (micro-mean) per metric
                tdist.barrier()
                t = torch.tensor(sums[n] / MICRO, dtype=torch.float64)
                tdist.all_reduce(t)
                got[n] = float(t) / SIZE
            dt = time.perf_counter() - t0
            res.setdefault(("lightning", k), []).append((dt, sum(calls.values()), got))
    if rank == 0:
        out.put(res)
    tdist.barrier()
    tdist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, out)) for r in range(SIZE)]
    for p in procs:
        p.start()
    res = out.get(timeout=600)
    for p in procs:
        p.join()
    print(f"{SIZE} gloo ranks, {MICRO} micro-batches; median per-commit latency; collectives per commit")
    print(f"reps: metricbus {REPS['metricbus']}, lightning {REPS['lightning']}, torchmetrics "
          f"{REPS['torchmetrics']} ({REPS_TM_1000} at K=1000)")
    ok = True
    for k in KS:
        med = {}
        for lib in ("metricbus", "torchmetrics", "lightning"):
            rows = res[(lib, k)]
            med[lib] = statistics.median(r[0] for r in rows)
            print(f"K={k:5d} {lib:13s} {med[lib] * 1e3:10.2f} ms  collectives {rows[-1][1]}")
        mb, tm, lt = (res[(lib, k)][0][2] for lib in ("metricbus", "torchmetrics", "lightning"))
        agree = all(abs(mb[n] - tm[n]) <= 1e-6 * max(1.0, abs(mb[n])) and abs(mb[n] - lt[n]) <= 1e-9 * max(
            1.0, abs(mb[n])) for n in mb)
        ok &= agree
        print(f"K={k:5d} means agree: {agree}; torchmetrics/metricbus {med['torchmetrics'] / med['metricbus']:.1f}x, "
              f"lightning/metricbus {med['lightning'] / med['metricbus']:.1f}x")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
