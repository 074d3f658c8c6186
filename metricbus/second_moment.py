"""The second moment across workers: each worker's ``t = m2 + S²/W`` and the merged ``m2 = Σt - S²/W``.

``t`` is a short expansion (:func:`t_parts`: exact but for a term of ~2**-150 of ``W·mean²``) computed by the same
numpy code on every path (so its bits do not depend on which path reduces), with rational arithmetic for the rare
rows whose products could overflow or underflow; ``m2`` divides exact sums in exact integer arithmetic. See
:mod:`metricbus.rank_level` for the error bound.
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


def _two_sum(a: Array, b: Array) -> tuple[Array, Array]:
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def t_parts(fields: Array, w_rest: Array | None = None, s_rest: Array | None = None) -> list[Array]:
    """``t = m2 + S²/W`` of each state (``fields``: (N_FIELDS, n)) as arrays whose elementwise sum is ``t``: exact
    but for one small term, so that a constant metric's merged ``m2`` is exactly 0 and near-constant data keeps its
    digits.

    With ``q`` the mean rounded to a double (from a double-double quotient: the mean itself where it is a double)
    and ``r = S - W·q`` (exact, held as a double-double), ``S²/W = q·S + q·r + r²/W``: ``q·S`` and ``q·r_hi`` are
    exact as two products each (Dekker), and only ``q·r_lo`` and ``r²/W`` are rounded; both are at most ~2**-53 of
    ``W·q·ulp(q)``, so ``t`` is off by ~2**-150 of ``W·mean²`` (the double-double of ``t`` was off by ~2**-100 of
    it). ``w_rest`` and ``s_rest``: the sums of further components of W and S (``Summary.rest``) where some state
    has them (else None): ``q·s_rest`` and ``w_rest·q`` enter rounded and exactly, as terms of ~2**-106 of those.
    Rows where a product could overflow or underflow take rational arithmetic (:func:`_t_exact`)."""
    w_hi, w_lo, s_hi, s_lo, m2 = fields[1], fields[2], fields[3], fields[4], fields[7]
    with np.errstate(all="ignore"):
        q1 = s_hi / w_hi
        p, e = _two_prod(q1, w_hi)
        q = q1 + (((s_hi - p) - e) + s_lo - q1 * w_lo) / w_hi  # the mean, rounded from its double-double
        p1, e1 = _two_prod(w_hi, q)
        p2, e2 = _two_prod(w_lo, q)
        terms = [s_lo, -e1, -p2, -e2]
        if s_rest is not None:
            terms.append(s_rest)
        if w_rest is not None:
            p3, e3 = _two_prod(w_rest, q)
            terms.extend((-p3, -e3))
        r, err = _two_sum(s_hi, -p1)  # r = S - W·q = s_hi + s_lo - p1 - e1 - p2 - e2 (...), exactly
        for x in terms:
            r, more = _two_sum(r, x)
            err = err + more
        r_hi, r_lo = _two_sum(r, err)
        qs_hi, qs_hi_lo = _two_prod(q, s_hi)
        qs_lo, qs_lo_lo = _two_prod(q, s_lo)
        qr_hi, qr_hi_lo = _two_prod(q, r_hi)
        small = q * r_lo + r_hi * r_hi / w_hi
        if s_rest is not None:
            small = small + q * s_rest
        parts = [qs_hi, m2, qs_hi_lo, qs_lo, qs_lo_lo, qr_hi, qr_hi_lo, small]
        weightless = w_hi == 0.0
        a_s, a_w, a_q = np.abs(s_hi), np.abs(w_hi), np.abs(q)
        risky = ~weightless & (
            (a_s > _DD_SAFE) | (a_w > _DD_SAFE) | (a_w < 1.0 / _DD_SAFE) | (a_q > _DD_SAFE)
            | ((a_q < 1.0 / _DD_SAFE) & (q != 0.0)) | ((a_s < _TINY) & (s_hi != 0.0))
            | ~np.isfinite(qs_hi) | ~np.isfinite(small) | ~np.isfinite(m2)
        )
        plain = weightless | risky
        if plain.any():
            parts = [np.where(plain, 0.0, part) for part in parts]
            parts[0] = np.where(weightless, m2, parts[0])  # no weight: t is m2
            parts[1] = np.where(weightless, 0.0, parts[1])
    if risky.any():
        for i in np.flatnonzero(risky).tolist():
            s = (float(s_hi[i]), float(s_lo[i]), *(() if s_rest is None else (float(s_rest[i]),)))
            w = (float(w_hi[i]), float(w_lo[i]), *(() if w_rest is None else (float(w_rest[i]),)))
            for part, value in zip(parts, _t_exact(float(m2[i]), s, w, len(parts)), strict=True):
                part[i] = value
    return parts


_TINY = 2.0**-400  # below it (with W and the mean within (1/_DD_SAFE, _DD_SAFE)) a product could underflow


def _t_exact(m2: float, s: tuple[float, ...], w: tuple[float, ...], size: int) -> list[float]:
    """``t`` of one row far from 1 in magnitude as ``size`` parts, by rational arithmetic (the products could
    overflow or underflow): ``m2 + q·S + q·r`` exactly (dyadic) in greedy components, and ``r²/W`` rounded, with
    ``q`` the correctly rounded mean and ``r = S - W·q``, as :func:`t_parts` splits it; beyond the range: inf."""
    out = [0.0] * size
    if not all(map(math.isfinite, (m2, *s, *w))):
        out[0] = math.nan if math.isnan(m2) or math.isnan(s[0]) else math.inf
        return out
    total = sum(map(Fraction, s), Fraction(0))
    weight = sum(map(Fraction, w), Fraction(0))
    q = Fraction(float(total / weight))  # (|mean| is below MAX: the products w·x are finite)
    r = total - weight * q
    exact_part = Fraction(m2) + q * total + q * r
    try:
        if math.isinf(float(exact_part)):
            raise OverflowError
    except OverflowError:
        out[0] = math.inf
        return out
    rest = exact_part
    for i in range(size - 1):  # its greedy components (a few at most; the last takes what is left, rounded)
        out[i] = float(rest)
        if not out[i]:  # nothing left, or below the subnormals (products of tiny values): dropped
            break
        rest -= Fraction(out[i])
    out[size - 1] = float(r * r / weight)
    return out


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
