"""``Summary``: the one mergeable state, holding sufficient statistics of a set of weighted records.

Every kind (mean, sum, min, max, first, last, count, std) is a function of a Summary, so one state serves all
kinds, every level, the rank exchange and the journal. (STYLE.md suggests a state type per kind; one universal
state is simpler here because the journal must keep every statistic anyway, so re-aggregation with another kind
is possible.)

Sums are double-double (``hi`` + ``lo``) built with ``math.fsum``: the emitted ``sum`` and ``mean`` are the correctly
rounded values of the exact sums, so they do not depend on how the records were split into micro-batches or ranks.
``m2`` (weighted sum of squared deviations from the mean) merges with Chan et al.'s pairwise update, which is
stable for data with a large mean and a tiny spread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_INF = math.inf
_NAN = math.nan


def dd_sum(parts: Sequence[float]) -> tuple[float, float]:
    """Return ``(hi, lo)`` with ``hi`` the correctly rounded sum of ``parts`` and ``lo`` the rounded remainder."""
    try:
        hi = math.fsum(parts)
    except (ValueError, OverflowError):  # inf - inf, or an intermediate overflow: no exact sum exists
        return sum(parts), 0.0
    if not math.isfinite(hi):
        return hi, 0.0
    try:
        lo = math.fsum([*parts, -hi])
    except OverflowError:
        lo = 0.0
    return hi, lo


@dataclass(frozen=True, slots=True)
class Summary:
    """Sufficient statistics of weighted records ``(x_i, w_i)`` in log order.

    Fields: ``count`` records; ``weight`` = Σw; ``wsum`` = Σw·x; ``total`` = Σx (each with a ``*_lo`` remainder);
    ``m2`` = Σw·(x − mean)²; ``min``/``max``; ``first``/``last`` value. The empty summary is the identity of merge.
    """

    count: int = 0
    weight: float = 0.0
    weight_lo: float = 0.0
    wsum: float = 0.0
    wsum_lo: float = 0.0
    total: float = 0.0
    total_lo: float = 0.0
    m2: float = 0.0
    min: float = _INF
    max: float = -_INF
    first: float = _NAN
    last: float = _NAN

    @staticmethod
    def of_value(value: float) -> Summary:
        """A summary of one unit-weight record."""
        return Summary(1, 1.0, 0.0, value, 0.0, value, 0.0, 0.0, value, value, value, value)

    @staticmethod
    def of_batch(values: list[float], weights: list[float] | None) -> Summary:
        """Summarise records (``weights`` None means weight 1 each). ``values`` must be non-empty."""
        n = len(values)
        total, total_lo = dd_sum(values)
        if weights is None:
            weight, weight_lo = float(n), 0.0
            wsum, wsum_lo = total, total_lo
            products = values
        else:
            weight, weight_lo = dd_sum(weights)
            products = [w * x for w, x in zip(weights, values)]
            wsum, wsum_lo = dd_sum(products)
        if n == 1:
            m2 = 0.0 if math.isfinite(values[0]) else _NAN
        else:
            mean = (wsum + wsum_lo) / weight if weight > 0 else 0.0
            if weights is None:
                m2 = math.fsum([(x - mean) * (x - mean) for x in values]) if math.isfinite(total) else _NAN
            else:
                m2 = _fsum_or_nan([w * (x - mean) * (x - mean) for w, x in zip(weights, values)])
        if total == total:
            lowest, highest = min(values), max(values)
        else:  # a NaN is present (or inf - inf): min/max of a set with NaN is NaN, never order-dependent
            has_nan = any(x != x for x in values)
            lowest = _NAN if has_nan else min(values)
            highest = _NAN if has_nan else max(values)
        return Summary(n, weight, weight_lo, wsum, wsum_lo, total, total_lo, m2, lowest, highest, values[0], values[-1])

    def merge(self, other: Summary) -> Summary:
        """Combine with the records of ``other``, which come after this summary's records."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        weight, weight_lo = dd_sum((self.weight, self.weight_lo, other.weight, other.weight_lo))
        wsum, wsum_lo = dd_sum((self.wsum, self.wsum_lo, other.wsum, other.wsum_lo))
        total, total_lo = dd_sum((self.total, self.total_lo, other.total, other.total_lo))
        w_a, w_b = self.weight + self.weight_lo, other.weight + other.weight_lo
        if w_a > 0 and w_b > 0:
            delta = (other.wsum + other.wsum_lo) / w_b - (self.wsum + self.wsum_lo) / w_a
            m2 = self.m2 + other.m2 + delta * delta * (w_a * w_b / (w_a + w_b))
        else:
            m2 = self.m2 + other.m2
        return Summary(
            self.count + other.count,
            weight,
            weight_lo,
            wsum,
            wsum_lo,
            total,
            total_lo,
            m2,
            _nan_min(self.min, other.min),
            _nan_max(self.max, other.max),
            self.first,
            other.last,
        )

    def mean(self) -> float:
        """Weighted mean Σw·x / Σw (NaN when every weight is 0)."""
        weight = self.weight + self.weight_lo
        if weight == 0:
            return _NAN
        return (self.wsum + self.wsum_lo) / weight

    def std(self) -> float:
        """Weighted population standard deviation sqrt(m2 / Σw)."""
        weight = self.weight + self.weight_lo
        if weight == 0:
            return _NAN
        return math.sqrt(max(self.m2, 0.0) / weight) if self.m2 == self.m2 else _NAN

    def as_tuple(self) -> tuple[float, ...]:
        """The fields in declaration order (for packing into a buffer or a journal line)."""
        return (
            float(self.count),
            self.weight,
            self.weight_lo,
            self.wsum,
            self.wsum_lo,
            self.total,
            self.total_lo,
            self.m2,
            self.min,
            self.max,
            self.first,
            self.last,
        )

    @staticmethod
    def from_tuple(fields: Sequence[float]) -> Summary:
        """Inverse of :meth:`as_tuple`."""
        if len(fields) != N_FIELDS:
            raise ValueError(f"a Summary has {N_FIELDS} fields, got {len(fields)}")
        return Summary(int(fields[0]), *(float(f) for f in fields[1:]))


N_FIELDS = 12
EMPTY = Summary()


def _fsum_or_nan(parts: list[float]) -> float:
    try:
        return math.fsum(parts)
    except (ValueError, OverflowError):
        return _NAN


def _nan_min(a: float, b: float) -> float:
    if a != a or b != b:
        return _NAN
    return a if a <= b else b


def _nan_max(a: float, b: float) -> float:
    if a != a or b != b:
        return _NAN
    return a if a >= b else b
