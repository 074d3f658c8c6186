"""Journal cost on the training loop, and replay throughput.

    .venv/bin/python benchmarks/bench_journal.py [--metrics 50] [--records 8] [--commits 20000]

1. The log/commit loop (``--metrics`` metrics x ``--records`` records per commit, one worker) with and without
   ``journal=`` (fsync="interval", the default); the ratio is the journal's cost (target <= 1.1x), and the
   microseconds it adds per commit. Next to it, in the same run, the journal without its stage (each commit written
   with its own ``os.write``, as before metricbus/journal/stage.py), and a floor for such a journal: the journal's
   steady commit replaced by the least a journal that writes each commit and keeps "a commit that returned survives
   SIGKILL" does from Python, one ``os.write`` of the update's fields as they are (``tobytes``, a CRC-32 and a frame
   head; no checks, no compaction, no bookkeeping; the file it writes is not a valid journal). The default 20,000
   commits take ~2 s a loop, so the interval fsync (once a second, on the journal's own thread) runs inside each
   journaled loop; a loop shorter than a second would leave it out.
   Each repeat runs the four loops in turn, each kind first in turn: besides the best of each, the median of the
   repeats' journaled/plain ratios ("paired"), which a burst of load on the machine moves less. Then
   ("alternating") a bus without journal and one with it, both open in one process, take turns, ``--chunk``
   commits each, ``--rounds`` times: the median of the rounds' ratios with a 90% bootstrap interval. Bursts of load
   on this machine last seconds and move a whole ~3 s loop by 5-10%; here they move a few rounds of 80, so this is
   the figure that says where the ratio is, and its interval how sure that is.
2. Replay of that journal into a MemoryAdapter: micro-level summaries per second, and the records they summarise
   per second (each summary's ``count``; target >= 500,000 records/s). Reading the files is included.

``--split`` instead says where the journal's cost goes, each part switched off inside the same loop (interleaved):
the journal as it is; its ``os.write`` a no-op (what is left: building the frames and the bookkeeping); a steady
commit's frame not built or written at all (``JournalWriter.append_columns`` accepting it at once: what is left is
the bus's own journaling glue); and the journal with zlib's CRC-32 instead of ISA-L's (what a bus without the extra
``metricbus[fast]`` pays). Only for measuring: the journal files the middle two write are not valid.

``--instructions`` instead counts the user-space instructions of a commit with and without the journal under
valgrind's callgrind (the same figure whatever else runs on the machine; the kernel's side of the ``write`` is not
counted), so the journal's own Python can be told from the kernel's append and what it costs the code around it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from metricbus import MetricBus
from metricbus.journal import JournalWriter, checksum, compact, format, read_journal, stage, writer
from metricbus.replay import record_counts, replay
from metricbus.testing import MemoryAdapter


def _workload(*, metrics: int, records: int) -> tuple[list[str], list[float]]:
    """The loop's metric names and the values logged under each of them every step."""
    rng = random.Random(0)
    return [f"group{i % 5}/metric{i}" for i in range(metrics)], [rng.random() for _ in range(records)]


def _timed(
    bus: MetricBus, *, names: list[str], data: list[float], commits: int, extra: Callable[[int], object] | None = None
) -> float:
    """Seconds for ``commits`` steps on ``bus`` of logging ``data`` under each of ``names`` and committing
    (``extra(step)`` after each commit, where given)."""
    log, commit = bus.log, bus.commit
    start = time.perf_counter()
    for step in range(commits):
        for name in names:
            for value in data:
                log(name, value)
        commit()
        if extra is not None:
            extra(step)
    return time.perf_counter() - start


def loop(
    *, metrics: int, records: int, commits: int, journal: str | None, extra: Callable[[int], object] | None = None
) -> float:
    """Seconds for ``commits`` steps of logging and committing (``extra(step)`` after each commit, where given:
    ``probe_journal_write.py``'s pieces)."""
    names, data = _workload(metrics=metrics, records=records)
    bus = MetricBus(dist=None, journal=journal)
    elapsed = _timed(bus, names=names, data=data, commits=commits, extra=extra)
    bus.close()
    return elapsed


def alternating(*, metrics: int, records: int, chunk: int, rounds: int, journal: str) -> list[tuple[float, float]]:
    """Per round, the seconds of ``chunk`` commits of a bus without journal and of one with ``journal``, both open
    the whole time in this process, taking turns (each first in every other round): a burst of load on the machine
    falls on both of a round's chunks, or on one round of many."""
    names, data = _workload(metrics=metrics, records=records)
    buses = (MetricBus(dist=None, journal=None), MetricBus(dist=None, journal=journal))
    out = []
    try:
        for i in range(rounds):
            spent = [0.0, 0.0]
            for which in (0, 1) if i % 2 == 0 else (1, 0):
                spent[which] = _timed(buses[which], names=names, data=data, commits=chunk)
            out.append((spent[0], spent[1]))
    finally:
        for bus in buses:
            bus.close()
    return out


