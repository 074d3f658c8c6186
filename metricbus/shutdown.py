"""Interpreter exit and SIGTERM: every bus still open is closed, on this process alone, within a bounded time.

A bus registers here when it is built (importing metricbus registers nothing, installs no handler) and leaves at
``close()``. The ``atexit`` hook runs while the interpreter is still whole: delivery threads (daemons) are still
running, so the journal is closed first, then each adapter is drained, flushed and closed, and a torch.distributed
transport waits until its backend let go of its tensors (see :mod:`metricbus.dist`). It runs no collective: at exit
the other ranks may be anywhere (finished, crashed, still training), and a collective would hang. The run is
closed as ``"failed"`` when the interpreter is exiting on an uncaught exception, else ``"finished"``.

**Bounded.** From the moment the exit (or SIGTERM) handling begins, the adapters of every open bus share at most
that bus's ``exit_timeout_s`` (default :data:`EXIT_TIMEOUT_S`) to drain; what they could not deliver stays in the
journal for ``metricbus sync``.

**SIGTERM** (SLURM and Kubernetes preemption). The first bus built with adapters or a journal installs a SIGTERM
handler, once, and only from the main thread (a signal handler cannot be installed elsewhere), unless SIGTERM is
ignored or handled outside Python. On SIGTERM it closes every open bus as ``"failed"`` within the grace period,
then restores the default action and sends SIGTERM to itself again, so the process ends the usual way (killed by
SIGTERM: exit status -15 / 143). When a Python-level handler was installed before (a trainer that saves a
checkpoint and stops on its own), the buses are *flushed* instead, within the same grace period, and that handler
is called: the program goes on, and its buses are closed when it ends.

**Ctrl-C** (SIGINT). Every bus (also one with no journal, adapters or collectives, which nothing closes at exit),
where SIGINT has Python's default handler (``KeyboardInterrupt``), installs a
handler that defers a SIGINT landing inside a bus call (the main thread holding its locks) until that call returns,
then raises ``KeyboardInterrupt`` as the default handler would. A commit is then never cut between its journal write
and the rest of it (a KeyboardInterrupt right after the write, where a Ctrl-C during a commit mostly lands, left the
step journaled but neither delivered nor counted, and the next commit wrote that step again). A second SIGINT while
one waits raises at once, so a call that hangs can still be left. A SIGTERM and a SIGINT landing in one call are
both kept: the SIGTERM is handled first, then KeyboardInterrupt is raised. A handler of the program's own is left
alone. Once the process's last open bus is closed (on the main thread), SIGINT has Python's default handler again.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from metricbus.adapter import Status

logger = logging.getLogger("metricbus")
EXIT_TIMEOUT_S = 20.0  # under the 30 s Kubernetes (terminationGracePeriodSeconds) and SLURM (KillWait) leave
FLUSH_AT_SIGTERM_S = 3600.0  # asked of each bus when chaining; its sink bounds it by exit_timeout_s
_open: dict[int, tuple[int, Callable[[Status], None]]] = {}  # id(bus) -> (pid that built it, closer), build order
# the open buses with nothing to close at exit (no journal, adapters or collectives), whose calls a SIGINT waits for
# too: id(bus) -> (pid that built it, the bus; an entry leaves when the bus is closed or garbage collected)
_guarded: dict[int, tuple[int, weakref.ref[Any]]] = {}
_lock = threading.RLock()  # reentrant: the SIGTERM handler may run while the main thread holds it
_hooked = False
_fork_hooked = False
_sigterm_done = False
_previous: Any = None  # the SIGTERM handler installed before ours
_exit_started: float | None = None  # when exit or SIGTERM handling began (None: not exiting)
# the SIGTERM and SIGINT that arrived inside a bus call, one of each at most (None: none waits)
_deferred: tuple[tuple[int, FrameType | None], ...] | None = None


def track(key: int, closer: Callable[[Status], None]) -> None:
    """Close ``key``'s bus with ``closer(status)`` at interpreter exit (or SIGTERM) unless it is untracked first."""
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(close_open_buses)
            _hooked = True
        _hook_forks()
        _open[key] = (os.getpid(), closer)
    install_sigterm()
    install_sigint()


