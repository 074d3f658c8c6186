"""The rank level over torch.distributed: one packed ``all_gather`` of every metric's Summary per commit.

The reduction itself stays the local code in :mod:`metricbus.reduce` (so live equals journal replay bitwise);
this module only moves per-rank Summaries. All ranks keep an identical *agreed table* of metric names and specs.
Each commit packs, for every agreed metric, the 12 Summary fields into one float64 buffer, plus one leading
flag slot that says "this rank has names (or specs) the table lacks". One ``all_gather_single`` (the former
``all_gather_into_tensor``) then gives every rank every rank's Summaries. When any flag is set, the ranks do one
``all_gather_object`` of their new ``(name, spec)`` pairs together with this commit's partials and extend the table
identically: a changed key set costs exactly one extra (object) collective; the steady state costs exactly one
collective, whatever the number of metrics. Conflicting specs raise :class:`~metricbus.errors.DistributedError`
on every rank (all ranks see the same gathered specs, so all raise; nothing hangs).

Cost per commit with R ranks and K agreed metrics: each rank receives R*K*12*8 bytes (the all_gather is O(R)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from metricbus.errors import DistributedError
from metricbus.partial import Partial
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, Summary

_FLAG = 0  # slot 0 of each rank's block: 1.0 when the rank has names or specs the agreed table lacks


def make_torch_transport(*, required: bool, group: Any, writer_rank: int) -> TorchRanks | None:
    """A transport over the initialized default (or given) process group; None if unavailable and not required."""
    try:
        import torch.distributed as tdist
    except ImportError as exc:
        if required:
            raise DistributedError("dist='torch' needs torch with torch.distributed; install torch") from exc
        return None
    if not tdist.is_available() or not tdist.is_initialized():
        if required:
            raise DistributedError(
                "dist='torch' but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) before building the MetricBus, or use dist=None"
            )
        return None
    size = tdist.get_world_size(group)
    if not 0 <= writer_rank < size:
        raise DistributedError(f"writer_rank={writer_rank} is not a rank of the group (size {size})")
    return TorchRanks(group=group, writer_rank=writer_rank)


class TorchRanks:
    """Every rank's Partial per commit, in rank order, through one packed all_gather in the steady state."""

    def __init__(self, *, group: Any, writer_rank: int) -> None:
        import torch
        import torch.distributed as tdist

        self._torch = torch
        self._dist = tdist
        self._group = group
        self.rank: int = tdist.get_rank(group)
        self._size: int = tdist.get_world_size(group)
        self.is_writer: bool = self.rank == writer_rank
        self._names: list[str] = []  # the agreed table, sorted, identical on every rank
        self._specs: dict[str, Spec] = {}
        backend = str(tdist.get_backend(group)).lower()
        self._device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")

    # -- the protocol ------------------------------------------------------------------------------------------

    def gather(self, *, own: Partial, ingested: Sequence[Partial]) -> list[Partial]:
        """All ranks' partials of this commit, in rank order; a collective every rank of the group calls."""
        if ingested:
            # Ingested partials are workers of their own at the rank level; folding them into one rank's
            # contribution would change rank-level kinds (e.g. rank="mean"), so the combination is refused.
            raise DistributedError(
                "ingest() cannot be combined with torch.distributed; use export()/ingest() with dist=None, "
                "or log on every rank and let commit() gather"
            )
        mine = {name: (spec, summary) for name, spec, summary in own}
        new = {name: spec for name, (spec, _) in mine.items() if self._specs.get(name) != spec}
        blocks = self._exchange(mine, flag=bool(new))
        if any(block[_FLAG] for block in blocks):
            # The key set changed: one object gather carries the new specs and this commit's partials, so the
            # commit costs the data gather plus exactly one object collective.
            return self._agree(new, own)
        return [self._partial(block) for block in blocks]

    def any_pending(self, *, pending: bool) -> bool:
        """True if any rank has uncommitted records (one small all_reduce)."""
        torch = self._torch
        flag = torch.tensor([1.0 if pending else 0.0], dtype=torch.float64, device=self._device)
        self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item() > 0)

    # -- internals ---------------------------------------------------------------------------------------------

    def _exchange(self, mine: dict[str, tuple[Spec, Summary]], *, flag: bool) -> list[list[float]]:
        """One all_gather_into_tensor of ``[flag, *fields of each agreed metric]``; per-rank blocks as floats."""
        torch = self._torch
        width = 1 + N_FIELDS * len(self._names)
        row = [1.0 if flag else 0.0]
        empty = Summary().as_tuple()
        for name in self._names:
            held = mine.get(name)
            row.extend(held[1].as_tuple() if held is not None and held[0] == self._specs[name] else empty)
        local = torch.tensor(row, dtype=torch.float64).to(self._device)
        out = torch.empty(width * self._size, dtype=torch.float64, device=self._device)
        # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same semantics); looked up
        # at call time so wrappers installed on torch.distributed (call counters, profilers) see it.
        all_gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        all_gather(out, local, group=self._group)
        flat: list[float] = out.cpu().tolist()
        return [flat[r * width : (r + 1) * width] for r in range(self._size)]

    def _agree(self, new: dict[str, Spec], own: Partial) -> list[Partial]:
        """One all_gather_object of each rank's new ``{name: spec}`` and its partial; extend the table identically
        on every rank (or raise on every rank) and return every rank's partial."""
        gathered: list[Any] = [None] * self._size
        self._dist.all_gather_object(gathered, (new, own), group=self._group)
        seen: dict[str, tuple[int, Spec]] = {}
        for rank, (names, _) in enumerate(gathered):
            for name, spec in sorted(names.items()):
                agreed = self._specs.get(name)
                if agreed is not None and agreed != spec:
                    raise DistributedError(
                        f"rank {rank} logs {name!r} with spec {spec}, but the ranks agreed on {agreed} earlier; "
                        "every rank must use the same spec for a name"
                    )
                held = seen.get(name)
                if held is not None and held[1] != spec:
                    raise DistributedError(
                        f"ranks disagree on the spec of {name!r}: rank {held[0]} uses {held[1]}, rank {rank} "
                        f"uses {spec}; every rank must use the same spec for a name"
                    )
                seen.setdefault(name, (rank, spec))
        for name, (_, spec) in seen.items():
            self._specs[name] = spec
        self._names = sorted(self._specs)
        return [partial for _, partial in gathered]

    def _partial(self, block: list[float]) -> Partial:
        entries = []
        for i, name in enumerate(self._names):
            start = 1 + i * N_FIELDS
            fields = block[start : start + N_FIELDS]
            if fields[0] > 0:
                entries.append((name, self._specs[name], Summary.from_tuple(fields)))
        return Partial(tuple(entries))
