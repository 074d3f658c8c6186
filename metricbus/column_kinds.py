"""The fixed kinds read from arrays of merged Summary fields, each with the mask of the elements it settled.

Replay's columnar path (:mod:`metricbus.replay_columns`) holds the rank-level results of many commits and metrics
as arrays. Each kind here computes, with numpy, the bits :data:`metricbus.kinds.KINDS` computes from a Summary,
where that takes the same IEEE operations in the same order (``mean`` as one division, or
:func:`metricbus.exact.divide_by_count`'s two candidate checks; ``std``'s plain branch); elsewhere (a tie in the
division, a zero weight, a quotient near the ends of the range, a merged second moment) the element is left unsettled
and the caller computes it with the scalar kind. Inputs are finite: the caller settles nothing else here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from metricbus import exact
from metricbus.fixed import Array

_SPLIT = 134217729.0  # 2**27 + 1, as exact.two_product splits
_COUNT_LIMIT = 2.0**26  # divide_by_count's bounds (see its docstring)
_QUOTIENT_LOW = 2.0**-960
_QUOTIENT_HIGH = 2.0**900


@dataclass(frozen=True, slots=True)
class Merged:
    """Rank-level results as arrays of one shape: the Summary fields the kinds read (``m2`` None: not merged)."""

    count: Array
    weight: Array
    weight_lo: Array
    wsum: Array
    wsum_lo: Array
    total: Array
    m2: Array | None
    min: Array
    max: Array
    first: Array
    last: Array


Settled = tuple[Array, Array]  # (values, the mask of the elements whose value is final)
ColumnKind = Callable[[Merged], Settled]


def _all(m: Merged, values: Array) -> Settled:
    return values, np.ones(values.shape, dtype=bool)


def mean(m: Merged) -> Settled:
    """:meth:`Summary.mean` where one division, or divide_by_count's quick path, decides it."""
    single = (m.weight_lo == 0.0) & (m.weight != 0.0)
    with np.errstate(all="ignore"):
        out = m.wsum / m.weight
    done = single & (m.wsum_lo == 0.0)
    rest = single & ~done
    if rest.any():
        quick, found = divide_by_count(m.wsum[rest], m.wsum_lo[rest], m.weight[rest])
        out[rest] = quick
        done[rest] = found
    return out, done


def divide_by_count(hi: Array, lo: Array, count: Array) -> Settled:
    """:func:`metricbus.exact.divide_by_count` elementwise, the same operations in the same order; a tie (rounded
    to even there) and a None there are left unsettled."""
    usable = (count >= 1.0) & (count < _COUNT_LIMIT) & (count == np.floor(count))
    with np.errstate(all="ignore"):
        q = hi / count
        power = np.frexp(count)[0] == 0.5
        done = usable & power & _in_range(q)  # shifted(q, count), with ``power`` found once
        left = usable & ~power
        for _ in range(2):
            if not left.any():  # every element decided (a power-of-two count, the usual case, or none usable)
                break
            left &= _in_range(q)
            c = _SPLIT * q
            q_hi = c - (c - q)
            rho = (hi - q_hi * count) - (q - q_hi) * count
            off = rho + lo
            up = (np.nextafter(q, np.inf) - q) * 0.5 * count
            down = (np.nextafter(q, -np.inf) - q) * 0.5 * count
            inside = left & (down < off) & (off < up)
            done |= inside
            left &= ~inside & (off != up) & (off != down)
            q = np.where(left, q + off / count, q)
    return q, done


def shifted(q: Array, count: Array) -> Array:
    """Where ``q = hi / count`` is the correctly rounded ``(hi + lo) / count`` because ``count`` is a power of two
    (the division only shifts the exponent of the correctly rounded ``hi``, away from the ends of the range):
    divide_by_count's quick answer."""
    return (np.frexp(count)[0] == 0.5) & _in_range(q)


def _in_range(q: Array) -> Array:
    a = np.abs(q)
    return (a > _QUOTIENT_LOW) & (a < _QUOTIENT_HIGH)


def std(m: Merged) -> Settled:
    """:meth:`Summary.std`'s plain branch (a positive weight below MAX, a quotient that does not overflow)."""
    if m.m2 is None:
        return np.zeros(m.count.shape), np.zeros(m.count.shape, dtype=bool)
    m2 = np.where(m.m2 < 0.0, 0.0, m.m2)  # max(m2, 0.0): a -0.0 stays
    with np.errstate(all="ignore"):
        ratio = m2 / m.weight
        out = np.sqrt(ratio)
    done = (m.weight > 0.0) & (m.weight < exact.MAX) & ~np.isnan(m.m2) & (ratio < np.inf)
    return out, done


def _sum(m: Merged) -> Settled:
    """:meth:`Summary.sum`: inside the double range ``total`` is the correctly rounded sum; at ±MAX the exact sum
    may lie beyond it (then it is ±inf), which the scalar kind decides."""
    return m.total, np.abs(m.total) < exact.MAX


def _count(m: Merged) -> Settled:
    return _all(m, m.count)


COLUMN_KINDS: MappingProxyType[str, ColumnKind] = MappingProxyType(
    {
        "mean": mean,
        "sum": _sum,
        "min": lambda m: _all(m, m.min),
        "max": lambda m: _all(m, m.max),
        "first": lambda m: _all(m, m.first),
        "last": lambda m: _all(m, m.last),
        "count": _count,
        "std": std,
    }
)
