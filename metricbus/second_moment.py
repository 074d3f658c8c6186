"""The second moment across workers: each worker's ``t = m2 + S²/W`` and the merged ``m2 = Σt - S²/W``.

``t`` is a double-double computed by the same numpy code on every path (so its bits do not depend on which path
reduces), with rational arithmetic for the rare rows whose double-double could overflow or underflow; ``m2``
divides exact sums in exact integer arithmetic. See :mod:`metricbus.rank_level` for the error bound.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from metricbus import exact
from metricbus.fixed import Array

_DD_SAFE = 2.0**480  # within (1/_DD_SAFE, _DD_SAFE) the double-double of t cannot overflow or underflow


def _two_prod(a: Array, b: Array) -> tuple[Array, Array]:
    p = a * b
    c = 134217729.0 * a
    a_hi = c - (c - a)
    a_lo = a - a_hi
    c = 134217729.0 * b
    b_hi = c - (c - b)
    b_lo = b - b_hi
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def t_parts(fields: Array) -> tuple[Array, Array]:
    """``t = m2 + S²/W`` of each state (``fields``: (N_FIELDS, n)) as a double-double ``(hi, lo)``."""
    w_hi, w_lo, s_hi, s_lo, m2 = fields[1], fields[2], fields[3], fields[4], fields[7]
    with np.errstate(all="ignore"):
        sq, sq_lo = _two_prod(s_hi, s_hi)
        sq_lo = sq_lo + 2.0 * s_hi * s_lo
        q1 = sq / w_hi
        p, e = _two_prod(q1, w_hi)
        q2 = (((sq - p) - e) + sq_lo - q1 * w_lo) / w_hi
        t_hi = m2 + q1
        bb = t_hi - m2
        t_lo = ((m2 - (t_hi - bb)) + (q1 - bb)) + q2
        hi = t_hi + t_lo
        lo = t_lo - (hi - t_hi)
        weightless = w_hi == 0.0
        hi = np.where(weightless, m2, hi)
        lo = np.where(weightless, 0.0, lo)
        a_s, a_w = np.abs(s_hi), np.abs(w_hi)
        risky = ~weightless & ((a_s > _DD_SAFE) | (a_w > _DD_SAFE) | (a_w < 1.0 / _DD_SAFE) | ~np.isfinite(hi))
    if risky.any():
        for i in np.flatnonzero(risky).tolist():
            hi[i], lo[i] = _t_exact(*(float(fields[f, i]) for f in (7, 3, 4, 1, 2)))
    return hi, lo


def _t_exact(m2: float, s_hi: float, s_lo: float, w_hi: float, w_lo: float) -> tuple[float, float]:
    """``t`` of one row far from 1 in magnitude, by rational arithmetic (the double-double could overflow)."""
    if not all(map(math.isfinite, (m2, s_hi, s_lo, w_hi, w_lo))):
        return math.nan if math.isnan(m2) or math.isnan(s_hi) else math.inf, 0.0
    s = Fraction(s_hi) + Fraction(s_lo)
    value = Fraction(m2) + s * s / (Fraction(w_hi) + Fraction(w_lo))
    try:
        hi = float(value)
    except OverflowError:
        return math.inf, 0.0
    if math.isinf(hi):
        return hi, 0.0
    return hi, float(value - Fraction(hi))


def m2(*, total: tuple[float, ...], weight: tuple[float, ...], wsum: tuple[float, ...], t: tuple[float, ...]) -> float:
    """``(T·W - S²)/W`` of exact sums (components), in exact integer arithmetic, correctly rounded (non-finite
    data: NaN; an overflow: inf)."""
    if not math.isfinite(total[0]):
        return math.nan
    if not (math.isfinite(t[0]) and math.isfinite(wsum[0])):
        return math.nan if math.isnan(t[0]) or math.isnan(wsum[0]) else math.inf
    t_n, t_d = exact._ratio(t)
    w_n, w_d = exact._ratio(weight)
    if w_n <= 0:
        return _quotient(t_n, t_d)
    s_n, s_d = exact._ratio(wsum)
    # T·W - S² = (t_n·w_n·s_d² - s_n²·t_d·w_d) / (t_d·w_d·s_d²); divided by W = w_n / w_d
    top = t_n * w_n * s_d * s_d - s_n * s_n * t_d * w_d
    if top <= 0:
        return 0.0
    return _quotient(top * w_d, t_d * w_d * s_d * s_d * w_n)


def _quotient(num: int, den: int) -> float:
    """``num / den`` correctly rounded (inf beyond the range)."""
    try:
        return num / den
    except OverflowError:
        return math.inf if num > 0 else -math.inf


# -- helpers -----------------------------------------------------------------------------------------------------------
