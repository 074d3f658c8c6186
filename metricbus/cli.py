"""The ``metricbus`` command: replay, sync, show and inspect journals.

Errors (a missing or foreign journal, a newer format, a bad rule or adapter) print one line on stderr and exit 2;
a backend that fails while receiving steps prints one line and exits 1. Warnings (a torn record) are one line each.
Progress (replay: a bar; sync: steps sent, rate, ETA) goes to stderr only when it is a terminal. Ctrl-C stops
cleanly: sync flushes and acknowledges what it wrote, prints one ``interrupted: ...`` line and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from fnmatch import fnmatchcase
from typing import Any, TextIO

from metricbus.errors import MetricBusError
from metricbus.journal import Journal, JournalWarning, read_journal
from metricbus.replay import (
    Progress,
    SyncInterrupted,
    SyncProgress,
    emitted,
    parse_rule,
    parse_steps,
    record_counts,
    replay,
    sync,
)

EXIT_ERROR = 2  # a usage or input mistake
EXIT_FAILED = 1  # a backend failed while receiving steps
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it


class _UsageError(Exception):
    """An error reported as one line."""


class _BackendError(Exception):
    """An adapter failed while receiving replayed steps."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's usage+exit becomes our one-line error
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    top = _Parser(prog="metricbus", description="Replay, sync, show and inspect metricbus journals.")
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    rp = sub.add_parser("replay", help="replay a journal into adapters (same reduction code as live)")
    rp.add_argument("journal")
    rp.add_argument("--config", help="config file whose adapters receive the replay")
    rp.add_argument("--to", action="append", default=[], metavar="ADAPTER", help="a name or URI, e.g. jsonl:out.jsonl")
    rp.add_argument("--rule", action="append", default=[], metavar="PATTERN=SPEC", help="re-aggregate; first wins")
    rp.add_argument("--steps", help="emit only steps A:B (half-open; A: or :B); every commit is still reduced")
    sp = sub.add_parser("sync", help="send each adapter the steps it has not acknowledged")
    sp.add_argument("journal")
    sp.add_argument("--config", help="config file with the adapters (default $METRICBUS_CONFIG)")
    sh = sub.add_parser("show", help="reduced values as a table")
    sh.add_argument("journal")
    sh.add_argument("--metric", action="append", default=[], metavar="PATTERN")
    sh.add_argument("--last", type=int, metavar="N", help="only the last N emitted steps")
    ip = sub.add_parser("inspect", help="run metadata, ranks, steps, metrics and specs")
    ip.add_argument("journal")
    return top


def _adapters(config: str | None, to: Sequence[str]) -> list[Any]:
    from metricbus.config import bus_options
    from metricbus.registry import make_adapter

    out: list[Any] = []
    if config is not None or not to:
        out.extend(bus_options(config).get("adapters", []))
    out.extend(make_adapter(spec) for spec in to)
    if not out:
        raise _UsageError("no adapters: give --to ADAPTER or a --config with adapters")
    return out


def _progress(stream: TextIO) -> Progress | None:
    if not stream.isatty():
        return None

    def show(done: int, total: int) -> None:
        if done == total or done % 256 == 0:
            width = 30
            filled = width * done // max(total, 1)
            stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} commits")
            if done == total:
                stream.write("\n")
            stream.flush()

    return show


def _sync_progress(stream: TextIO, *, every_s: float = 0.2) -> SyncProgress | None:
    """``sync: N steps sent  R steps/s  C/T commits  ETA S s`` on one redrawn line; None off a terminal."""
    if not stream.isatty():
        return None
    start = time.monotonic()
    shown = [-every_s]

    def show(done: int, total: int, sent: int) -> None:
        now = time.monotonic() - start
        if done < total and now - shown[0] < every_s:
            return
        shown[0] = now
        rate = sent / now if now > 0 else 0.0
        eta = f"{(total - done) * now / done:.0f} s" if done > 0 else "?"
        stream.write(f"\rsync: {sent:,} steps sent  {rate:,.0f} steps/s  {done:,}/{total:,} commits  ETA {eta}\x1b[K")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return show