def _hook_forks() -> None:
    """Install :func:`_forked` once (by the first bus built, tracked or guarded; the caller holds ``_lock``)."""
    global _fork_hooked
    if not _fork_hooked and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forked)
        _fork_hooked = True


def _forked() -> None:
    """In a child of ``os.fork()``: a new lock (one a parent thread held at the fork stays held in the child, and the
    child's exit would wait on it for ever), and no signal deferred by the parent's bus calls."""
    global _lock, _deferred
    _lock = threading.RLock()
    _deferred = None


def guard(key: int, bus: object) -> None:
    """A bus with nothing to close at exit (not tracked): a SIGINT landing inside its calls waits for them too
    (:func:`install_sigint`), while it is open and alive."""
    with _lock:
        _hook_forks()  # (a process whose buses are all guarded needs a new _lock in a child too)
        _guarded[key] = (os.getpid(), weakref.ref(bus, lambda _: untrack(key)))
    install_sigint()


def untrack(key: int) -> None:
    """The bus was closed: nothing to do for it at exit (the last one of this process gives SIGINT back to Python's
    default handler, where ours is still the one installed and this is the main thread)."""
    with _lock:
        _open.pop(key, None)
        _guarded.pop(key, None)
        if not _closers() and not _guarded_buses():
            uninstall_sigint()


def _guarded_buses() -> list[Any]:
    """This process's guarded buses still alive."""
    pid = os.getpid()
    with _lock:
        return [bus for owner, ref in list(_guarded.values()) if owner == pid and (bus := ref()) is not None]


def bounded(timeout_s: float, exit_timeout_s: float) -> float:
    """``timeout_s``, cut to what is left of ``exit_timeout_s`` while exiting (or handling SIGTERM)."""
    started = _exit_started
    if started is None:
        return timeout_s
    return max(0.0, min(timeout_s, started + exit_timeout_s - time.monotonic()))


def exit_status() -> Status:
    """``"failed"`` if the interpreter is exiting on an uncaught exception, else ``"finished"``."""
    failed = getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    return "failed" if failed else "finished"


def _closers() -> list[Callable[[Status], None]]:
    """This process's closers, newest first (a child of ``os.fork()`` must not close its parent's buses)."""
    pid = os.getpid()
    with _lock:
        return [closer for owner, closer in list(_open.values())[::-1] if owner == pid]


def close_open_buses(status: Status | None = None) -> None:
    """Close every bus still open, newest first; one bus failing to close does not stop the others.

    Only buses this process built: a child made by ``os.fork()`` inherits the table but must not close (and so
    deliver again) its parent's buses.
    """
    global _exit_started
    if _exit_started is None:
        _exit_started = time.monotonic()
    closers = _closers()
    with _lock:
        _open.clear()
    final = exit_status() if status is None else status
    for closer in closers:
        try:
            closer(final)
        except Exception:
            logger.exception("metricbus: closing a bus at interpreter exit failed")


def flush_open_buses() -> None:
    """Flush every open bus of this process (within its exit_timeout_s); they stay open."""
    for closer in _closers():
        flush = getattr(getattr(closer, "__self__", None), "flush", None)
        try:
            if callable(flush) and not flush(timeout_s=FLUSH_AT_SIGTERM_S):
                logger.warning("metricbus: a bus did not finish delivering within its exit_timeout_s at SIGTERM")
        except Exception:
            logger.exception("metricbus: flushing a bus at SIGTERM failed")


def install_sigterm() -> None:
    """Install the SIGTERM handler once, from the main thread, unless SIGTERM is ignored or handled outside Python."""
    global _sigterm_done, _previous
    with _lock:
        if _sigterm_done or threading.current_thread() is not threading.main_thread():
            return
        _sigterm_done = True
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous == signal.SIG_IGN:
            return  # a handler set outside Python, or SIGTERM ignored on purpose: leave it alone
        _previous = previous
        signal.signal(signal.SIGTERM, _on_sigterm)


def install_sigint() -> None:
    """Install the SIGINT handler from the main thread, where SIGINT has Python's default handler; it stays while a
    bus of this process is open (:func:`uninstall_sigint`), so code that looks for the default handler once no bus
    is open (``asyncio.run`` installs its own Ctrl-C handling only over it) finds it again."""
    with _lock:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # ours already, the program's own handler, SIGINT ignored, or handled outside Python: leave it
        signal.signal(signal.SIGINT, _on_sigint)


