"""Journal cost on the training loop, and replay throughput.

    .venv/bin/python benchmarks/bench_journal.py [--metrics 50] [--records 8] [--commits 2000]

1. The log/commit loop (``--metrics`` metrics x ``--records`` records per commit, one worker) with and without
   ``journal=`` (fsync="interval", the default); the ratio is the journal's cost (target <= 1.1x), and the
   microseconds it adds per commit.
2. Replay of that journal into a MemoryAdapter: micro-level summaries per second, and the records they summarise
   per second (each summary's ``count``; target >= 500,000 records/s). Reading the files is included.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from metricbus import MetricBus
from metricbus.journal import read_journal
from metricbus.replay import record_counts, replay
from metricbus.testing import MemoryAdapter


def loop(*, metrics: int, records: int, commits: int, journal: str | None) -> float:
    """Seconds for ``commits`` steps of logging and committing."""
    names = [f"group{i % 5}/metric{i}" for i in range(metrics)]
    rng = random.Random(0)
    data = [rng.random() for _ in range(records)]
    bus = MetricBus(dist=None, journal=journal)
    log, commit = bus.log, bus.commit
    start = time.perf_counter()
    for _ in range(commits):
        for name in names:
            for value in data:
                log(name, value)
        commit()
    elapsed = time.perf_counter() - start
    bus.close()
    return elapsed


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--metrics", type=int, default=50)
    parser.add_argument("--records", type=int, default=8)
    parser.add_argument("--commits", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shape = {"metrics": args.metrics, "records": args.records, "commits": args.commits}
    with tempfile.TemporaryDirectory() as tmp:
        plain, journaled = [], []
        for i in range(args.repeats):  # interleaved, best of: the least disturbed run of each
            plain.append(loop(**shape, journal=None))
            journaled.append(loop(**shape, journal=str(Path(tmp) / f"j{i}")))
        base, with_journal = min(plain), min(journaled)
        per_commit = args.metrics * args.records
        print(f"log/commit loop: {args.metrics} metrics x {args.records} records per commit, {args.commits} commits")
        print(f"  without journal  {base * 1e6 / args.commits:9.1f} us/commit  "
              f"(median {statistics.median(plain):.3f} s)")
        print(f"  with journal     {with_journal * 1e6 / args.commits:9.1f} us/commit  "
              f"(median {statistics.median(journaled):.3f} s)")
        print(f"  ratio            {with_journal / base:9.3f}x  (target <= 1.1x; {per_commit} records per commit)")
        print(f"  journal adds     {(with_journal - base) * 1e6 / args.commits:9.1f} us/commit  "
              f"(medians: {(statistics.median(journaled) - statistics.median(plain)) * 1e6 / args.commits:.1f})")
        path = Path(tmp) / "j0"
        size = sum(p.stat().st_size for p in path.glob("*.mbj"))
        times = []
        for _ in range(args.repeats):
            mem = MemoryAdapter()
            start = time.perf_counter()
            replay(path, [mem])
            times.append(time.perf_counter() - start)
        best = min(times)
        summaries, records = record_counts(read_journal(path))
        print(f"replay into MemoryAdapter: {summaries} summaries ({records} records), journal {size / 1e6:.2f} MB "
              f"({size / args.commits / 1e3:.2f} KB per commit)")
        print(f"  {best:.3f} s  ->  {summaries / best:,.0f} summaries/s, {records / best:,.0f} records/s "
              "(target >= 500,000 records/s)")


if __name__ == "__main__":
    main()