@contextlib.contextmanager
def _first_sigint_sets(stop: threading.Event) -> Iterator[None]:
    """While inside: a first Ctrl-C sets ``stop`` (sync ends after the current step), a second one interrupts."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: KeyboardInterrupt cannot arrive here anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(sent: dict[str, int]) -> str:
    parts = [f"{count} steps to {label}" for label, count in sent.items()]
    return f"interrupted: sent {', '.join(parts) or 'nothing'}; run sync again to resume"


def _fmt(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.6g}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def _show(journal: Journal, patterns: Sequence[str], last: int | None, out: TextIO) -> None:
    points = list(emitted(journal))
    if last is not None:
        points = points[-last:] if last > 0 else []
    names = sorted({n for _, m in points for n in m if not patterns or any(fnmatchcase(n, p) for p in patterns)})
    if not names:
        out.write("no values\n")
        return
    rows = [["step", *names]]
    rows += [[str(step), *(_fmt(m[n]) if n in m else "-" for n in names)] for step, m in points]
    out.write(_table(rows) + "\n")


def _inspect(journal: Journal, out: TextIO) -> None:
    run = journal.run
    summaries, records = record_counts(journal)
    steps = [s for s, _ in journal.commits]
    h = journal.header
    lines = [
        f"journal     {journal.directory}",
        f"format      {h.get('format')} (metricbus {h.get('metricbus')})",
        f"run         project={run.project} name={run.name} tags={','.join(run.tags) or '-'}",
        f"files       {len(journal.files)}",
        f"ranks       {len(journal.ranks)} ({', '.join(map(str, journal.ranks)) or '-'})",
        f"commits     {len(steps)}" + (f" (steps {steps[0]}..{steps[-1]})" if steps else ""),
        f"log_every   {journal.log_every}",
        f"summaries   {summaries} ({records} records)",
    ]
    damaged = sum(f.damaged for f in journal.files)
    if damaged:
        lines.append(f"damaged     {damaged} records skipped")
    for gap in journal.gaps:
        steps_text = str(gap.first_step) if gap.first_step == gap.last_step else f"{gap.first_step}..{gap.last_step}"
        lines.append(f"gap         rank {gap.rank}: step {steps_text} not journaled (a write failed)")
    for path, why in journal.skipped:
        lines.append(f"skipped     {path.name}: {why}")
    if journal.rules:
        lines.append("rules")
        lines += [f"  {pattern} = {spec}" for pattern, spec in journal.rules]
    metrics = journal.metrics()
    lines.append(f"metrics     {len(metrics)}")
    out.write("\n".join(lines) + "\n")
    if metrics:
        out.write(_table([["  name", "spec"], *[[f"  {n}", str(s)] for n, s in metrics.items()]]) + "\n")


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.command == "replay":
        rules = [parse_rule(r) for r in args.rule]
        steps = parse_steps(args.steps) if args.steps else None
        journal = read_journal(args.journal)
        adapters = _adapters(args.config, args.to)
        try:
            replay(journal, adapters, rules=rules, steps=steps, progress=_progress(err))
        except Exception as exc:
            raise _BackendError(f"{type(exc).__name__}: {exc}") from exc
    elif args.command == "sync":
        journal = read_journal(args.journal)
        adapters = _adapters(args.config, ())
        progress = _sync_progress(err)
        stop = threading.Event()
        try:
            with _first_sigint_sets(stop):
                sent = sync(journal, adapters, progress=progress, stop=stop)
        except SyncInterrupted as stop:
            err.write(("\n" if progress is not None else "") + _interrupted(stop.sent) + "\n")
            return EXIT_INTERRUPTED
        except KeyboardInterrupt:  # a second Ctrl-C while closing the adapters
            err.write("interrupted; run sync again to resume\n")
            return EXIT_INTERRUPTED
        except Exception as exc:
            raise _BackendError(f"{type(exc).__name__}: {exc} (cursors keep the acknowledged steps)") from exc
        for label, count in sent.items():
            out.write(f"{label}: sent {count} steps\n")
    elif args.command == "show":
        _show(read_journal(args.journal), args.metric, args.last, out)
    else:
        _inspect(read_journal(args.journal), out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``metricbus``; returns the exit code."""
    import warnings

    out, err = sys.stdout, sys.stderr

    def warn_line(message: Any, category: Any, *_: Any, **__: Any) -> None:
        err.write(f"metricbus: warning: {message}\n")

    try:
        args = _parser().parse_args(argv)
        with warnings.catch_warnings():
            warnings.simplefilter("always", JournalWarning)
            warnings.showwarning = warn_line
            return _run(args, out, err)
    except (_UsageError, MetricBusError, OSError) as exc:
        err.write(f"metricbus: error: {exc}\n")
        return EXIT_ERROR
    except _BackendError as exc:
        err.write(f"metricbus: error: a backend failed: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:  # outside sync's loop (reading the journal, a second Ctrl-C): nothing half-done
        err.write("metricbus: interrupted\n")
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_ERROR
