"""A commit's rank level held in columns: what torch.distributed's merge gives when every column took the fast path.

:func:`metricbus.rank_level.finish` computes each merged column's fields as arrays
(:class:`~metricbus.rank_finish.Merged`). Where every agreed metric has one column and no merge left the fast
path, :class:`RankedColumns` keeps those arrays as the commit's rank-level results. Read as a mapping it gives each
metric's ``(Summary,)``, as the dict of :data:`~metricbus.reduce.Ranked` does. With ``log_every=1`` the step
reducer emits it as :class:`~metricbus.column_states.ColumnStates` emits one worker's commit: each metric that
keeps one kind from the rank to the step level emits that kind of its column, for all of them at once, bit for bit
what the Summary gives.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from metricbus.micro_columns import MicroUpdate
from metricbus.summary import Summary


class RankedColumns(Mapping[str, tuple[Summary | None, ...]]):
    """Each of ``names`` merged across the ranks: ``fields[:, i]`` is the ``as_tuple()`` of name ``i``'s merged
    Summary (its one column). ``version`` names the agreed layout the names and specs come from (see
    :meth:`metricbus.column_states.Layouts.of`)."""

    __slots__ = ("update", "version")

    def __init__(self, *, names: tuple[str, ...], fields: Any, version: int) -> None:
        self.update = MicroUpdate(names=names, fields=fields, others={})
        self.version = version

    def __getitem__(self, name: str) -> tuple[Summary | None, ...]:
        return (self.update[name],)

    def __iter__(self) -> Iterator[str]:
        return iter(self.update.names)

    def __len__(self) -> int:
        return len(self.update.names)

    def __contains__(self, name: object) -> bool:
        return name in self.update
