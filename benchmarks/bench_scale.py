"""The rank level at scale: real gloo ranks, synthetic ranks, a driver's ingest, and replay of an R-rank journal.

Run: ``python benchmarks/bench_scale.py [--parts a,b,c,d] [--quick] [--ranks 2,4,8]``. Every figure is measured in
this run; each ratio compares two things measured here, one after the other.

(a) real gloo ranks R in {2, 4, 8}, K in {10, 100, 1000}: median time of a steady ``commit()`` next to a bare
    ``all_reduce`` of an int64 vector as long as that commit's collectives together (rank 0's, and every rank's
    times pooled: four or eight processes on a small machine wait on one another's scheduling, so one rank's
    medians move more), the collectives and the bytes each rank hands them (``--reps`` steady commits);
(b) synthetic R in {64, 512, 4096, 32768} ranks' states through the same local code one rank runs (its states to
    its block, maxima, sums under the agreed maxima, finish): CPU time per commit and bytes per rank, next to the
    R*K*96 bytes per rank the former all_gather design received;
(c) a driver's ``ingest()`` + ``commit()`` of R partials of K=200 metrics, next to R*K ``d[k].append(x)``;
(d) replay of an R-rank journal written by such a driver: summaries per second.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metricbus import MetricBus, one_pass, rank_level
from metricbus.journal import stream_journal
from metricbus.reduce import StepReducer, lift_columns
from metricbus.replay import emitted
from metricbus.spec import parse_spec
from metricbus.summary import Summary

K_SYNTHETIC = 200


# -- (a) real gloo ranks ------------------------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_worker(  # noqa: PLR0917  (mp.Process passes arguments positionally)
    rank: int, size: int, port: int, ks: list[int], reps: int, out: Any
) -> None:
    import torch
    import torch.distributed as tdist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    calls: dict[str, list[int]] = defaultdict(list)
    for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor", "broadcast", "all_gather"):
        real = getattr(tdist, name)

        def wrap(*a: Any, _n: str = name, _f: Any = real, **k: Any) -> Any:
            calls[_n].append(sum(t.numel() * t.element_size() for t in a[:1] if hasattr(t, "numel")))
            return _f(*a, **k)

        setattr(tdist, name, wrap)
    rng = np.random.default_rng(rank)
    result = {}
    for k in ks:
        names = [f"m{i:04d}" for i in range(k)]
        bus = MetricBus(dist="torch")
        times, bare, seen = [], [], defaultdict(int)
        for step in range(reps + 2):
            for _ in range(8):
                for name, value in zip(names, rng.standard_normal(k).tolist(), strict=True):
                    bus.log(name, value)
            tdist.barrier()
            calls.clear()
            start = time.perf_counter()
            bus.commit(step=step)
            elapsed = time.perf_counter() - start
            if step < 2:  # the first commit agrees the key set, the second lays the sums out by the agreed maxima
                continue
            times.append(elapsed)
            sizes = list(calls["all_reduce"])
            seen[(len(sizes), sum(sizes))] += 1
            vector = torch.ones(sum(sizes) // 8, dtype=torch.int64)  # one all_reduce of the same bytes, bare
            tdist.barrier()
            start = time.perf_counter()
            tdist.all_reduce(vector)
            bare.append(time.perf_counter() - start)
        bus.close()
        result[k] = (times, bare, dict(seen))
    out.put((rank, result))
    tdist.destroy_process_group()


def part_a(quick: bool, sizes: tuple[int, ...] = (2, 4, 8), reps: int | None = None) -> None:
    import torch.multiprocessing as mp

    ks = [10, 100] if quick else [10, 100, 1000]
    reps = reps or (16 if quick else 48)
    print("(a) real gloo ranks: a steady commit() next to one bare all_reduce of the same bytes (rank 0, medians over")
    print(f"    {reps} steady commits; the mean includes the commits that agree the maxima again, every")
    print(f"    {one_pass.REFRESH + 1}th; all ranks: the medians of every rank's commits over their bare all_reduces);")
    print("    collectives: how many commits made how many all_reduces of how many bytes")
    print(f"{'R':>3} {'K':>5} {'commit ms':>10} {'bare ms':>9} {'ratio':>6} {'mean ms':>8} {'all ranks':>9}  "
          "collectives per commit")
    for size in sizes:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = _port()
        procs = [ctx.Process(target=_gloo_worker, args=(r, size, port, ks, reps, out)) for r in range(size)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=600) for _ in range(size))
        for p in procs:
            p.join(timeout=60)
        for k in ks:
            times, bares, seen = results[0][k]
            commit, bare, mean = statistics.median(times), statistics.median(bares), statistics.fmean(times)
            pooled = statistics.median(t for r in range(size) for t in results[r][k][0]) / statistics.median(
                b for r in range(size) for b in results[r][k][1]
            )
            shown = ", ".join(f"{n} x all_reduce ({b} B): {c}" for (n, b), c in sorted(seen.items()))
            print(f"{size:>3} {k:>5} {commit * 1e3:>10.3f} {bare * 1e3:>9.3f} {commit / bare:>6.2f} "
                  f"{mean * 1e3:>8.3f} {pooled:>9.2f}  {shown}")


# -- (b) synthetic ranks --------------------------------------------------------------------------------------------


def _rank_states(rng: np.random.Generator, k: int) -> dict[str, tuple[Summary, ...]]:
    return {f"m{i:03d}": (Summary.of_batch(rng.standard_normal(8).tolist(), None),) for i in range(k)}


def _block(states: dict[str, tuple[Summary, ...]], rank: int, columns: Any) -> rank_level.Block:
    names = sorted(states)
    row = [lift_columns(states[n], columns)[0] for n in names]
    return rank_level.block_of([row], [rank], [False] * len(names))


def part_b(quick: bool) -> None:
    sizes = [64, 512, 4096] if quick else [64, 512, 4096, 32768]
    print(f"(b) synthetic ranks, K={K_SYNTHETIC}: one rank's local CPU per commit (median of 30) and bytes per rank")
    print(f"{'R':>6} {'local ms':>9} {'MAX B':>7} {'SUM B':>7} {'all_gather B (before)':>22}")
    rng = np.random.default_rng(0)
    spec = parse_spec("mean", metric="m")
    reducer = StepReducer(log_every=1)
    columns = reducer.columns("m", spec)
    mine = _rank_states(rng, K_SYNTHETIC)
    updates = [{name: states[0] for name, states in mine.items()}]
    specs = dict.fromkeys(mine, spec)
    chunk = 2048
    for size in sizes:
        # the other ranks' data, reduced as the collectives would (MAX, then SUM), in chunks: not timed
        fields = rank_level.prepare(_block(mine, 0, columns)).block.fields
        agreed = rank_level.maxima(rank_level.prepare(_block(mine, 0, columns)))
        blocks = []
        for start in range(1, size, chunk):
            rows = min(chunk, size - start)
            block_fields = np.repeat(fields, rows, axis=1)
            noise = rng.standard_normal((rows, K_SYNTHETIC))
            block_fields[5] += noise
            block_fields[3] = block_fields[5]
            ranks = np.arange(start, start + rows)
            block = rank_level.Block(block_fields, ranks, np.zeros(K_SYNTHETIC, dtype=bool))
            agreed = np.maximum(agreed, rank_level.maxima(rank_level.prepare(block)))
            blocks.append(block)
        summed = sum(rank_level.sums(rank_level.prepare(b), agreed) for b in blocks)
        samples = []
        for _ in range(30):
            start_cpu = time.process_time()
            states = reducer.worker(updates, specs)
            prep = rank_level.prepare(_block(states, 0, columns))
            local_max = rank_level.maxima(prep)
            local_sum = rank_level.sums(prep, agreed)
            rank_level.finish(agreed, summed + local_sum, prep.block.moments)
            samples.append(time.process_time() - start_cpu)
        print(f"{size:>6} {statistics.median(samples) * 1e3:>9.3f} {local_max.nbytes + 8:>7} {local_sum.nbytes:>7} "
              f"{size * K_SYNTHETIC * 96:>22}")


# -- (c) a driver's ingest ------------------------------------------------------------------------------------------


def _partials(size: int, k: int) -> list[Any]:
    rng = np.random.default_rng(1)
    worker = MetricBus(dist=None)
    names = [f"m{i:03d}" for i in range(k)]
    out = []
    for _ in range(size):
        for name, value in zip(names, rng.standard_normal(k).tolist(), strict=True):
            worker.log(name, value)
        out.append(worker.export())
    worker.close()
    return out


def part_c(quick: bool) -> None:
    sizes = [64, 512, 4096] if quick else [64, 512, 1024, 4096]
    k = K_SYNTHETIC
    print(f"(c) a driver's ingest() + commit() of R partials of K={k} metrics (CPU, median of 5)")
    print(f"{'R':>6} {'ingest+commit ms':>17} {'R*K dict appends ms':>20} {'ratio':>6} {'per rank x metric ns':>21}")
    for size in sizes:
        partials = _partials(size, k)
        driver = MetricBus(dist=None)
        samples, floors = [], []
        for step in range(6):
            start = time.process_time()
            driver.ingest(partials)
            driver.commit(step=step)
            if step:
                samples.append(time.process_time() - start)
            d: defaultdict[str, list[float]] = defaultdict(list)
            names = [f"m{i:03d}" for i in range(k)]
            start = time.process_time()
            for _ in range(size):
                for name in names:
                    d[name].append(0.5)
            floors.append(time.process_time() - start)
        driver.close()
        t, f = statistics.median(samples), statistics.median(floors)
        print(f"{size:>6} {t * 1e3:>17.1f} {f * 1e3:>20.1f} {t / f:>6.2f} {t / (size * k) * 1e9:>21.1f}")


# -- (d) replay of an R-rank journal --------------------------------------------------------------------------------


def part_d(quick: bool) -> None:
    sizes = [2, 64, 512] if quick else [2, 64, 512, 4096]
    k = K_SYNTHETIC
    print(f"(d) replay of a journal of R ranks x K={k} metrics (CPU)")
    print(f"{'R':>6} {'steps':>6} {'summaries':>10} {'replay s':>9} {'summaries/s':>12}")
    for size in sizes:
        steps = max(2, 20000 // size) if not quick else max(2, 4000 // size)
        partials = _partials(size, k)
        with tempfile.TemporaryDirectory() as tmp:
            driver = MetricBus(dist=None, journal=str(Path(tmp) / "j"), fsync="never")
            for step in range(steps):
                driver.ingest(partials)
                driver.commit(step=step)
            driver.close()
            start = time.process_time()
            count = sum(1 for _ in emitted(stream_journal(Path(tmp) / "j")))
            elapsed = time.process_time() - start
        summaries = steps * size * k
        assert count == steps
        print(f"{size:>6} {steps:>6} {summaries:>10} {elapsed:>9.2f} {summaries / elapsed:>12.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,b,c,d")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--ranks", default="2,4,8", help="(a): the numbers of gloo ranks")
    parser.add_argument("--reps", type=int, default=None, help="(a): steady commits per size (default 48; 16 quick)")
    args = parser.parse_args()
    for part in args.parts.split(","):
        if part.strip() == "a":
            part_a(args.quick, tuple(int(r) for r in args.ranks.split(",")), args.reps)
        else:
            {"b": part_b, "c": part_c, "d": part_d}[part.strip()](args.quick)
        print()


if __name__ == "__main__":
    main()
