"""The ``metricbus`` command: replay, sync, show and inspect journals.

Each command ends with a one-line summary on stdout (``show``: the table itself). Errors (a missing or foreign
journal, a newer format, a bad rule or adapter, a selection that matches nothing, a config that still holds a
``{placeholder}``) print one line on stderr, saying what exists or is valid, and exit 2 before anything is created;
a backend that fails while receiving steps prints one line and exits 1. Warnings (a torn record) are one line each.
Progress (replay: a bar; sync: steps sent, rate, ETA) goes to stderr only when it is a terminal. Ctrl-C stops
cleanly: sync flushes and acknowledges what it wrote, prints one ``interrupted: ...`` line and exits 130. A reader
that stops early (``metricbus show J | head``) is not an error: no message, exit 0.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from metricbus._version import __version__
from metricbus.cli_progress import first_sigint_sets as _first_sigint_sets
from metricbus.cli_progress import interrupted as _interrupted
from metricbus.cli_progress import replay_progress as _progress
from metricbus.cli_progress import sync_progress as _sync_progress
from metricbus.cli_views import UsageError as _UsageError
from metricbus.cli_views import inspect as _inspect
from metricbus.cli_views import show as _show
from metricbus.cli_views import span as _span
from metricbus.errors import ConfigError, JournalError, MetricBusError, SpecError
from metricbus.journal import JournalWarning, stream_journal
from metricbus.journal.cursors import identity_of
from metricbus.replay import (
    SyncInterrupted,
    parse_rule,
    parse_steps,
    replay,
    sync,
)

EXIT_ERROR = 2  # a usage or input mistake
EXIT_FAILED = 1  # a backend failed while receiving steps
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it


class _BackendError(Exception):
    """An adapter failed while receiving replayed steps."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's usage+exit becomes our one-line error
        raise _UsageError(message)


_TOP_EPILOG = """\
examples:
  metricbus inspect runs/ppo/journal
  metricbus show runs/ppo/journal --metric 'actor/*' --last 5
  metricbus replay runs/ppo/journal --to jsonl --rule 'actor/*=micro:sum,rank:mean'
  metricbus sync runs/ppo/journal --config my.yaml

'metricbus COMMAND --help' describes a command. Exit codes: 0 done, 2 a usage or input error,
1 a backend failed, 130 interrupted.
"""

_REPLAY_EPILOG = """\
rules (--rule PATTERN=SPEC; repeatable, the first matching rule wins):
  PATTERN  a metric name or an fnmatch pattern: 'loss', 'actor/*'
  SPEC     one kind                    sum
           several kinds               mean,max              (emits NAME/mean and NAME/max)
           a kind per level            micro:sum,rank:mean   (levels: {levels})
  kinds:   {kinds}
  example: --rule 'actor/*=micro:sum,rank:mean'

adapters (--to ADAPTER; repeatable):
  NAME or NAME:VALUE, e.g. jsonl:out.jsonl, tensorboard:runs/x, mlflow:sqlite:///m.db, console
  jsonl alone writes runs/<project>/<run id>/metrics.jsonl

steps (--steps): A:B (half-open, like a slice), A:, :B, or one step A

examples:
  metricbus replay runs/ppo/journal --to jsonl
  metricbus replay runs/ppo/journal --to jsonl:fixed.jsonl --rule 'actor/*=micro:sum,rank:mean' --steps 100:
"""


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from metricbus.kinds import KIND_HELP
    from metricbus.spec import LEVELS

    raw = argparse.RawDescriptionHelpFormatter
    top = _Parser(prog="metricbus", description="Replay, sync, show and inspect metricbus journals.",
                  epilog=_TOP_EPILOG, formatter_class=raw)
    top.add_argument("--version", action="version", version=f"metricbus {__version__}")
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser, title="commands",
                             metavar="COMMAND")

    def command(name: str, summary: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = sub.add_parser(name, help=summary, description=summary[0].upper()
                                                         + summary[1:] + ".", formatter_class=raw, **kwargs)
        parser.add_argument("journal", help="the journal folder")
        return parser

    epilog = _REPLAY_EPILOG.format(levels=", ".join(LEVELS), kinds=", ".join(KIND_HELP))
    rp = command("replay", "re-send a journal's steps to adapters (the live reduction code; --rule re-aggregates)",
                 epilog=epilog)
    rp.add_argument("--config", help="config file whose adapters receive the replay")
    rp.add_argument("--to", action="append", default=[], metavar="ADAPTER",
                    help="an adapter NAME or NAME:VALUE, e.g. jsonl or jsonl:out.jsonl (see below)")
    rp.add_argument("--rule", action="append", default=[], metavar="PATTERN=SPEC",
                    help="re-aggregate matching metrics, e.g. 'actor/*=micro:sum,rank:mean' (see below)")
    rp.add_argument("--steps", metavar="A:B", help="emit only steps A:B (half-open; A: or :B); every commit is "
                    "still reduced")
    sp = command("sync", "send each adapter the steps it has not acknowledged yet")
    sp.add_argument("--config", help="config file with the adapters (default $METRICBUS_CONFIG)")
    sh = command("show", "print the reduced values as a table")
    sh.add_argument("--metric", action="append", default=[], metavar="PATTERN",
                    help="only metrics matching this fnmatch pattern (repeatable)")
    sh.add_argument("--last", type=_at_least_one, metavar="N", help="only the last N emitted steps (N >= 1)")
    command("inspect", "print run metadata, ranks, steps, metrics and specs")
    return top


_PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_.-]*\}")


