"""The reader's side of the "W" frames (format.py): which commits of a ``log_every`` window damage took.

With ``log_every`` > 1 a writer ends each window's last write with the steps of the window's commits. The first
pass (:func:`metricbus.journal.scan.index_file`) keeps the commits it read in the open window (:class:`OpenWindow`)
and, where damage was seen since the window opened, matches them against those steps: each one missing is counted
as an empty commit at its step, placed before the commit read after it (:func:`window_losses`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


class OpenWindow:
    """``(step, file offset)`` of the commits read in the open window, its last ``2 * log_every + 2`` at least (a
    file without "W" frames, from before them, keeps no more), and the damage count of the file when it opened."""

    __slots__ = ("_cut", "_damaged", "_every", "_keep", "_read")

    def __init__(self, *, every: int, damaged: int) -> None:
        self._every = every
        self._keep = 2 * every + 2
        self._read: list[tuple[int, int]] = []
        self._cut = False  # commits read were dropped from the front (their window's "W" was never read)
        self._damaged = damaged

    def add(self, read: Iterable[tuple[int, int]]) -> None:
        """Commits read (or counted: a failed write's), in file order."""
        kept = self._read
        kept.extend(read)
        if len(kept) > 2 * self._keep:
            del kept[: -self._keep]
            self._cut = True

    def losses(self, listed: list[int], here: int, damaged: int) -> dict[int, list[int]]:
        """:func:`window_losses` of a "W" frame at offset ``here`` naming ``listed`` steps, the file's damage
        count now ``damaged``: {} where nothing was damaged since the window opened, or where the commits kept do
        not reach back to the window's first."""
        if damaged <= self._damaged or (self._cut and len(listed) >= len(self._read)):
            return {}
        return window_losses(listed, self._read, here)

    def next(self, damaged: int) -> OpenWindow:
        """The window that opens after this one ends (a "W" frame, or a segment's "K" frame)."""
        return OpenWindow(every=self._every, damaged=damaged)


def window_losses(listed: list[int], read: list[tuple[int, int]], here: int) -> dict[int, list[int]]:
    """The commits a "W" frame at offset ``here`` names (``listed`` steps) that were not read (``read``: (step,
    offset) of the window's commits read, maybe after an earlier window whose "W" was lost): offset of the commit
    read after each (``here`` for the last) -> their steps. Matched from the end, as the frame ends the window; {}
    where the steps read and the missing ones would not be in order (a window this cannot tell)."""
    out: dict[int, list[int]] = {}
    j, after, floor = len(read) - 1, here, None
    for step in reversed(listed):
        if j >= 0 and read[j][0] == step:
            after = read[j][1]
            j -= 1
        else:
            out.setdefault(after, []).insert(0, step)
        floor = step
    merged = sorted(
        [(offset, step) for offset, steps in out.items() for step in steps] + [(o, s) for s, o in read[j + 1 :]],
        key=lambda pair: pair[0],
    )
    in_order = all(a[1] <= b[1] for a, b in itertools.pairwise(merged))
    return out if in_order and (j < 0 or floor is None or read[j][0] <= floor) else {}
