"""The update level of a worker in columns: several updates' micro summaries merged at once, bit for bit.

A commit of several optimizer updates whose every metric keeps one kind from the micro to the update level (the
state key ``""``: ``mean``, ``sum``, ``std``, ``min``, ``max``, ``count``, ``first``, ``last``) merges each metric's
per-update Summaries in update order (:meth:`Summary.merge <metricbus.summary.Summary.merge>`). When every update
is held in columns with the same names (:class:`~metricbus.micro_columns.MicroUpdate`), :func:`merge_columns`
does that merge for every metric at once with the same floating-point operations in the same order, so each field
is the one ``Summary.merge`` gives, bit for bit:

- each exact sum (``weight``, ``wsum``, ``total`` with their ``*_lo``): TwoSum where both remainders are zero; else
  the sum of the two double-doubles by error-free transformations, kept where it is exactly a double-double whose
  head is the correctly rounded sum (what ``math.fsum`` gives);
- ``m2`` by Chan's formula with the means as double-doubles (Dekker's product: ``exact.two_product`` on arrays);
- ``min``/``max`` with NaN propagated and ``-0.0`` below ``+0.0`` (:mod:`metricbus.signed_zero`), ``first`` of the
  first, ``last`` of the last, counts added.

A metric where a branch of ``Summary.merge`` has no column form (a sum that overflows or needs a third component, a
zero from ``fsum``, a mean beyond the double range, Chan's term overflowing, a NaN among the sums or m2, whose
payload an addition keeps as the compiler chose) is merged by ``Summary.merge`` itself;
if that merge gives a Summary with components beyond the columns, :func:`merge_columns` returns None and the caller
takes the per-metric path.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from metricbus import signed_zero
from metricbus.exact import two_product
from metricbus.summary import N_FIELDS, Summary

_MAX = 1.7976931348623157e308
_SAFE = 2.0**1000  # below this no error-free transformation of two sums overflows
_FSUM_ZERO = math.fsum([1.0, -1.0])  # what fsum gives for a sum that cancels to 0 (+0.0)
COUNT, WEIGHT, WEIGHT_LO, WSUM, WSUM_LO, TOTAL, TOTAL_LO, M2, MIN, MAX, FIRST, LAST = range(N_FIELDS)
_HI, _LO = [WEIGHT, WSUM, TOTAL], [WEIGHT_LO, WSUM_LO, TOTAL_LO]
_NAN_CHECKED = [WEIGHT, WEIGHT_LO, WSUM, WSUM_LO, TOTAL, TOTAL_LO, M2]


def merge_columns(a: Any, b: Any) -> Any:
    """The fields of ``Summary.merge`` of each column of ``a`` with the same column of ``b`` (``(N_FIELDS, n)``
    float64 arrays of Summaries without rests or sketches, ``b``'s records after ``a``'s), or None where a merged
    Summary would need components the columns do not hold."""
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        # the three exact sums at once: rows (weight, wsum, total) and their remainders
        out[_HI], out[_LO], bad = _add(a[_HI], a[_LO], b[_HI], b[_LO])
        out[M2], slow = _chan_m2(a, b)
        slow |= bad.any(axis=0)
        out[COUNT] = a[COUNT] + b[COUNT]
        out[MIN] = signed_zero.pairs(a[MIN], b[MIN], minimum=True)
        out[MAX] = signed_zero.pairs(a[MAX], b[MAX], minimum=False)
        out[FIRST] = a[FIRST]
        out[LAST] = b[LAST]
        # a NaN among the sums or m2: which operand's NaN an addition keeps is the compiler's choice, and numpy's
        # loops may choose otherwise than Python's float addition, so Summary.merge adds them
        slow |= np.isnan(a[_NAN_CHECKED]).any(axis=0) | np.isnan(b[_NAN_CHECKED]).any(axis=0)
    empty_a, empty_b = a[COUNT] == 0, b[COUNT] == 0  # merge returns the other summary itself
    if empty_a.any() or empty_b.any():
        out[:, empty_a] = b[:, empty_a]
        out[:, empty_b] = a[:, empty_b]
        slow &= ~(empty_a | empty_b)
    for i in np.flatnonzero(slow).tolist():
        merged = Summary.from_tuple(a[:, i].tolist()).merge(Summary.from_tuple(b[:, i].tolist()))
        if merged.rest:
            return None
        out[:, i] = merged.as_tuple()
    return out


def _two_sum(a: Any, b: Any) -> tuple[Any, Any]:
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _add(a: Any, a_lo: Any, b: Any, b_lo: Any) -> tuple[Any, Any, Any]:
    """``summary._add`` of exact sums without rests, elementwise: ``(hi, lo, slow)``; ``slow`` marks the elements
    whose result is not settled here."""
    plain = (a_lo == 0.0) & (b_lo == 0.0)
    # both remainders zero: TwoSum where the sum is finite, IEEE where an input is not finite (as summary._add)
    s, e = _two_sum(a, b)
    finite = s - s == 0.0
    inputs_finite = (a - a == 0.0) & (b - b == 0.0)
    # an overflow of the sum, or of TwoSum's hi - a near ±MAX (its remainder then NaN): exact.add
    slow = plain & inputs_finite & ~(finite & (e - e == 0.0))
    # else: the four components' sum by error-free transformations (exact where nothing overflows)
    t, f = _two_sum(a_lo, b_lo)
    u, g = _two_sum(e, t)
    v, h = _two_sum(g, f)
    head, x = _two_sum(s, u)
    y, k = _two_sum(x, v)  # a + a_lo + b + b_lo == head + y + k + h exactly
    check, rest = _two_sum(head, y)
    settled = (
        (np.abs(a) < _SAFE)
        & (np.abs(b) < _SAFE)
        & (k == 0.0)
        & (h == 0.0)  # the sum is head + y exactly
        & (check == head)
        & (rest == y)  # head is the sum correctly rounded, y the exact remainder: what fsum gives
        & (head != 0.0)  # a sum of 0 (and its sign) is left to fsum
    )
    hi = np.where(plain, s, head)
    lo = np.where(plain, np.where(finite, e, 0.0), np.where(y == 0.0, _FSUM_ZERO, y))  # 0: fsum's zero
    return hi, lo, slow | (~plain & ~settled)


def _chan_m2(a: Any, b: Any) -> tuple[Any, Any]:
    """``summary._chan_m2`` per column: ``(m2, slow)``."""
    w_a, w_b = a[WEIGHT], b[WEIGHT]
    both = (w_a > 0.0) & (w_b > 0.0)
    (a_hi, b_hi), (a_lo, b_lo), slow = _mean_dd(*(np.stack((a[i], b[i])) for i in (WSUM, WSUM_LO, WEIGHT, WEIGHT_LO)))
    delta = (b_hi - a_hi) + (b_lo - a_lo)
    between = delta * delta * (w_a * w_b / (w_a + w_b))
    overflow = between - between != 0.0  # summary._between_robust
    m2 = np.where(both, a[M2] + b[M2] + between, a[M2] + b[M2])
    return m2, both & (slow[0] | slow[1] | overflow)


def _mean_dd(num: Any, num_lo: Any, den: Any, den_lo: Any) -> tuple[Any, Any, Any]:
    """``summary._mean_dd`` elementwise, of ``(wsum, wsum_lo) / (weight, weight_lo)``: ``(q, q_lo, slow)`` (slow:
    a mean beyond the double range)."""
    slow = ~((num > -_MAX) & (num < _MAX) & (den < _MAX))
    q = num / den
    plain = (q - q != 0.0) | (np.abs(q) > 1e290) | (den > 1e290) | (den < 1e-290)
    p, e = two_product(q, den)  # its arithmetic alone: elementwise on arrays
    low = (((num - p) - e) + num_lo - q * den_lo) / den
    return q, np.where(plain, 0.0, low), slow