def _check_placeholders(config: str | None) -> None:
    """Refuse a config whose adapters or journal still hold a ``{placeholder}`` (before anything is created).

    examples/demo.yaml writes ``{out}``, which only the example that owns it fills in; taken literally it would
    make a folder named ``{out}``.
    """
    from metricbus.config import ENV_ADAPTERS, load_source

    data, origin = load_source(config)
    entries: list[tuple[str, Any]] = []
    adapters = data.get("adapters")
    if adapters is not None and not os.environ.get(ENV_ADAPTERS, "").strip():  # else the variable replaces them
        listed = adapters if isinstance(adapters, list) else [adapters]
        entries += [(f"adapters[{i}]", entry) for i, entry in enumerate(listed)]
    if "journal" in data:
        entries.append(("journal", data["journal"]))
    for where, value in entries:
        for text in value.values() if isinstance(value, Mapping) else [value]:  # a spec string or {type: ...}
            found = _PLACEHOLDER.search(text) if isinstance(text, str) else None
            if found is not None:
                raise _UsageError(
                    f"{origin}: {where}: {text!r} holds the placeholder {found.group()}, which the metricbus command "
                    f"does not fill in; write the path itself (in a copy of the config)"
                )


def _adapters(config: str | None, to: Sequence[str], *, command: str) -> list[Any]:
    from metricbus.config import bus_options
    from metricbus.registry import make_adapter

    out: list[Any] = []
    if config is not None or not to:
        _check_placeholders(config)
        out.extend(bus_options(config).get("adapters", []))
    for spec in to:
        try:
            out.append(make_adapter(spec))
        except (MetricBusError, TypeError, ValueError) as exc:
            raise _UsageError(f"--to {spec!r}: {exc}") from exc
    if not out:
        if command == "sync":  # it has no --to
            raise _UsageError("no adapters: give --config FILE with adapters, or set $METRICBUS_CONFIG or "
                              "$METRICBUS_ADAPTERS")
        raise _UsageError("no adapters: give --to ADAPTER or a --config with adapters")
    return out


class _Tally:
    """An adapter that only notes the steps a replay sends, for its summary line."""

    name = "tally"

    def __init__(self) -> None:
        self.steps: set[int] = set()

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        self.steps.add(step)

    def open(self, *, run: Any) -> None: ...
    def flush(self) -> None: ...
    def close(self, *, status: str) -> None: ...