def _interval(ratios: list[float]) -> tuple[float, float]:
    """A 90% bootstrap interval of the median of ``ratios`` (seeded: the same figures give the same interval)."""
    rng = random.Random(1)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(1000))
    return medians[50], medians[949]


@contextlib.contextmanager
def _unstaged() -> Iterator[None]:
    """Inside: journals opened write each commit with its own ``os.write`` (no stage)."""
    saved = stage.STAGED
    stage.STAGED = False
    try:
        yield
    finally:
        stage.STAGED = saved


class _NoWrite:
    """The ``os`` module as :mod:`metricbus.journal.writer` sees it, with ``write`` a no-op."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    @staticmethod
    def write(fd: int, data: bytes) -> int:
        return len(data)


@contextlib.contextmanager
def _switched_off(part: str) -> Iterator[None]:
    """Inside: the journal's ``part`` ("write", "frame" or "crc": ISA-L's CRC; "": none) switched off, or its steady
    commit replaced by the "floor" (see the module docstring)."""
    saved_os, saved_append = vars(writer)["os"], JournalWriter.append_columns
    saved_crc = compact._crc32, format._crc32, format.crc32
    if part == "floor":
        def floor(self: JournalWriter, *, step: int, rank: int, layout: bytes, fields: Any) -> bool:
            held = self._compact
            if held is None or held.layout != layout or held.rank != rank or self._fd is None:
                return False
            raw = fields.tobytes()
            os.write(self._fd, format.FRAME.pack(len(raw), checksum.crc32(raw)) + raw)
            return True

        setattr(JournalWriter, "append_columns", floor)  # noqa: B010
    elif part == "crc":
        compact._crc32 = format._crc32 = format.crc32 = zlib.crc32
    elif part == "write":
        setattr(writer, "os", _NoWrite())  # noqa: B010 (the module's own name for os)
    elif part == "frame":
        def accepted(self: JournalWriter, *, step: int, rank: int, layout: bytes, fields: object) -> bool:
            compact = self._compact
            return compact is not None and compact.layout == layout and compact.rank == rank

        setattr(JournalWriter, "append_columns", accepted)  # noqa: B010
    try:
        yield
    finally:
        setattr(writer, "os", saved_os)  # noqa: B010
        setattr(JournalWriter, "append_columns", saved_append)  # noqa: B010
        compact._crc32, format._crc32, format.crc32 = saved_crc


def instructions(*, shape: dict[str, int]) -> None:
    """Print ``--instructions``: the user-space instructions of a commit with and without the journal, counted by
    valgrind's callgrind (the same count whatever else the machine runs; the kernel's part of a write is not
    counted): the difference between runs of ``commits`` and 3 * ``commits`` commits, so start-up cancels out."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind on PATH")
    small = max(1, shape["commits"])

    def count(kind: str, commits: int) -> int:
        argv = [sys.executable, __file__, "--one", kind, "--metrics", str(shape["metrics"]), "--records",
                str(shape["records"]), "--commits", str(commits)]
        done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv],
                              capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        found = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
        if found is None:
            raise SystemExit(f"callgrind printed no count: {done.stderr[-500:]}")
        return int(found.group(1))

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        counted = {(kind, n): pool.submit(count, kind, n) for kind in ("plain", "journal") for n in (small, 3 * small)}
        per = {kind: (counted[kind, 3 * small].result() - counted[kind, small].result()) / (2 * small)
               for kind in ("plain", "journal")}
    print(f"user-space instructions per commit (callgrind; {shape['metrics']} metrics x {shape['records']} records, "
          f"{small} and {3 * small} commits a run):")
    print(f"  without journal  {per['plain']:12,.0f}")
    print(f"  with journal     {per['journal']:12,.0f}  adds {per['journal'] - per['plain']:,.0f} "
          f"({per['journal'] / per['plain']:.4f}x)")


def split(*, shape: dict[str, int], repeats: int) -> None:
    """Print ``--split``'s table: what the journal adds per commit with each part switched off."""
    parts = {"as it is": "", "os.write a no-op": "write", "no frame built": "frame", "zlib's crc32": "crc"}
    times: dict[str, list[float]] = {label: [] for label in ("without journal", *parts)}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):  # interleaved, best of
            times["without journal"].append(loop(**shape, journal=None))
            for label, part in parts.items():
                with _switched_off(part):
                    times[label].append(loop(**shape, journal=str(Path(tmp) / f"{part or 'all'}{i}")))
    base = min(times["without journal"])
    commits = shape["commits"]
    print(f"where the journal's cost goes: {shape['metrics']} metrics x {shape['records']} records per commit, "
          f"{commits} commits, best of {repeats} interleaved; crc32: {checksum.IMPLEMENTATION}")
    print(f"  without journal   {base * 1e6 / commits:9.1f} us/commit")
    for label in parts:
        best = min(times[label])
        print(f"  {label:17s} {best * 1e6 / commits:9.1f} us/commit  adds {(best - base) * 1e6 / commits:5.1f} us  "
              f"({best / base:.3f}x)")


