"""``fsync="interval"``: a journal file fsynced from a thread of its own, so that ``commit()`` never waits on the disk.

A commit's bytes are in the operating system once its ``os.write`` returned: that is what survives a SIGKILL, and it
stays in ``commit()``. The fsync only decides what survives a power loss, and it can take long: flushing a second
of commits (~30 MB at 10,000 commits/s) took ~20 ms on this machine's ext4, and seconds on a busy or network file
system, once a second inside the training loop. :class:`IntervalSync` runs it from a daemon thread, at most every
``interval`` seconds and only after something was written; the writer's thread only notes the steps it wrote.

A failed fsync is kept, with the steps written since the last one that succeeded, until the writer takes it
(:meth:`IntervalSync.failure`): the writer marks those steps as a gap and raises ``JournalError`` from the next
``commit()`` or ``close()``. :meth:`IntervalSync.stop` ends the thread (waiting for an fsync under way) before the
writer closes the file, so the thread never touches a closed descriptor.
"""

from __future__ import annotations

import os
import threading


class IntervalSync:
    """The fsync thread of one journal file (its descriptor ``fd``), started by the first :meth:`wrote`."""

    def __init__(self, *, fd: int, interval: float, name: str) -> None:
        self._fd = fd
        self._interval = interval
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The steps written since the thread last took them: {0: (first, last)}. The writer updates it after each
        # write; the thread takes it with one ``dict.pop`` (atomic), so no step is ever left out of an fsync's range.
        self._written: dict[int, tuple[int, int]] = {}
        self._failed: dict[int, tuple[OSError, int, int]] = {}  # {0: the first failure not taken, its steps}

    def wrote(self, step: int) -> None:
        """The writer wrote a commit of ``step`` (its ``os.write`` returned)."""
        written = self._written
        held = written.get(0)
        written[0] = (step, step) if held is None else (held[0], step)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def failure(self) -> tuple[OSError, int, int] | None:
        """The fsync failure not yet reported (the error, the first and the last step it covered), taken."""
        return self._failed.pop(0, None)

    def stop(self) -> None:
        """End the thread, after the fsync under way (if any); what it did not sync is left to the caller."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            steps = self._written.pop(0, None)
            if steps is None:  # nothing written since the last fsync
                continue
            try:
                os.fsync(self._fd)
            except OSError as exc:  # kept for the writer, whose next commit raises it
                held = self._failed.get(0)
                self._failed[0] = (exc, steps[0], steps[1]) if held is None else (held[0], held[1], steps[1])
