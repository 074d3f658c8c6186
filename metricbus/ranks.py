"""The rank level's transport. ``LocalRanks``: this process plus partials ingested from workers.

A transport turns one commit's partials into every worker's update-level states, in rank order, identically on
every participant, plus the specs they reduce with and what this process journals; the reduction itself is the
same local code everywhere (see :mod:`metricbus.reduce`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from metricbus.partial import Partial, Updates
from metricbus.reduce import StepReducer, WorkerStates
from metricbus.spec import Spec
from metricbus.spec_table import SpecTable


@dataclass(frozen=True, slots=True)
class Exchange:
    """One commit's rank level input: workers' states in rank order, their specs, and the journal's entries."""

    workers: list[WorkerStates]
    specs: dict[str, Spec]  # read only
    journal: list[tuple[int, Partial]]  # (worker rank, its partial with the agreed specs); [] if not journaled
    rejected: dict[str, str] = field(default_factory=dict)  # metric -> which other rank dropped its records


class RankTransport(Protocol):
    """How a bus learns the other workers' states at commit."""

    is_writer: bool
    rank: int
    collective: bool  # True: exchange/any_pending are collectives that every participant must call together

    def exchange(
        self,
        *,
        own: Partial,
        own_updates: Updates,
        ingested: Sequence[Partial],
        table: SpecTable,
        reducer: StepReducer,
        journaled: bool,
        rejected: Sequence[str],
    ) -> Exchange:
        """Every worker's states of this commit, in rank order. ``rejected``: metrics whose records this process
        dropped (bad device records); a collective transport drops them on every rank."""

    def any_pending(self, *, pending: bool) -> bool:
        """True if any participant has uncommitted records (used by close)."""

    def usable(self) -> bool:
        """True while exchange/any_pending can run (a process group that was destroyed cannot)."""

    def settle(self) -> bool:
        """Wait until nothing of this transport is still held by a backend thread; False if that timed out."""


def with_specs(partial: Partial, specs: dict[str, Spec], drop: Collection[str] = ()) -> Partial:
    """``partial`` with each entry's spec replaced by the agreed one, without ``drop`` (what the journal keeps)."""
    if not drop and all(specs[name] is spec for name, spec, _ in partial.entries):
        return partial
    entries = tuple((name, specs[name], s) for name, _, s in partial.entries if name not in drop)
    return Partial(entries, partial.undeclared)


class LocalRanks:
    """Single process: ingested partials rank first, in ingest order; this bus's own records rank last.

    ``ingest()`` already settled every ingested name's spec in the table, so this only reduces.
    """

    is_writer = True
    rank = 0
    collective = False

    def exchange(
        self,
        *,
        own: Partial,
        own_updates: Updates,
        ingested: Sequence[Partial],
        table: SpecTable,
        reducer: StepReducer,
        journaled: bool,
        rejected: Sequence[str],
    ) -> Exchange:
        """``[*ingested, own]``, each reduced to its update-level states (``rejected`` are already left out)."""
        specs = table.specs  # ingest() claimed every ingested name; log() every own name
        workers = [reducer.worker(p.updates(), specs) for p in ingested]
        workers.append(reducer.worker(own_updates, specs))
        journal = [(i, with_specs(p, specs)) for i, p in enumerate([*ingested, own])] if journaled else []
        return Exchange(workers, specs, journal)

    def any_pending(self, *, pending: bool) -> bool:
        """Only this process."""
        return pending

    def usable(self) -> bool:
        """Always."""
        return True

    def settle(self) -> bool:
        """Nothing to wait for."""
        return True