def main() -> None:
    """Run both measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--metrics", type=int, default=50)
    parser.add_argument("--records", type=int, default=8)
    parser.add_argument("--commits", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=250, help="commits a bus a round, alternating (see above)")
    parser.add_argument("--rounds", type=int, default=80, help="rounds, alternating (see above)")
    parser.add_argument("--split", action="store_true", help="where the journal's cost goes (see above)")
    parser.add_argument("--instructions", action="store_true", help="instructions per commit (see above)")
    parser.add_argument("--one", choices=("plain", "journal"), help=argparse.SUPPRESS)  # one loop (--instructions)
    args = parser.parse_args()
    shape = {"metrics": args.metrics, "records": args.records, "commits": args.commits}
    if args.one is not None:
        with tempfile.TemporaryDirectory() as tmp:
            loop(**shape, journal=str(Path(tmp) / "j") if args.one == "journal" else None)
        return
    if args.instructions:
        instructions(shape={**shape, "commits": min(args.commits, 500)})
        return
    if args.split:
        split(shape=shape, repeats=args.repeats)
        return
    with tempfile.TemporaryDirectory() as tmp:
        plain, journaled, unstaged, floors = [], [], [], []
        kinds = ("plain", "journal", "unstaged", "floor")
        for i in range(args.repeats):  # interleaved, each kind first in turn
            for kind in kinds[i % 4 :] + kinds[: i % 4]:
                if kind == "plain":
                    plain.append(loop(**shape, journal=None))
                elif kind == "journal":
                    journaled.append(loop(**shape, journal=str(Path(tmp) / f"j{i}")))
                elif kind == "unstaged":
                    with _unstaged():
                        unstaged.append(loop(**shape, journal=str(Path(tmp) / f"unstaged{i}")))
                else:
                    with _switched_off("floor"):
                        floors.append(loop(**shape, journal=str(Path(tmp) / f"floor{i}")))
        base, with_journal, floor = min(plain), min(journaled), min(floors)
        per_commit = args.metrics * args.records
        print(f"log/commit loop: {args.metrics} metrics x {args.records} records per commit, {args.commits} commits; "
              f"crc32: {checksum.IMPLEMENTATION}")
        print(f"  without journal  {base * 1e6 / args.commits:9.1f} us/commit  "
              f"(median {statistics.median(plain):.3f} s)")
        print(f"  with journal     {with_journal * 1e6 / args.commits:9.1f} us/commit  "
              f"(median {statistics.median(journaled):.3f} s)")
        print(f"  ratio            {with_journal / base:9.3f}x  (target <= 1.1x; {per_commit} records per commit)")
        pairs = sorted(j / p for p, j in zip(plain, journaled, strict=True))
        print(f"  paired ratio     {statistics.median(pairs):9.3f}x  (the median of each repeat's journaled loop over "
              f"its plain one; {pairs[0]:.3f}x to {pairs[-1]:.3f}x)")
        print(f"  journal adds     {(with_journal - base) * 1e6 / args.commits:9.1f} us/commit  "
              f"(medians: {(statistics.median(journaled) - statistics.median(plain)) * 1e6 / args.commits:.1f})")
        apart = statistics.median(u / p for p, u in zip(plain, unstaged, strict=True))
        print(f"  no stage         {min(unstaged) * 1e6 / args.commits:9.1f} us/commit  ({min(unstaged) / base:.3f}x, "
              f"paired {apart:.3f}x; each commit its own os.write)")
        print(f"  floor adds       {(floor - base) * 1e6 / args.commits:9.1f} us/commit  ({floor / base:.3f}x; one "
              f"os.write of the raw fields per commit; medians: "
              f"{(statistics.median(floors) - statistics.median(plain)) * 1e6 / args.commits:.1f})")
        rounds = alternating(metrics=args.metrics, records=args.records, chunk=args.chunk, rounds=args.rounds,
                             journal=str(Path(tmp) / "alternating"))
        ratios = [j / p for p, j in rounds]
        low, high = _interval(ratios)
        plain_s, journal_s = sum(p for p, _ in rounds), sum(j for _, j in rounds)
        commits = args.chunk * args.rounds
        print(f"  alternating      {statistics.median(ratios):9.3f}x  (90% interval {low:.3f}x to {high:.3f}x: the "
              f"median of {args.rounds} rounds' ratios, {args.chunk} commits a bus a round, both buses open the whole "
              f"time; {plain_s * 1e6 / commits:.1f} against {journal_s * 1e6 / commits:.1f} us/commit in all)")
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
