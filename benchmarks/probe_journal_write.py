"""Where the journal's cost on the training loop comes from: the loop of ``bench_journal.py`` (no journal), next to
the same loop with one extra piece of the journal's work after each commit, each measured in one run, interleaved.

    .venv/bin/python benchmarks/probe_journal_write.py [--commits 4000] [--repeats 15]

The pieces, each on a commit of 50 metrics (a "P" frame of ~2.9 KB, built by the journal's own
:class:`~metricbus.journal.compact.CompactFrame` from fields shaped as a steady commit's):

- ``frame``: the frame built, nothing written.
- ``frame + os.write``: built and appended with its own ``os.write`` (what the journal does).
- ``frame + mapped ring``: built and copied into a 1 MiB shared file mapping whose pages are reused (no system call
  per commit), with one ``os.write`` of the copied bytes per half MiB (~180 commits). A journal built that way would
  still survive SIGKILL (the mapping's pages are the kernel's), but readers and the next writer would have to read
  the mapping's file too.

The ratios are each loop over the plain one of the same repeat (the median of the repeats), so a burst of load on
the machine moves them less than the best times.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import bench_journal  # (beside this script: python puts its folder first on the path)
import numpy as np

from metricbus.journal.compact import CompactFrame
from metricbus.summary import N_FIELDS

METRICS, RECORDS = 50, 8
RING_BYTES = 1 << 20


def loop(*, commits: int, extra: Callable[[int], None]) -> float:
    """Microseconds per commit of ``bench_journal``'s loop (no journal), ``extra(step)`` after each commit."""
    seconds = bench_journal.loop(metrics=METRICS, records=RECORDS, commits=commits, journal=None, extra=extra)
    return seconds * 1e6 / commits


class _Ring:
    """A reused shared mapping of a file, written out in batches (see the module docstring)."""

    def __init__(self, directory: Path, build: Callable[[int], bytes]) -> None:
        self._build = build
        self._ring_fd = os.open(directory / "ring", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.posix_fallocate(self._ring_fd, 0, RING_BYTES)
        self._map = mmap.mmap(self._ring_fd, RING_BYTES)
        self._map[:] = bytes(RING_BYTES)  # every page touched once
        self._out = os.open(directory / "journal", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        self._used = 0

    def put(self, step: int) -> None:
        data = self._build(step)
        if self._used + len(data) > RING_BYTES // 2:
            os.write(self._out, self._map[: self._used])
            self._used = 0
        self._map[self._used : self._used + len(data)] = data
        self._used += len(data)

    def close(self) -> None:
        self._map.close()
        os.close(self._ring_fd)
        os.close(self._out)


def _writer(fd: int, build: Callable[[int], bytes]) -> Callable[[int], None]:
    """Append each commit's frame to ``fd`` with its own ``os.write``."""

    def write(step: int) -> None:
        os.write(fd, build(step))

    return write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commits", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    fields = rng.random((N_FIELDS, METRICS))
    fields[0] = fields[1] = RECORDS  # count, weight
    fields[2] = 0.0  # weight_lo
    fields[5], fields[6] = fields[3], fields[4]  # total = wsum (unit weights)
    framer = CompactFrame(layout=b"probe", rank=0, ids=np.arange(METRICS, dtype=np.uint32))

    def build(step: int) -> bytes:
        data = framer.frame(step, fields)
        assert data is not None
        return data

    kinds = ["plain", "frame", "frame + os.write", "frame + mapped ring"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:  # each in each position in turn
                directory = Path(tmp) / f"{kind.replace(' ', '')}{i}"
                directory.mkdir()
                if kind == "plain":
                    times[kind].append(loop(commits=args.commits, extra=lambda step: None))
                elif kind == "frame":
                    times[kind].append(loop(commits=args.commits, extra=build))
                elif kind == "frame + os.write":
                    fd = os.open(directory / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                    times[kind].append(loop(commits=args.commits, extra=_writer(fd, build)))
                    os.close(fd)
                else:
                    ring = _Ring(directory, build)
                    times[kind].append(loop(commits=args.commits, extra=ring.put))
                    ring.close()
    plain = times["plain"]
    print(f"bench_journal's loop ({METRICS} metrics x {RECORDS} records, {args.commits} commits), "
          f"{args.repeats} repeats interleaved; a 'P' frame of {len(build(0))} bytes")
    for kind in kinds:
        ratio = statistics.median(t / p for t, p in zip(times[kind], plain, strict=True))
        print(f"  {kind:20s} best {min(times[kind]):7.1f} us/commit  median {statistics.median(times[kind]):7.1f}  "
              f"paired ratio {ratio:.3f}x")


if __name__ == "__main__":
    main()
