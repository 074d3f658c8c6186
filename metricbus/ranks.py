"""The rank level's transport. ``LocalRanks``: this process plus partials ingested from workers.

A transport turns one commit's partials into its rank level, identically on every participant: either every
worker's update-level states in rank order (one worker: :class:`LocalRanks` without ingested partials), or the
rank-level results themselves, merged exactly by :mod:`metricbus.rank_level` (a driver's ingested partials,
column-wise in :mod:`metricbus.packed_ranks`; torch.distributed's two collectives in :mod:`metricbus.dist`), plus
the specs they reduce with and what this process journals. Every path merges with the same exact arithmetic, so
they agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from metricbus.packed_ranks import rank_level_of
from metricbus.partial import Partial, Updates
from metricbus.reduce import RankedStates, StepReducer, WorkerStates
from metricbus.spec import Spec
from metricbus.spec_table import SpecTable
from metricbus.step_check import CLOSE_PENDING


@dataclass(frozen=True, slots=True)
class Commit:
    """What one commit hands its transport."""

    own: Partial  # this process's records (empty when neither journaled nor collective: ``own_updates`` has them)
    own_updates: Updates
    ingested: Sequence[Partial]  # workers' partials, ranked before ``own``
    table: SpecTable
    reducer: StepReducer
    journaled: bool
    rejected: Sequence[str]  # metrics whose records this process dropped; a collective transport drops them on
    # every rank
    step: int = 0  # the step committed (a collective transport checks that every rank commits the same)
    invalid: bool = False  # this rank's step was invalid: the commit is aborted after its collectives
    doing: int = 0  # step_check.COMMIT; CLOSE or CLOSE_PENDING: close()'s check (nothing is committed)


@dataclass(frozen=True, slots=True)
class Exchange:
    """One commit's rank level: workers' states in rank order (or, from a collective transport, the rank-level
    results themselves), their specs, and the journal's entries."""

    workers: list[WorkerStates]  # [] when ``ranked`` is given
    specs: dict[str, Spec]  # read only
    journal: list[tuple[int, Partial]]  # (worker rank, its partial with the agreed specs); [] if not journaled
    rejected: dict[str, str] = field(default_factory=dict)  # metric -> which other rank dropped its records
    ranked: RankedStates | None = None  # the rank level already merged (torch.distributed)
    version: int | None = None  # the spec table's version, where ``specs`` is its mapping (see StepReducer.commit)
    steps: tuple[int, int] | None = None  # the lowest and highest step where the ranks committed different ones
    mixed: bool = False  # some ranks were in close() while the others committed (every rank raises)
    pending: bool = False  # close()'s check, every rank closing: some rank has records left

    def names(self) -> set[str]:
        """The metrics this commit holds."""
        if self.ranked is not None:
            return set(self.ranked)
        return set().union(*self.workers)

    def commit_to(self, reducer: StepReducer) -> dict[str, float] | None:
        """Add this commit to ``reducer``; the emitted values when its window completes."""
        if self.ranked is not None:
            return reducer.commit_ranked(self.ranked, self.specs)
        return reducer.commit(self.workers, self.specs, version=self.version)


class RankTransport(Protocol):
    """How a bus learns the other workers' states at commit."""

    is_writer: bool
    rank: int
    collective: bool  # True: exchange/any_pending are collectives that every participant must call together
    world: int  # how many processes take part (each journals its own rank file where ``collective``)
    ended: str | None  # why exchange/any_pending cannot run any more (a rank closed while others committed)

    def exchange(self, commit: Commit) -> Exchange:
        """Every worker's states of this commit, in rank order."""

    def any_pending(self, check: Commit) -> bool:
        """True if any participant has uncommitted records (used by close); ``check`` is a commit of nothing whose
        ``doing`` says whether this one has some."""

    def gather(self, text: str) -> list[str]:
        """Every participant's ``text``, in rank order, on every participant (the run's identity and the options
        that must agree, when a bus is built)."""

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
    world = 1
    ended: str | None = None

    def exchange(self, commit: Commit) -> Exchange:
        """``[*ingested, own]``, merged column-wise at the rank level (``rejected`` are already left out)."""
        specs = commit.table.specs  # ingest() claimed every ingested name; log() every own name
        own = commit.reducer.worker(commit.own_updates, specs)
        # The own partial was built from this table's specs at this commit: only ingested ones may carry others.
        journal = (
            [*((i, with_specs(p, specs)) for i, p in enumerate(commit.ingested)), (len(commit.ingested), commit.own)]
            if commit.journaled
            else []
        )
        if not commit.ingested:
            return Exchange([own], specs, journal, version=commit.table.version)
        ranked = rank_level_of(commit.ingested, [own] if own else [], specs, commit.reducer)
        return Exchange([], specs, journal, ranked=ranked)

    def any_pending(self, check: Commit) -> bool:
        """Only this process."""
        return check.doing == CLOSE_PENDING

    def gather(self, text: str) -> list[str]:
        """This process alone."""
        return [text]

    def usable(self) -> bool:
        """Always."""
        return True

    def settle(self) -> bool:
        """Nothing to wait for."""
        return True


def make_transport(*, dist: str | None, group: Any, writer_rank: int) -> RankTransport:
    """The torch.distributed transport when asked for (``"torch"``) or available (``"auto"``), else LocalRanks."""
    if dist is None:
        return LocalRanks()
    try:
        from metricbus.dist import make_torch_transport
    except ImportError:
        if dist == "torch":
            raise
        return LocalRanks()
    transport = make_torch_transport(required=dist == "torch", group=group, writer_rank=writer_rank)
    return transport if transport is not None else LocalRanks()
