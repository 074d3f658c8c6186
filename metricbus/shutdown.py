"""Interpreter exit: every bus still open is closed before Python finalizes, on this process alone.

A bus registers here when it is built (importing metricbus registers nothing) and leaves at ``close()``. The
``atexit`` hook runs while the interpreter is still whole: delivery threads (daemons) are still running, so each
adapter is drained, flushed and closed, the journal is closed, and a torch.distributed transport waits until its
backend let go of its tensors (see :mod:`metricbus.dist`). It runs no collective: at exit the other ranks may be
anywhere (finished, crashed, still training), and a collective would hang. The run is closed as ``"failed"`` when
the interpreter is exiting on an uncaught exception, else ``"finished"``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable

from metricbus.adapter import Status

logger = logging.getLogger("metricbus")
_open: dict[int, tuple[int, Callable[[Status], None]]] = {}  # id(bus) -> (pid that built it, closer), build order
_lock = threading.Lock()
_hooked = False


def track(key: int, closer: Callable[[Status], None]) -> None:
    """Close ``key``'s bus with ``closer(status)`` at interpreter exit unless it is untracked first."""
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(close_open_buses)
            _hooked = True
        _open[key] = (os.getpid(), closer)


def untrack(key: int) -> None:
    """The bus was closed: nothing to do for it at exit."""
    with _lock:
        _open.pop(key, None)


def exit_status() -> Status:
    """``"failed"`` if the interpreter is exiting on an uncaught exception, else ``"finished"``."""
    failed = getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    return "failed" if failed else "finished"


def close_open_buses() -> None:
    """Close every bus still open, newest first; one bus failing to close does not stop the others.

    Only buses this process built: a child made by ``os.fork()`` inherits the table but must not close (and so
    deliver again) its parent's buses.
    """
    pid = os.getpid()
    with _lock:
        closers = [closer for owner, closer in list(_open.values())[::-1] if owner == pid]
        _open.clear()
    status = exit_status()
    for closer in closers:
        try:
            closer(status)
        except Exception:
            logger.exception("metricbus: closing a bus at interpreter exit failed")
