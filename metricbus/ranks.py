"""The rank level's transport. ``LocalRanks``: this process plus partials ingested from workers.

A transport returns, for one commit, every worker's micro-level partial in rank order, identically on every
participant, so the reduction itself is the same local code everywhere (see :mod:`metricbus.reduce`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from metricbus.partial import Partial


class RankTransport(Protocol):
    """How a bus learns the other workers' partials at commit."""

    is_writer: bool
    rank: int
    collective: bool  # True: gather/any_pending are collectives that every participant must call together

    def gather(self, *, own: Partial, ingested: Sequence[Partial]) -> list[Partial]:
        """All partials of this commit, in rank order."""

    def any_pending(self, *, pending: bool) -> bool:
        """True if any participant has uncommitted records (used by close)."""

    def usable(self) -> bool:
        """True while gather/any_pending can run (a process group that was destroyed cannot)."""

    def settle(self) -> bool:
        """Wait until nothing of this transport is still held by a backend thread; False if that timed out."""


class LocalRanks:
    """Single process: ingested partials rank first, in ingest order; this bus's own records rank last."""

    is_writer = True
    rank = 0
    collective = False

    def gather(self, *, own: Partial, ingested: Sequence[Partial]) -> list[Partial]:
        """``[*ingested, own]``."""
        return [*ingested, own]

    def any_pending(self, *, pending: bool) -> bool:
        """Only this process."""
        return pending

    def usable(self) -> bool:
        """Always."""
        return True

    def settle(self) -> bool:
        """Nothing to wait for."""
        return True
