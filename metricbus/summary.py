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
from typing import NamedTuple

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


# A NamedTuple rather than a frozen slotted dataclass: it is just as immutable and slotted, but building one is
# ~4x cheaper (tuple.__new__ instead of twelve object.__setattr__ calls), and a commit builds several per metric.
class Summary(NamedTuple):
    """Sufficient statistics of weighted records ``(x_i, w_i)`` in log order.

    Fields: ``count`` records; ``weight`` = Σw; ``wsum`` = Σw·x; ``total`` = Σx (each with a ``*_lo`` remainder);
    ``m2`` = Σw·(x − mean)²; ``min``/``max``; ``first``/``last`` value. The empty summary is the identity of merge.
    """

    count: int = 0  # type: ignore[assignment]  # shadows tuple.count on purpose: the field holds the count
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
        m2 = 0.0 if value - value == 0.0 else _NAN
        return _new(Summary, (1, 1.0, 0.0, value, 0.0, value, 0.0, m2, value, value, value, value))

    @staticmethod
    def of_batch(values: list[float], weights: list[float] | None) -> Summary:
        """Summarise records (``weights`` None means weight 1 each). ``values`` must be non-empty."""
        n = len(values)
        if weights is None:
            if n == 1:
                return Summary.of_value(values[0])
            try:  # dd_sum inlined: this is the per-metric cost of every commit
                total = math.fsum(values)
                total_lo = math.fsum([*values, -total]) if total - total == 0.0 else 0.0
            except (ValueError, OverflowError):
                total, total_lo = dd_sum(values)
        else:
            total, total_lo = dd_sum(values)
        if weights is None:
            weight, weight_lo = float(n), 0.0
            wsum, wsum_lo = total, total_lo
            # Finite data: two-pass m2 around the correctly rounded mean. math.dist is the accurate C loop for
            # sqrt(sum((x - mean)**2)) (~1 ulp), half the cost of fsum over a list of squares.
            m2 = math.dist(values, [total / n] * n) ** 2 if total - total == 0.0 else _NAN
        else:
            weight, weight_lo = dd_sum(weights)
            wsum, wsum_lo = dd_sum([w * x for w, x in zip(weights, values, strict=False)])
            if n == 1:
                m2 = 0.0 if math.isfinite(values[0]) else _NAN
            else:
                mean = (wsum + wsum_lo) / weight if weight > 0 else 0.0
                m2 = _fsum_or_nan([w * (x - mean) * (x - mean) for w, x in zip(weights, values, strict=False)])
        if total == total:  # noqa: PLR0124  (x == x is the cheapest not-NaN test, on the hot path)
            if n <= 32:  # sorting a few floats is cheaper than min() plus max()
                ordered = sorted(values)
                lowest, highest = ordered[0], ordered[-1]
            else:
                lowest, highest = min(values), max(values)
        else:  # a NaN is present (or inf - inf): min/max of a set with NaN is NaN, never order-dependent
            has_nan = any(math.isnan(x) for x in values)
            lowest = _NAN if has_nan else min(values)
            highest = _NAN if has_nan else max(values)
        return _new(
            Summary,
            (n, weight, weight_lo, wsum, wsum_lo, total, total_lo, m2, lowest, highest, values[0], values[-1]),
        )

    def merge(self, other: Summary) -> Summary:
        """Combine with the records of ``other``, which come after this summary's records."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        weight, weight_lo = _dd_add(self.weight, self.weight_lo, other.weight, other.weight_lo)
        wsum, wsum_lo = _dd_add(self.wsum, self.wsum_lo, other.wsum, other.wsum_lo)
        total, total_lo = _dd_add(self.total, self.total_lo, other.total, other.total_lo)
        w_a, w_b = self.weight + self.weight_lo, other.weight + other.weight_lo
        if w_a > 0 and w_b > 0:
            # The means' difference in double-double: for data with a large mean and a tiny spread, the plain
            # difference of two rounded means loses most of its digits (and delta² enters m2 directly).
            a_hi, a_lo = _dd_div(self.wsum, self.wsum_lo, self.weight, self.weight_lo)
            b_hi, b_lo = _dd_div(other.wsum, other.wsum_lo, other.weight, other.weight_lo)
            delta = (b_hi - a_hi) + (b_lo - a_lo)
            m2 = self.m2 + other.m2 + delta * delta * (w_a * w_b / (w_a + w_b))
        else:
            m2 = self.m2 + other.m2
        return _new(
            Summary,
            (
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
            ),
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
_new = tuple.__new__  # builds a Summary from a ready tuple without NamedTuple's argument parsing


def _dd_add(a: float, a_lo: float, b: float, b_lo: float) -> tuple[float, float]:
    """``dd_sum((a, a_lo, b, b_lo))``, skipping fsum in the common case where both remainders are zero."""
    if a_lo == 0.0 and b_lo == 0.0:
        hi = a + b
        if hi - hi == 0.0:  # finite: TwoSum gives the exact remainder
            bb = hi - a
            return hi, (a - (hi - bb)) + (b - bb)
        return hi, 0.0
    return dd_sum((a, a_lo, b, b_lo))


_SPLIT = 134217729.0  # 2**27 + 1, Dekker's splitter for float64


def _two_product(a: float, b: float) -> tuple[float, float]:
    """``(p, e)`` with ``p = fl(a*b)`` and ``a*b = p + e`` exactly (Dekker; no fma in Python 3.11)."""
    p = a * b
    c = _SPLIT * a
    a_hi = c - (c - a)
    a_lo = a - a_hi
    c = _SPLIT * b
    b_hi = c - (c - b)
    b_lo = b - b_hi
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def _dd_div(num: float, num_lo: float, den: float, den_lo: float) -> tuple[float, float]:
    """``(num + num_lo) / (den + den_lo)`` as a double-double ``(q, q_lo)``; ``den`` > 0."""
    q = num / den
    if q - q != 0.0 or abs(q) > 1e290 or abs(den) > 1e290:  # non-finite, or the split would overflow
        return q, 0.0
    p, e = _two_product(q, den)
    return q, (((num - p) - e) + num_lo - q * den_lo) / den


def _fsum_or_nan(parts: list[float]) -> float:
    try:
        return math.fsum(parts)
    except (ValueError, OverflowError):
        return _NAN


def _nan_min(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return _NAN
    return a if a <= b else b


def _nan_max(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return _NAN
    return a if a >= b else b
