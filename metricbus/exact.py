"""Exact sums of doubles, held as short tuples of doubles ("components"), and correctly rounded division.

Every finite double is an integer multiple of 2**-1074, so the exact sum ``V`` of any finite doubles is a dyadic
rational. ``components(parts)`` holds ``V`` as its *greedy components* ``c0, c1, …``: ``c0 = rnd(V)``,
``c1 = rnd(V - c0)``, ``c2 = rnd(V - c0 - c1)``, … until the remainder is exactly 0, where ``rnd`` is IEEE
round-half-even, except that a value beyond the double range rounds to ±MAX (the largest finite double) instead of
±inf. Hence:

* every component is finite and the components sum exactly to ``V``;
* within the double range ``c0`` IS the correctly rounded sum, ``c1`` the correctly rounded remainder, and so on;
* beyond it, the tuple starts with one or more ±MAX (about ``|V| / MAX`` of them: finite doubles that sum to a
  value beyond the range must be that many) and continues as the canonical form of what is left;
* a zero sum is ``(0.0,)``, or ``(-0.0,)`` where every part is ``-0.0`` (IEEE's sign, :mod:`metricbus.signed_zero`);
  a tuple is never empty, and no component but a lone first one is ever 0.

Non-finite inputs: the sum is one component, the IEEE sum of the non-finite inputs alone (finite ones cannot change
it): NaN if a NaN or both infinities are present, else ±inf. So a tuple whose first component is not finite stands
for non-finite data, and a finite first component for finite data.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from metricbus import signed_zero

MAX = sys.float_info.max
_NAN = math.nan
_INF = math.inf
_fsum = math.fsum


def components(parts: Sequence[float]) -> tuple[float, ...]:
    """The greedy components of the exact sum of ``parts`` (see the module docstring)."""
    try:
        hi = _fsum(parts)
        if hi == 0.0:  # an exact zero: -0.0 only if every part is (IEEE's sign, whatever fsum gives)
            return (signed_zero.of_sum(parts),)
        if hi - hi == 0.0:
            out = [hi]
            rest = [*parts, -hi]
            while True:  # each round removes the top ~53 bits of the remainder: a few rounds at most
                r = _fsum(rest)
                if r == 0.0:
                    return tuple(out)
                out.append(r)
                rest.append(-r)
    except OverflowError:  # an intermediate sum left the double range: the integer path below
        pass
    except ValueError:  # inf - inf
        return (_NAN,)
    special = [x for x in parts if x - x != 0.0]
    if special:
        return (sum(special),)
    return _of_ratio(*_ratio(parts))


def add(a: Sequence[float], b: Sequence[float]) -> tuple[float, ...]:
    """The components of the sum of two component tuples."""
    if a[0] - a[0] != 0.0 or b[0] - b[0] != 0.0:  # non-finite data on either side: IEEE, as for the records
        return (a[0] + b[0],)
    return components([*a, *b])


def value(parts: Sequence[float]) -> float:
    """The correctly rounded value of a components tuple (±inf beyond the double range)."""
    try:
        return _fsum(parts)
    except OverflowError:
        return divide(parts, (1.0,))


def divide(num: Sequence[float], den: Sequence[float]) -> float:
    """The correctly rounded quotient of the exact sums ``Σnum / Σden``; NaN when ``Σden`` is 0.

    Exact integer arithmetic: CPython's true division of two ints is correctly rounded (subnormals included).
    """
    if num[0] - num[0] != 0.0 or den[0] - den[0] != 0.0:  # non-finite data: IEEE on the leading components
        return num[0] / den[0] if den[0] != 0.0 else _NAN
    n_num, d_num = _ratio(num)
    n_den, d_den = _ratio(den)
    if n_den == 0:
        return _NAN
    if n_num == 0:  # a zero sum: the int 0 has no sign, its leading component has IEEE's (see components())
        zero = num[0] if num[0] == 0.0 else 0.0  # (components that cancel, not greedy ones: +0.0, as fsum's)
        return zero if n_den > 0 else -zero
    top, bottom = n_num * d_den, d_num * n_den
    try:
        return top / bottom
    except OverflowError:
        return _INF if (top < 0) == (bottom < 0) else -_INF


def divide_by_count(hi: float, lo: float, count: float) -> float | None:
    """The correctly rounded ``(hi + lo) / count``, or None where this quick path cannot decide (then use divide).

    ``hi + lo`` is exact (no further components) and ``count`` an integer-valued double in [1, 2**26): the mean of
    unit-weight records. A power-of-two count only shifts the exponent, so ``hi / count`` is exact there (away from
    the ends of the range, where ``hi`` is the rounded sum). Otherwise each candidate ``q`` is checked with the exact
    residual ``rho = hi - q·count``: ``q`` has a 26-bit high half, so both partial products are exact,
    ``hi - q_hi·count`` is exact by Sterbenz, and ``rho``, a multiple of ulp(q) below 2**27 ulps, is representable.
    ``q`` is the correct rounding iff ``rho + lo`` lies strictly inside ``count`` times the half gaps around ``q``
    (those thresholds are exact: a power of two times ``count``), and a rounded ``fl(rho + lo)`` strictly inside
    them implies the exact value is (rounding is monotone). On a threshold, an exact ``rho + lo`` (TwoSum error 0)
    is a tie: the even neighbour wins.
    """
    if not (1.0 <= count < _COUNT_LIMIT and count.is_integer()):
        return None
    q = hi / count
    if math.frexp(count)[0] == 0.5 and _QUOTIENT_LOW < abs(q) < _QUOTIENT_HIGH:  # 2**k: a shift of the rounded hi
        return q
    for _ in range(2):
        if not _QUOTIENT_LOW < abs(q) < _QUOTIENT_HIGH:
            return None
        c = _SPLIT * q
        q_hi = c - (c - q)
        rho = (hi - q_hi * count) - (q - q_hi) * count
        off = rho + lo
        above, below = math.nextafter(q, _INF), math.nextafter(q, -_INF)
        up, down = (above - q) * 0.5 * count, (below - q) * 0.5 * count
        if down < off < up:
            return q
        if off in (up, down):
            bb = off - rho
            if (rho - (off - bb)) + (lo - bb) == 0.0:  # off is exact: a tie, rounded to even
                even = math.frexp(q)[0] * _TWO_53 % 2.0 == 0.0
                return q if even else (above if off == up else below)
        q += off / count
    return None


def products(weights: Sequence[float], values: Sequence[float]) -> list[float]:
    """Doubles whose exact sum is ``Σ (p_i + e_i)``, with ``p_i = fl(w_i·x_i)`` and ``e_i = fl(w_i·x_i - p_i)``.

    That is exactly ``Σ w·x`` unless a product underflows (below 2**-960 ``e_i`` may be rounded to a multiple of
    2**-1074) or overflows (``p_i`` is then ±inf, as IEEE ``w*x`` gives, and so is the sum).
    """
    ps = [w * x for w, x in zip(weights, values, strict=True)]
    errors = _dekker_errors(weights, values)
    check = sum(errors)
    if check - check != 0.0:  # an overflow on the way (it leaves an inf or NaN), or non-finite data
        return [*ps, *(_product_error(w, x, p) for w, x, p in zip(weights, values, ps, strict=True))]
    if ps and min(map(abs, ps)) < _TINY_PRODUCT:  # zero weights or tiny products: redo those few exactly
        for i, p in enumerate(ps):
            if -_TINY_PRODUCT < p < _TINY_PRODUCT:
                errors[i] = _product_error(weights[i], values[i], p)
    return [*ps, *errors]


# Dekker's two-product is exact when nothing overflows or underflows. An overflow anywhere leaves an inf or a NaN
# in the result; with |w·x| >= 2**-960 every partial product is a multiple of 2**-1065, so none underflows.
_SPLIT = 134217729.0  # 2**27 + 1
_TINY_PRODUCT = 2.0**-960
_COUNT_LIMIT = 2.0**26
_QUOTIENT_LOW = 2.0**-960  # no gap, partial product or threshold of divide_by_count underflows ...
_QUOTIENT_HIGH = 2.0**900  # ... or overflows
_TWO_53 = 2.0**53


def two_product(a: float, b: float) -> tuple[float, float]:
    """``(p, e)`` with ``p = fl(a*b)`` and ``a*b = p + e`` exactly where nothing over- or underflows (Dekker; no
    fma in Python 3.11)."""
    p = a * b
    c = _SPLIT * a
    a_hi = c - (c - a)
    a_lo = a - a_hi
    c = _SPLIT * b
    b_hi = c - (c - b)
    b_lo = b - b_hi
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def _dekker_errors(weights: Sequence[float], values: Sequence[float]) -> list[float]:
    """``w·x - p`` for each record: exact where nothing over- or underflows."""
    return [two_product(w, x)[1] for w, x in zip(weights, values, strict=True)]


def _product_error(w: float, x: float, p: float) -> float:
    """``fl(w·x - p)`` by integer arithmetic; ``p`` itself where ``p`` is a zero (so a product of -0.0 adds only
    -0.0s, and a Σw·x of such products stays -0.0: :mod:`metricbus.signed_zero`), 0 where ``p`` is not finite."""
    if p == 0.0:
        return p
    if p - p != 0.0:
        return 0.0
    a, b = w.as_integer_ratio()
    c, d = x.as_integer_ratio()
    e, f = p.as_integer_ratio()
    return (a * c * f - e * b * d) / (b * d * f)


def _ratio(parts: Sequence[float]) -> tuple[int, int]:
    """The exact sum of finite ``parts`` as ``(numerator, denominator)``, the denominator a power of two."""
    num, den = parts[0].as_integer_ratio()
    for x in parts[1:]:
        n, d = x.as_integer_ratio()
        if d > den:
            num = num * (d // den) + n
            den = d
        else:
            num += n * (den // d)
    return num, den


def _of_ratio(num: int, den: int) -> tuple[float, ...]:
    """The greedy components of ``num / den`` (``den`` a power of two, so every remainder stays exact)."""
    out: list[float] = []
    while num:
        try:
            c = num / den
        except OverflowError:
            c = MAX if num > 0 else -MAX
        out.append(c)
        n, d = c.as_integer_ratio()
        if d > den:
            num = num * (d // den)
            den = d
        num -= n * (den // d)
    return tuple(out) if out else (0.0,)


# -- arrays ----------------------------------------------------------------------------------------------------------

_ARRAY_LIMIT = 2.0**960  # arrays with a larger |x| take the list path (the first sigma could overflow)
_SIGMA_FLOOR = 2.0**-1022  # there the spacing of doubles near sigma is 2**-1074: an extraction takes residuals whole
_MAX_ROUNDS = 64  # enough for blocks of 2**15 over the whole exponent range (36 bits a round); else None
_ONE = np.uint64(1)


def array_components(
    values: np.ndarray[Any, Any],
    largest: float,
    scratch: tuple[np.ndarray[Any, Any], ...] | None = None,
    smallest: float | None = None,
) -> tuple[float, ...] | None:
    """The greedy components of the exact sum of a 1-D float64 array of finite values, vectorized; None where
    ``largest`` (>= every |x|, > 0) is too large for this path (then use :func:`components`).

    Error-free extraction (Rump, Ogita & Oishi, "Accurate floating-point summation", 2008): with ``sigma`` a power
    of two >= 2**m * max|x| and 2**m >= 2n, ``q = (sigma + x) - sigma`` is exact, a multiple of 2**-53 * sigma and
    at most ``sigma / 2**m`` in magnitude, so any sum of n of them is exact (numpy's pairwise order included), and
    ``x - q`` is exact and at most 2**-53 * sigma. Each round thus takes the next ``53 - m`` bits of every record,
    with a smaller sigma each time. Every record, ``q`` and residual is a multiple of ``g = ulp(smallest)`` (the
    least nonzero |x|), so once ``n * sigma <= 2**106 * g`` any sum of the residuals is a multiple of g below
    2**53 * g: one plain sum of them is exact, and the rounds stop. For data within ~2**20 of its largest |x| that
    is after the first round, and no test of the residuals is needed. The few exact partial sums go through
    :func:`components`. Below ``_SIGMA_FLOOR`` a round takes the residuals whole (and the rounds stop there).
    ``scratch``: two float64 arrays of at least n elements to work in instead of allocating them. ``smallest``:
    the least nonzero |x| where the caller knows it (the least record of positive data), else None (found here).
    """
    n = values.size
    m = (2 * n).bit_length()  # 2**m > 2n
    if m >= 50 or not 0.0 < largest < _ARRAY_LIMIT:
        return None
    taken, residual = (np.empty(n), np.empty(n)) if scratch is None else (scratch[0][:n], scratch[1][:n])
    if smallest is None:
        smallest = _least_magnitude(values, taken)
    limit = math.ldexp(math.ulp(smallest), 106)  # n * sigma at most this: the residuals' sum is exact
    sigma = max(math.ldexp(1.0, math.frexp(largest)[1] + m), _SIGMA_FLOOR)
    scale = math.ldexp(1.0, m - 53)
    rest = values
    sums: list[float] = []
    for _ in range(_MAX_ROUNDS):
        np.add(rest, sigma, out=taken)
        np.subtract(taken, sigma, out=taken)
        np.subtract(rest, taken, out=residual)
        sums.append(float(np.add.reduce(taken)))
        if n * sigma <= limit:
            sums.append(float(np.add.reduce(residual)))
            return components(sums)
        rest = residual
        sigma = max(sigma * scale, _SIGMA_FLOOR)
    return None  # not expected: each round takes 53 - m bits, and the floor ends the rounds


def _least_magnitude(values: np.ndarray[Any, Any], work: np.ndarray[Any, Any]) -> float:
    """The least nonzero |x| of finite ``values`` (not all zero): one integer pass and two argmins.

    A double's bits, read as an integer, order the doubles of one sign by magnitude; ``bits - 1`` (wrapping) sends
    +0.0 to the top. So as unsigned integers the least key is the least positive value where there is one, and as
    signed integers (negative values below 0) the negative value nearest zero where there is one.
    """
    keys = np.subtract(values.view(np.uint64), _ONE, out=work.view(np.uint64))
    a, b = abs(float(values[keys.argmin()])), abs(float(values[keys.view(np.int64).argmin()]))
    return a if not b or 0.0 < a < b else b