def _label(adapter: Any) -> str:
    """The adapter's name, and where it wrote when it says so (its optional ``identity``)."""
    name = str(getattr(adapter, "name", type(adapter).__name__))
    try:
        identity = identity_of(adapter)
    except Exception:  # an optional verb: a failing one only costs the detail
        identity = None
    if identity:
        return f"{name} ({', '.join(identity.values())})"
    return name


def _replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
    rules = [parse_rule(r) for r in args.rule]
    steps = parse_steps(args.steps) if args.steps is not None else None
    journal = stream_journal(args.journal)
    outline = journal.outline()  # a pass over frame headers; the replay's progress needs its count too
    if not outline.commits:
        raise _UsageError("no emitted steps: the journal has no commits")
    where = f" in {args.steps}" if args.steps is not None else ""
    has = f"the journal has steps {outline.first_step}..{outline.last_step}"
    if steps is not None and not any(c.step in steps for c in journal.commits(decode=False)):  # before any adapter
        raise _UsageError(f"no emitted steps{where} ({has})")
    adapters = _adapters(args.config, args.to, command="replay")
    tally = _Tally()
    try:
        replay(journal, [*adapters, tally], rules=rules, steps=steps, progress=_progress(err), every_rule=True)
    except (BrokenPipeError, SpecError, ConfigError):  # usage errors: a rule the journal cannot serve, an option
        raise  # the replay refuses (the live run's file), an adapter option its backend refuses at open
    except Exception as exc:
        raise _BackendError(f"{type(exc).__name__}: {exc}") from exc
    if not tally.steps:  # commits in range, but none ends a log_every window there
        raise _UsageError(f"no emitted steps{where} ({has}; a step is emitted every {journal.log_every} commits)")
    sent = len(tally.steps)
    out.write(f"replayed {sent} step{'s' * (sent != 1)} ({_span(tally.steps)}) to "
              f"{', '.join(_label(a) for a in adapters)}\n")


def _sync(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    journal = stream_journal(args.journal)
    adapters = _adapters(args.config, (), command="sync")
    progress = _sync_progress(err)
    stop = threading.Event()
    try:
        with _first_sigint_sets(stop):
            sent = sync(journal, adapters, progress=progress, stop=stop)
    except SyncInterrupted as stopped:
        err.write(("\n" if progress is not None else "") + _interrupted(stopped.sent) + "\n")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # a second Ctrl-C while closing the adapters
        err.write("interrupted; run sync again to resume\n")
        return EXIT_INTERRUPTED
    except (BrokenPipeError, JournalError):  # (a cursor that cannot be written: not the backend's failure)
        raise
    except Exception as exc:
        raise _BackendError(f"{type(exc).__name__}: {exc} (cursors keep the acknowledged steps)") from exc
    for label, count in sent.items():
        out.write(f"{label}: sent {count} steps\n")
    if len(sent) > 1:
        out.write(f"sync: sent {sum(sent.values())} steps to {len(sent)} adapters\n")
    return 0


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.command == "replay":
        _replay(args, out, err)
    elif args.command == "sync":
        return _sync(args, out, err)
    elif args.command == "show":
        _show(stream_journal(args.journal), args.metric, args.last, out)
    else:
        _inspect(stream_journal(args.journal), out)
    return 0


def _quiet_stdout() -> None:
    """After a broken pipe (``metricbus show J | head``): point stdout at devnull, as Python's docs on SIGPIPE
    recommend, so the flush at exit cannot fail again and print ``Exception ignored ... BrokenPipeError``."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing flushes at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


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
            code = _run(args, out, err)
        out.flush()  # here, so a closed pipe is seen inside this try and not at exit
        return code
    except BrokenPipeError:  # the reader stopped early (| head): what it read is all it wanted
        _quiet_stdout()
        return 0
    except (_UsageError, MetricBusError, OSError) as exc:
        err.write(f"metricbus: error: {exc}\n")
        return EXIT_ERROR
    except _BackendError as exc:
        err.write(f"metricbus: error: a backend failed: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:  # outside sync's loop (reading the journal, a second Ctrl-C): nothing half-done
        err.write("metricbus: interrupted\n")
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # --help, --version
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_ERROR
