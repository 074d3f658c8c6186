"""``Summary``: the one mergeable state, holding sufficient statistics of a set of weighted records.

Every kind (mean, sum, min, max, first, last, count, std) is a function of a Summary, so one state serves all
kinds, every level, the rank exchange and the journal. (STYLE.md suggests a state type per kind; one universal
state is simpler here because the journal must keep every statistic anyway, so re-aggregation with another kind
is possible.)

The three sums (weight Σw, wsum Σw·x, total Σx) are exact: each is held as the greedy components of
:mod:`metricbus.exact` — ``hi`` (the field itself), ``lo`` (the ``*_lo`` field), then any further components in
``rest``. Within the double range ``hi`` IS the correctly rounded exact sum and ``lo`` the correctly rounded
remainder; a double-double is almost always enough, so ``rest`` is ``()`` unless some sum needs a third component
(``[1e16, 1, 1e-20]``) or lies beyond the double range (then ``hi`` is ±MAX, all components are finite and sum
exactly to it). ``rest`` is then ``(rest_of_weight, rest_of_wsum, rest_of_total)``. Data with a NaN or an infinity
has, for each sum it reaches, ``hi`` = the IEEE sum of its non-finite terms and ``lo`` = 0: NaN propagates and inf
sums as IEEE says, whatever the split. Hence ``sum`` and ``mean`` are the correctly rounded exact values under any
split into batches and any merge grouping. (Σw·x is exact per record as ``fl(w·x)`` plus its rounded remainder:
see :func:`metricbus.exact.products`.)

``m2`` (weighted sum of squared deviations from the mean) merges with Chan et al.'s pairwise update, which is
stable for data with a large mean and a tiny spread; one that overflows is inf, and no finite data raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter
from typing import NamedTuple

from metricbus import exact, signed_zero
from metricbus.sketch import Sketch, unknown

_INF = math.inf
_NAN = math.nan
_MAX = exact.MAX
_least, _greatest = signed_zero.least, signed_zero.greatest  # min and max with -0.0 below +0.0
_fsum = math.fsum
Rest = tuple[tuple[float, ...], ...]


# A NamedTuple rather than a frozen slotted dataclass: it is just as immutable and slotted, but building one is
# ~4x cheaper (tuple.__new__ instead of thirteen object.__setattr__ calls), and a commit builds several per metric.
class Summary(NamedTuple):
    """Sufficient statistics of weighted records ``(x_i, w_i)`` in log order.

    Fields: ``count`` records; ``weight`` = Σw; ``wsum`` = Σw·x; ``total`` = Σx (each with a ``*_lo`` remainder and
    further exact components in ``rest``, see the module docstring); ``m2`` = Σw·(x − mean)²; ``min``/``max``;
    ``first``/``last`` value. The empty summary is the identity of merge.
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
    rest: Rest = ()
    sketch: Sketch | None = None  # the records' bucket counts, where a distribution kind reads them (kinds.py)

    @staticmethod
    def of_value(value: float) -> Summary:
        """A summary of one unit-weight record."""
        m2 = 0.0 if value - value == 0.0 else _NAN
        return _new(Summary, (1, 1.0, 0.0, value, 0.0, value, 0.0, m2, value, value, value, value, (), None))

    @staticmethod
    def of_batch(values: list[float], weights: list[float] | None) -> Summary:
        """Summarise records (``weights`` None means weight 1 each). ``values`` must be non-empty."""
        n = len(values)
        rest: Rest
        if weights is not None and weights.count(1.0) == n:  # unit weights (a metric that got a weight later)
            weights = None
        if weights is None:
            if n == 1:
                return Summary.of_value(values[0])
            # exact.components inlined for the hot path: nearly always the exact sum is (hi, lo), which two fsums
            # give (a third one checks that nothing is left when lo != 0). total_lo NaN: take the general path.
            try:
                total = _fsum(values)
                if total == 0.0:  # an exact zero: -0.0 only if every record is (IEEE's sign, signed_zero.of_sum)
                    total = signed_zero.of_sum(values)
                total_lo = _fsum([*values, -total])
                if total_lo != 0.0 and _fsum([*values, -total, -total_lo]) != 0.0:
                    total_lo = _NAN
            except (ValueError, OverflowError):
                total_lo = _NAN
            if total_lo == total_lo:  # noqa: PLR0124  (not NaN: (hi, lo) of finite data within the range)
                # Two-pass m2 around the mean. math.dist is the accurate C loop for sqrt(sum((x - mean)**2))
                # (~1 ulp), half the cost of fsum over a list of squares; d * d (not d ** 2, which raises)
                # overflows to inf.
                mean = total / n
                d = math.dist(values, [mean] * n)
                m2, rest = d * d, ()
                if m2 <= n * mean * mean * NEAR and m2:  # a spread tiny next to the mean: see near_mean_m2
                    m2 = near_mean_m2(values, None, (total, total_lo), (float(n), 0.0))
            else:  # three or more components, beyond the double range, or non-finite data
                total, total_lo, m2, rest = _unweighted_general(values)
            weight, weight_lo, wsum, wsum_lo = float(n), 0.0, total, total_lo
        else:
            weight, weight_lo, rest_w = split_parts(exact.components(weights))
            wsum, wsum_lo, rest_ws = split_parts(exact.components(exact.products(weights, values)))
            total, total_lo, rest_t = split_parts(exact.components(values))
            m2 = _weighted_m2(values, weights, (weight, weight_lo, *rest_w), (wsum, wsum_lo, *rest_ws), total)
            rest = (rest_w, rest_ws, rest_t) if rest_w or rest_ws or rest_t else ()
        if total == total:  # noqa: PLR0124  (x == x is the cheapest not-NaN test, on the hot path)
            if n <= 32:  # sorting a few floats is cheaper than min() plus max()
                ordered = sorted(values)
                lowest, highest = ordered[0], ordered[-1]
                if lowest == 0.0 or highest == 0.0:  # which zero: -0.0 below +0.0 (signed_zero)
                    lowest, highest = signed_zero.of_sorted(ordered)
            else:
                lowest, highest = min(values), max(values)
                if lowest == 0.0 or highest == 0.0:
                    lowest, highest = signed_zero.of_values(values, lowest, highest)
        else:  # a NaN is present (or inf - inf): min/max of a set with NaN is NaN, never order-dependent
            has_nan = any(math.isnan(x) for x in values)
            lowest = _NAN if has_nan else min(values)
            highest = _NAN if has_nan else max(values)
            if not has_nan:
                lowest, highest = signed_zero.of_values(values, lowest, highest)
        return _new(
            Summary,
            (n, weight, weight_lo, wsum, wsum_lo, total, total_lo, m2, lowest, highest, values[0], values[-1], rest, None),  # noqa: E501
        )

    def merge(self, other: Summary) -> Summary:
        """Combine with the records of ``other``, which come after this summary's records."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        if self.rest or other.rest:
            a, b = self.rest or _NO_REST, other.rest or _NO_REST
            w_rests, ws_rests, t_rests = (a[0], b[0]), (a[1], b[1]), (a[2], b[2])
        else:
            w_rests = ws_rests = t_rests = _NO_RESTS
        weight, weight_lo, rest_w = _add(self.weight, self.weight_lo, other.weight, other.weight_lo, w_rests)
        wsum, wsum_lo, rest_ws = _add(self.wsum, self.wsum_lo, other.wsum, other.wsum_lo, ws_rests)
        total, total_lo, rest_t = _add(self.total, self.total_lo, other.total, other.total_lo, t_rests)
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
                _chan_m2(self, other),
                _least(self.min, other.min),
                _greatest(self.max, other.max),
                self.first,
                other.last,
                (rest_w, rest_ws, rest_t) if rest_w or rest_ws or rest_t else (),
                _merge_sketches(self, other) if self.sketch is not None or other.sketch is not None else None,
            ),
        )

    def sum(self) -> float:
        """Σx, correctly rounded (±inf beyond the double range)."""
        total = self.total
        if -_MAX < total < _MAX:  # within the range, hi is the correctly rounded sum
            return total
        return exact.value(self._parts(2))

    def mean(self) -> float:
        """Weighted mean Σw·x / Σw, correctly rounded (NaN when the weight is 0)."""
        weight, wsum_lo = self.weight, self.wsum_lo
        if self.weight_lo == 0.0:
            if wsum_lo == 0.0:  # one component each: one IEEE division is correctly rounded
                return self.wsum / weight if weight != 0.0 else _NAN
            if not self.rest or not self.rest[1]:  # Σw·x = wsum + wsum_lo exactly: try the quick path
                quick = exact.divide_by_count(self.wsum, wsum_lo, weight)
                if quick is not None:
                    return quick
        return exact.divide(self._parts(1), self._parts(0))

    def std(self) -> float:
        """Weighted population standard deviation sqrt(m2 / Σw)."""
        m2, weight = self.m2, self.weight
        if not weight > 0.0 or m2 != m2:  # noqa: PLR0124  (NaN test)
            return _NAN
        m2 = max(m2, 0.0)
        ratio = m2 / weight if weight < _MAX else exact.divide((m2,), self._parts(0))
        if ratio == _INF and m2 < _INF:  # a tiny weight: the quotient overflows, its square root need not
            return math.sqrt(m2) / math.sqrt(weight)
        return math.sqrt(ratio)

    def as_tuple(self) -> tuple[float, ...]:
        """The 12 fixed fields in declaration order (for packing into a buffer or a journal line)."""
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

    def rest_flat(self) -> tuple[float, ...]:
        """``rest`` and ``sketch`` as floats: ``()``, or ``(len_w, len_ws, len_t, *w, *ws, *t, *sketch)`` where
        ``sketch`` is ``Sketch.to_ints()`` (absent without a sketch; integers below 2**53 are exact as floats)."""
        sketch = self.sketch
        if not self.rest:
            return () if sketch is None else (0.0, 0.0, 0.0, *map(float, sketch.to_ints()))
        w, ws, t = self.rest
        head = (float(len(w)), float(len(ws)), float(len(t)), *w, *ws, *t)
        return head if sketch is None else (*head, *map(float, sketch.to_ints()))

    @staticmethod
    def from_tuple(fields: Sequence[float], rest_flat: Sequence[float] = ()) -> Summary:
        """Inverse of :meth:`as_tuple` and :meth:`rest_flat`."""
        if len(fields) != N_FIELDS:
            raise ValueError(f"a Summary has {N_FIELDS} fields, got {len(fields)}")
        rest: Rest = ()
        sketch = None
        if len(rest_flat):
            sizes, end = rest_layout(rest_flat)
            start = 3
            parts = []
            for size in sizes:
                parts.append(tuple(float(f) for f in rest_flat[start : start + size]))
                start += size
            rest = tuple(parts) if end > 3 else ()
            if end < len(rest_flat):
                sketch = Sketch.from_ints(rest_flat[end:])
        return _new(Summary, (int(fields[0]), *(float(f) for f in fields[1:]), rest, sketch))

    def _parts(self, which: int) -> tuple[float, ...]:
        """The components of weight (0), wsum (1) or total (2)."""
        hi, lo = _HI_LO[which](self)
        if lo == 0.0:  # lo == 0 leaves nothing in rest
            return (hi,)
        return (hi, lo, *self.rest[which]) if self.rest else (hi, lo)


N_FIELDS = 12
# A two-pass m2 up to W·mean²·NEAR (std below ~3e-8 of the mean; inf where the mean is huge) may be off in its
# leading digits: the rounded mean's error enters it squared. It is taken again (near_mean_m2); above it, that error
# is below ~2**-54 of m2.
NEAR = 2.0**-50
SKETCH = 13  # the sketch's index in the tuple
EMPTY = Summary()
_NO_REST: Rest = ((), (), ())
_NO_RESTS: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
_HI_LO = (attrgetter("weight", "weight_lo"), attrgetter("wsum", "wsum_lo"), attrgetter("total", "total_lo"))
_new = tuple.__new__  # builds a Summary from a ready tuple without NamedTuple's argument parsing


def rest_layout(rest_flat: Sequence[float]) -> tuple[list[int], int]:
    """The three component counts of a :meth:`Summary.rest_flat` and where its sketch starts; raise ValueError if
    the lengths do not agree (what a reader checks without building the Summary)."""
    sizes = [int(f) for f in rest_flat[:3]]
    end = 3 + sum(sizes)
    if len(sizes) != 3 or min(sizes) < 0 or end > len(rest_flat):
        raise ValueError(f"a Summary's rest is (len_w, len_ws, len_t, *parts), got {len(rest_flat)} floats")
    if end < len(rest_flat):
        head = [int(f) for f in rest_flat[end : end + 8]]
        if len(head) < 8 or min(head[5], head[7]) < 0 or end + 8 + head[5] + head[7] != len(rest_flat):
            raise ValueError(f"a Summary's sketch is 8 integers and its counts, got {len(rest_flat) - end} floats")
    return sizes, end


def split_parts(parts: tuple[float, ...]) -> tuple[float, float, tuple[float, ...]]:
    """Components as ``(hi, lo, rest)``."""
    return parts[0], (parts[1] if len(parts) > 1 else 0.0), parts[2:]


def _add(
    a: float, a_lo: float, b: float, b_lo: float, rests: tuple[tuple[float, ...], tuple[float, ...]]
) -> tuple[float, float, tuple[float, ...]]:
    """The components of the sum of two exact sums ``(a, a_lo, *rests[0])`` and ``(b, b_lo, *rests[1])``.

    TwoSum in the common case of one component each; fsum (exact.components inlined) for two double-doubles.
    """
    if a_lo == 0.0 and b_lo == 0.0:  # one component each (lo == 0 leaves nothing in rest)
        hi = a + b
        if hi - hi == 0.0:  # finite: TwoSum gives the exact remainder, so (hi, lo) is already canonical
            bb = hi - a
            lo = (a - (hi - bb)) + (b - bb)
            if lo - lo == 0.0:  # (hi - a overflows for a finite sum near ±MAX of opposite signs: exact.add)
                return hi, lo, ()
        if a - a != 0.0 or b - b != 0.0:  # non-finite data: IEEE
            return hi, 0.0, ()
    elif not rests[0] and not rests[1]:
        parts = [a, a_lo, b, b_lo]
        try:
            hi = _fsum(parts)
            parts.append(-hi)
            lo = _fsum(parts)
            parts.append(-lo)
            if _fsum(parts) == 0.0:  # nothing left: (hi, lo) is canonical
                return hi, lo, ()
        except (ValueError, OverflowError):  # beyond the range, or non-finite data
            pass
    return split_parts(exact.add((a, a_lo, *rests[0]), (b, b_lo, *rests[1])))


def _unweighted_general(values: list[float]) -> tuple[float, float, float, Rest]:
    """``(total, total_lo, m2, rest)`` of unit-weight records whose sum is not a double-double within the range."""
    total, total_lo, rest_t = split_parts(exact.components(values))
    if total - total != 0.0:  # non-finite data
        return total, total_lo, _NAN, ()
    mean = total / len(values) if -_MAX < total < _MAX else exact.divide((total, total_lo, *rest_t), (len(values),))
    d = math.dist(values, [mean] * len(values))
    return total, total_lo, d * d, ((), rest_t, rest_t) if rest_t else ()


def _weighted_m2(
    values: list[float], weights: list[float], weight: tuple[float, ...], wsum: tuple[float, ...], total: float
) -> float:
    """Two-pass Σw·(x − mean)² of finite data (NaN for non-finite data, inf where it overflows)."""
    if total - total != 0.0:
        return _NAN
    if weight[0] == 0.0:
        return 0.0
    # Within the range one division is within an ulp of the exact mean: plenty for the second pass.
    mean = wsum[0] / weight[0] if -_MAX < wsum[0] < _MAX and weight[0] < _MAX else exact.divide(wsum, weight)
    if mean - mean != 0.0:  # a product w·x overflowed: so does the second moment
        return _INF
    # Zero weights are skipped: 0 * inf would be NaN where x - mean overflows.
    terms = [w * (x - mean) * (x - mean) for w, x in zip(weights, values, strict=True) if w]
    try:
        m2 = _fsum(terms)
    except OverflowError:  # non-negative terms: an intermediate overflow means the sum overflows
        return _INF
    if m2 <= weight[0] * mean * mean * NEAR and m2:
        return near_mean_m2(values, weights, wsum, weight)
    return m2


def near_mean_m2(
    values: Sequence[float], weights: Sequence[float] | None, num: tuple[float, ...], den: tuple[float, ...]
) -> float:
    """Σw·(x − μ)² of finite records whose spread is tiny next to their mean μ = num / den (exact components;
    ``den`` > 0), or whose two-pass m2 overflowed around a huge mean: there the two-pass sum around a rounded mean q
    is off by W·(μ − q)², up to all of it (mean 1e9 and spread 1e-6: 1e-4 relative; records all equal: ~1e-17
    instead of 0; one record of 1e300 weighted by 7: inf). Taken around the correctly rounded mean (records all
    equal give their value), less W·(μ − mean)² from the mean's remainder in double-double (that subtraction cannot
    cancel: W·(μ − mean)² is at most the true m2 plus it)."""
    mean = exact.divide(num, den)
    off = 0.0  # μ - mean, to ~2**-100 of μ (left 0 where the double-double could overflow: it is below ulp(mean))
    if abs(mean) < 1e290 and 1e-290 < den[0] < 1e290 and abs(num[0]) < 1e300:
        q, q_lo = _dd_div(num[0], _fsum(num[1:]), den[0], _fsum(den[1:]))  # (a third component or more: ~2**-106)
        off = (q - mean) + q_lo
    if weights is None:
        d = math.dist(values, [mean] * len(values))
        around = d * d
    else:
        try:
            around = _fsum([w * (x - mean) * (x - mean) for w, x in zip(weights, values, strict=True) if w])
        except OverflowError:
            return _INF
    less = den[0] * off * off
    return max(around - less, 0.0) if less < _INF else around


def _chan_m2(a: Summary, b: Summary) -> float:
    """m2 of the union: ``m2_a + m2_b + δ²·w_a·w_b / (w_a + w_b)``, δ the difference of the means."""
    w_a, w_b = a.weight, b.weight
    if not (w_a > 0.0 and w_b > 0.0):
        return a.m2 + b.m2
    # The means' difference in double-double: for data with a large mean and a tiny spread, the plain difference
    # of two rounded means loses most of its digits (and delta² enters m2 directly).
    a_hi, a_lo = _mean_dd(a)
    b_hi, b_lo = _mean_dd(b)
    delta = (b_hi - a_hi) + (b_lo - a_lo)
    between = delta * delta * (w_a * w_b / (w_a + w_b))
    if between - between != 0.0:  # inf or NaN: an overflow (or underflow times inf) on the way, or non-finite data
        between = _between_robust(a, b)
    return a.m2 + b.m2 + between


def _between_robust(a: Summary, b: Summary) -> float:
    """``δ²·w_a·w_b / (w_a + w_b)`` without a spurious overflow or underflow: (2·(δ/2)·sqrt(factor))²."""
    half_delta = 0.5 * b.mean() - 0.5 * a.mean()
    if half_delta - half_delta != 0.0:  # a product w·x overflowed (finite data) or non-finite data (m2 is NaN)
        return _INF
    small, large = sorted((a.weight, b.weight))
    both = small + large
    share = large / both if both < _INF else (0.5 * large) / (0.5 * small + 0.5 * large)  # in [0.5, 1]
    t = half_delta * (math.sqrt(small) * math.sqrt(share))
    return 4.0 * t * t


def _mean_dd(s: Summary) -> tuple[float, float]:
    """The mean as a double-double (to ~2**-100, which ``rest`` cannot change), for Chan's delta."""
    if -_MAX < s.wsum < _MAX and s.weight < _MAX:
        return _dd_div(s.wsum, s.wsum_lo, s.weight, s.weight_lo)
    return s.mean(), 0.0  # beyond the double range, hi and lo say little: the exact mean




def _dd_div(num: float, num_lo: float, den: float, den_lo: float) -> tuple[float, float]:
    """``(num + num_lo) / (den + den_lo)`` as a double-double ``(q, q_lo)``; ``den`` > 0."""
    q = num / den
    if q - q != 0.0 or abs(q) > 1e290 or den > 1e290 or den < 1e-290:  # non-finite, or the split would overflow
        return q, 0.0
    p, e = exact.two_product(q, den)
    return q, (((num - p) - e) + num_lo - q * den_lo) / den


def _merge_sketches(a: Summary, b: Summary) -> Sketch:
    """The sketch of both (one has one): the other's records, if it has none, count as unknown (NaN)."""
    return (a.sketch or unknown(a.count)).merge(b.sketch or unknown(b.count))


def with_sketch(summary: Summary, sketch: Sketch | None) -> Summary:
    """``summary`` carrying ``sketch``."""
    return _new(Summary, (*summary[:SKETCH], sketch))
