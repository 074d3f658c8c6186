"""``fsync="interval"``: a journal file fsynced from a thread of its own, so that ``commit()`` never waits on the disk.

A commit's bytes are in the operating system once its ``os.write`` returned: that is what survives a SIGKILL, and it
stays in ``commit()``. The fsync only decides what survives a power loss, and it can take long: flushing a second
of commits (~30 MB at 10,000 commits/s) took ~20 ms on this machine's ext4, and seconds on a busy or network file
system, once a second inside the training loop. :class:`IntervalSync` runs it from a daemon thread, at most every
``interval`` seconds and only after something was written; the writer's thread only notes the steps it wrote.

- The thread fsyncs a descriptor of its own (a ``dup`` of the writer's, closed by the thread), so the writer closes
  its file without waiting for an fsync under way, and the thread never touches a closed or reused descriptor; then,
  where the writer stages its commits, the stage file's (``also``, :mod:`metricbus.journal.stage`) the same way.
- Where no thread can be started (at interpreter exit on Python 3.12+, a process out of threads), the writer's
  thread fsyncs inline at most every ``interval``, as before the thread existed.
- A failed fsync is kept, with the steps written since the fsync before it, until the writer takes it
  (:meth:`IntervalSync.failure`, after a write that succeeded, or at close): it marks those steps as a gap and
  raises ``JournalError``.
- In a child forked while the thread runs there is no thread: the child's first write starts its own.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref

_LIVE: weakref.WeakSet[IntervalSync] = weakref.WeakSet()  # for the fork hook
_HOOKED = False


class IntervalSync:
    """The fsync thread of one journal file (the writer's descriptor ``fd``), started by the first :meth:`wrote`."""

    def __init__(self, *, fd: int, interval: float, name: str, also: int | None = None) -> None:
        self._fd = fd
        self._also = also  # a second file fsynced with it (the journal's stage: stage.py), or None
        self._interval = interval
        self._name = name
        self._inline = False  # no thread could be started: :meth:`wrote` fsyncs every ``interval`` itself
        self._last_sync = time.monotonic()  # (inline only)
        self._reset()
        _watch_forks(self)

    def _reset(self) -> None:
        """No thread, and fresh locks (at build, and in a forked child: a lock the parent's thread held stays held)."""
        self._lock = threading.Lock()  # guards the two fields below
        self._written: tuple[int, int] | None = None  # the steps written since the last fsync began
        self._failed: tuple[OSError, int, int] | None = None  # the failure not taken yet, and the steps it covered
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_fd = -1  # the thread's descriptor (a child closes the one it inherited)
        self._thread_also = -1  # and its copy of ``also``

    def wrote(self, step: int) -> None:
        """The writer wrote a commit of ``step`` (its ``os.write`` returned)."""
        with self._lock:
            held = self._written
            self._written = (step, step) if held is None else (held[0], step)
        if self._thread is None and not self._inline:
            self._start()
        if self._inline:
            now = time.monotonic()
            if now - self._last_sync >= self._interval:
                self._last_sync = now
                self._sync(self._fd, -1 if self._also is None else self._also)

    def forget_also(self) -> None:
        """Fsync the writer's file alone from now on (its stage was dropped: a forked child's)."""
        self._also = None

    @property
    def failed(self) -> bool:
        """True if an fsync failed since the last :meth:`failure` (read without the lock: a hint)."""
        return self._failed is not None

    @property
    def dirty(self) -> bool:
        """True if a commit was written since the last fsync began."""
        return self._written is not None

    def failure(self) -> tuple[OSError, int, int] | None:
        """The fsync failure not yet taken (the error, the first and the last step it covered), taken."""
        with self._lock:
            failed, self._failed = self._failed, None
        return failed

    def stop(self) -> None:
        """Ask the thread to end (it ends once an fsync under way returned)."""
        self._stop.set()
        _LIVE.discard(self)

    def join(self) -> None:
        """Wait for the thread to end (after :meth:`stop`)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _start(self) -> None:
        try:
            fd = os.dup(self._fd)
        except OSError:
            self._inline = True
            return
        try:
            also = -1 if self._also is None else os.dup(self._also)
        except OSError:
            os.close(fd)
            self._inline = True
            return
        thread = threading.Thread(target=self._run, args=(fd, also, self._stop), name=self._name, daemon=True)
        self._thread_fd, self._thread_also = fd, also  # (before the thread runs: it forgets them when it ends)
        try:
            thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown", or none left
            self._thread_fd = self._thread_also = -1
            _close(fd, also)
            self._inline = True
            return
        self._thread = thread

    def _sync(self, fd: int, also: int) -> None:
        with self._lock:
            steps, self._written = self._written, None
        if steps is None:  # nothing written since the last fsync
            return
        try:
            os.fsync(fd)
            if also >= 0:
                os.fsync(also)
        except OSError as exc:  # kept for the writer
            with self._lock:
                held = self._failed
                self._failed = (exc, steps[0], steps[1]) if held is None else (held[0], held[1], steps[1])

    def _run(self, fd: int, also: int, stop: threading.Event) -> None:
        try:
            while not stop.wait(self._interval):
                self._sync(fd, also)
        finally:
            # first: a child forked from now on must not close the numbers (reused, maybe)
            self._thread_fd = self._thread_also = -1
            _close(fd, also)  # (a write-back error it reports, the writer's fsync and close do too)


def _watch_forks(sync: IntervalSync) -> None:
    global _HOOKED
    _LIVE.add(sync)
    if not _HOOKED and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forked)
        _HOOKED = True


def _forked() -> None:
    """In a forked child: no thread runs; each journal's next write starts its own."""
    for sync in list(_LIVE):
        _close(sync._thread_fd, sync._thread_also)
        sync._reset()


def _close(*fds: int) -> None:
    """Close each descriptor that is one (>= 0), whatever closing the others raised."""
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
