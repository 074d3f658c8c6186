"""The reduction kinds: one lookup table from tag to the function that reads a Summary."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

from metricbus.summary import Summary


def _sum(s: Summary) -> float:
    return s.total + s.total_lo


def _count(s: Summary) -> float:
    return float(s.count)


KINDS: MappingProxyType[str, Callable[[Summary], float]] = MappingProxyType(
    {
        "mean": Summary.mean,
        "sum": _sum,
        "min": lambda s: s.min,
        "max": lambda s: s.max,
        "first": lambda s: s.first,
        "last": lambda s: s.last,
        "count": _count,
        "std": Summary.std,
    }
)
KIND_NAMES: tuple[str, ...] = tuple(KINDS)
# Kinds whose result does not depend on how the records were split (merge of any split == reduce of the whole),
# for records split in order. ``last`` is the exception across workers: it takes the lowest-ranked worker's last
# record (workers run side by side), so it is split-invariant over micro-batches and commits only.
SPLIT_INVARIANT: frozenset[str] = frozenset(KIND_NAMES) - {"last"}