def uninstall_sigint() -> None:
    """Give SIGINT back to Python's default handler, where ours is the one installed (from the main thread only: a
    bus closed on another thread leaves it, and it acts as the default handler does while no bus is open)."""
    with _lock:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """KeyboardInterrupt, as Python's default handler raises it; one that lands inside a bus call waits until the call
    returns (:func:`after_call`), so no commit is cut in two. A second SIGINT while one waits raises at once (a call
    that hangs can still be left); a deferred SIGTERM goes first."""
    global _deferred
    if _main_is_inside_a_bus():
        if _defer(signum, frame):
            return
        _deferred = tuple(item for item in _deferred or () if item[0] != signum) or None  # (a SIGTERM still waits)
    signal.default_int_handler(signum, frame)


def _defer(signum: int, frame: FrameType | None) -> bool:
    """Keep ``signum`` for :func:`after_call` and return True; False where one of that signal waits already."""
    global _deferred
    waiting = _deferred or ()
    if any(kept == signum for kept, _ in waiting):
        return False
    # not ``frame``: the interrupted frame is the collective's own (torch.distributed's all_reduce holding its work),
    # and kept until the bus call returns it pins the collective's tensors: settle() waited out its bound and warned
    # of tensors the backend had let go of, twice in a close() that SIGTERM interrupted (the handlers get None, as
    # Python allows: the frame is gone once the call returned anyway)
    _deferred = (*waiting, (signum, None))
    return True


def _grace_s() -> float:
    """The longest ``exit_timeout_s`` of this process's open buses, plus a margin for the journal."""
    sinks = [getattr(getattr(closer, "__self__", None), "_sink", None) for closer in _closers()]
    limits = [getattr(sink, "_exit_timeout_s", None) for sink in sinks]
    return max([EXIT_TIMEOUT_S, *(t for t in limits if isinstance(t, (int, float)))]) + 5.0


def _main_is_inside_a_bus() -> bool:
    """True when the main thread (which runs signal handlers) holds a bus's lock: it was interrupted inside one."""
    for bus in [getattr(closer, "__self__", None) for closer in _closers()] + _guarded_buses():
        locks = [getattr(bus, "_lock", None), getattr(getattr(bus, "_collector", None), "lock", None)]
        if any(isinstance(lock, BusLock) and lock._is_owned() for lock in locks):
            return True
    return False


class BusLock:
    """A bus's lock: reentrant, and on its outermost release it runs a SIGTERM deferred while it was held."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if _deferred is not None and not self._lock._is_owned():  # type: ignore[attr-defined]
            after_call()

    def _is_owned(self) -> bool:
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]


def after_call() -> None:
    """Called by the bus when a call that held its locks returns: run the SIGTERM, then the SIGINT, that arrived
    during that call (a SIGINT while a SIGTERM waited is not lost: the program's SIGTERM handler runs, then
    KeyboardInterrupt is raised)."""
    global _deferred
    if _deferred is not None and threading.current_thread() is threading.main_thread():
        waiting, _deferred = _deferred, None
        for signum, frame in sorted(waiting, key=lambda item: item[0] == signal.SIGINT):
            (_on_sigint if signum == signal.SIGINT else _on_sigterm)(signum, frame)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Drain the buses within the grace period, then let the previous handler or the default action act.

    A SIGTERM that interrupts the main thread inside a bus call (holding its locks) is deferred until that call
    returns (:func:`after_call`), so the drain never waits on a lock its own thread holds. The drain runs in a thread
    of its own that the handler waits for, bounded by the buses' ``exit_timeout_s``; what could not be delivered in
    time stays in the journal for ``metricbus sync``.
    """
    global _exit_started
    if _main_is_inside_a_bus():
        _defer(signum, frame)
        return
    previous = _previous
    chained = callable(previous)
    _exit_started = time.monotonic()
    drain = threading.Thread(
        target=flush_open_buses if chained else lambda: close_open_buses(status="failed"),
        name="metricbus-sigterm",
        daemon=True,
    )
    try:
        drain.start()
        drain.join(timeout=_grace_s())
    finally:
        if chained:
            _exit_started = None  # the program goes on: later closes are not cut short
    if chained:
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
