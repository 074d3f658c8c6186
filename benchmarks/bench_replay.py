"""Peak memory of replay, show, inspect and sync on a long journal: it must not grow with the journal's length.

Builds (once, cached under ``--dir``) two journals with the format's own frame helpers: a large one (``--gb``,
default 1 GB) and a small one (``--small-mb``, default 100 MB), each two rank files of two ranks x ``--metrics``
metrics per commit, with name-table checkpoints every MiB as the writer puts them. Each command then runs in its own
subprocess (so each has its own peak RSS, ``resource.getrusage(RUSAGE_SELF).ru_maxrss``), through the same entry
points as ``python -m metricbus``: ``replay`` to an adapter that keeps nothing, ``show --last 5``, ``show`` (the
whole table, into /dev/null), ``inspect``, and ``sync`` to a jsonl file. ``read_journal`` (everything in memory)
is measured on the small journal for comparison. Prints figures and ratios; asserts nothing timed.

    python benchmarks/bench_replay.py [--dir /tmp/metricbus-bench-replay] [--gb 1] [--small-mb 100]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOG_EVERY = 10
RANKS_PER_FILE = 2
FILES = 2


def _frame(kind: bytes, body: bytes) -> bytes:
    payload = kind + body
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def build(directory: Path, size: int, metrics: int) -> int:
    """Write a journal of about ``size`` bytes into ``directory`` (kept if it exists); returns its commits."""
    from metricbus.adapter import RunInfo
    from metricbus.journal.format import CHECKPOINT_BYTES, MAGIC, make_header, names_frame, rank_file, spec_to_json
    from metricbus.spec import parse_spec
    from metricbus.summary import Summary

    done = directory / "built.json"
    if done.exists():
        return int(json.loads(done.read_text())["commits"])
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    spec = parse_spec("mean", metric="m")
    table = [[i, f"train/metric_{i}", spec_to_json(spec)] for i in range(metrics)]
    summaries = [Summary.of_batch([float(v), v * 0.5 + 1.0, -v / 3.0], None).as_tuple() for v in range(7)]
    entries = metrics * RANKS_PER_FILE
    commit_size = 8 + 1 + 12 + entries * 104
    commits = max(1, size // FILES // commit_size)
    run = RunInfo(project="bench", name="replay", id="bench-replay")
    for f in range(FILES):
        header = json.dumps(make_header(rank=f, run=run, rules=[], log_every=LOG_EVERY)).encode()
        table_frame = names_frame(table)
        ranks = [f * RANKS_PER_FILE + r for r in range(RANKS_PER_FILE)]
        rows = [struct.pack("<II12d", r, i, *summaries[(r + i) % 7]) for r in ranks for i in range(metrics)]
        body = b"".join(rows)
        with rank_file(directory, f).open("wb") as out:
            out.write(MAGIC + _frame(b"H", header) * 2 + table_frame * 2)
            unchecked = 0
            for step in range(commits):
                data = _frame(b"S", struct.pack("<qI", step, entries) + body)
                if unchecked >= CHECKPOINT_BYTES:
                    data, unchecked = table_frame + data, 0
                out.write(data)
                unchecked += len(data)
    done.write_text(json.dumps({"commits": commits}))
    return commits


# -- what each subprocess runs ------------------------------------------------------------------------------------


class _Discard:
    name = "discard"

    def open(self, *, run: object) -> None: ...
    def write(self, *, step: int, metrics: object) -> None: ...
    def flush(self) -> None: ...
    def close(self, *, status: str) -> None: ...


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(kind: str, journal: Path, scratch: Path) -> None:
    """Run one command on ``journal`` and print ``{"before": MB, "peak": MB, "seconds": s}`` as JSON."""
    import contextlib
    import warnings

    import numpy  # noqa: F401  (imported before the baseline, as every command imports it)

    from metricbus.cli import main
    from metricbus.journal import read_journal
    from metricbus.replay import replay

    before = _rss_mb()
    start = time.perf_counter()
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "replay":
            replay(journal, [_Discard()])
        elif kind == "read_journal":
            read_journal(journal)
        elif kind == "sync":
            shutil.rmtree(journal / "cursors", ignore_errors=True)
            config = scratch / "sync.json"
            config.write_text(json.dumps({"adapters": [f"jsonl:{scratch / 'sync.jsonl'}"]}))
            code = main(["sync", str(journal), "--config", str(config)])
            shutil.rmtree(journal / "cursors", ignore_errors=True)
            (scratch / "sync.jsonl").unlink(missing_ok=True)
        else:
            command, *options = kind.split()
            code = main([command, str(journal), *options])
        if kind in {"sync", "inspect"} or kind.startswith("show"):
            assert code == 0, code
    print(json.dumps({"before": before, "peak": _rss_mb(), "seconds": time.perf_counter() - start}))


def measure(kind: str, journal: Path, scratch: Path) -> dict[str, float]:
    env = {**os.environ, "METRICBUS_ADAPTERS": ""}
    done = subprocess.run([sys.executable, __file__, "--child", kind, "--journal", str(journal), "--dir",
                           str(scratch)], capture_output=True, text=True, check=False, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def size_of(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("rank-*.mbj"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/metricbus-bench-replay", help="where the journals are cached")
    parser.add_argument("--gb", type=float, default=1.0, help="size of the large journal (GB)")
    parser.add_argument("--small-mb", type=float, default=100.0, help="size of the small journal (MB)")
    parser.add_argument("--metrics", type=int, default=64, help="metrics per rank and commit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--journal", help=argparse.SUPPRESS)
    args = parser.parse_args()
    scratch = Path(args.dir)
    if args.child:
        child(args.child, Path(args.journal), scratch)
        return
    journals = {
        "small": (scratch / f"small-{args.small_mb:g}mb-{args.metrics}", int(args.small_mb * 1e6)),
        "large": (scratch / f"large-{args.gb:g}gb-{args.metrics}", int(args.gb * 1e9)),
    }
    commits = {}
    for label, (path, size) in journals.items():
        start = time.perf_counter()
        commits[label] = build(path, size, args.metrics)
        print(f"{label} journal: {path} {size_of(path) / 1e6:,.0f} MB, {commits[label]:,} commits x {FILES} files "
              f"x {RANKS_PER_FILE * args.metrics} entries (ready in {time.perf_counter() - start:.1f} s)")
    kinds = ["replay", "show --last 5", "show", "inspect", "sync"]
    peaks: dict[tuple[str, str], float] = {}
    print(f"\n{'command':<16}{'journal':>8}{'MB':>8}{'RSS before':>12}{'peak RSS':>10}{'seconds':>9}"
          f"{'summaries/s':>13}")
    for label, (path, _) in journals.items():
        entries = commits[label] * FILES * RANKS_PER_FILE * args.metrics
        for kind in [*kinds, *(["read_journal"] if label == "small" else [])]:
            got = measure(kind, path, scratch)
            peaks[kind, label] = got["peak"]
            rate = f"{entries / got['seconds']:,.0f}" if kind == "replay" else ""
            print(f"{kind:<16}{label:>8}{size_of(path) / 1e6:>8,.0f}{got['before']:>10.0f} M{got['peak']:>8.0f} M"
                  f"{got['seconds']:>9.1f}{rate:>13}")
    ratio = size_of(journals["large"][0]) / size_of(journals["small"][0])
    print(f"\nthe large journal is {ratio:.1f}x the small one; peak RSS large / small:")
    for kind in kinds:
        print(f"  {kind:<16}{peaks[kind, 'large'] / peaks[kind, 'small']:.2f}x")
    print(f"read_journal (everything in memory) on the small journal: {peaks['read_journal', 'small']:.0f} MB peak, "
          f"{peaks['read_journal', 'small'] / peaks['replay', 'small']:.1f}x replay's")


if __name__ == "__main__":
    main()
