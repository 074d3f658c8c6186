"""Progress lines (on a terminal only) and Ctrl-C handling of ``metricbus replay`` and ``metricbus sync``."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from metricbus.replay import Progress, SyncProgress


def replay_progress(stream: TextIO) -> Progress | None:
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


def sync_progress(stream: TextIO, *, every_s: float = 0.2) -> SyncProgress | None:
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
def first_sigint_sets(stop: threading.Event) -> Iterator[None]:
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


def interrupted(sent: dict[str, int]) -> str:
    parts = [f"{count} steps to {label}" for label, count in sent.items()]
    return f"interrupted: sent {', '.join(parts) or 'nothing'}; run sync again to resume"
