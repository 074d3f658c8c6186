"""The reduction kinds: one lookup table from tag to the function that reads a Summary."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

from metricbus.summary import Summary


def _count(s: Summary) -> float:
    return float(s.count)


KINDS: MappingProxyType[str, Callable[[Summary], float]] = MappingProxyType(
    {
        "mean": Summary.mean,
        "sum": Summary.sum,  # reads s.total: the correctly rounded exact sum (see summary's docstring)
        "min": lambda s: s.min,
        "max": lambda s: s.max,
        "first": lambda s: s.first,
        "last": lambda s: s.last,
        "count": _count,
        "std": Summary.std,
    }
)
KIND_NAMES: tuple[str, ...] = tuple(KINDS)
