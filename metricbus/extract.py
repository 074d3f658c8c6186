"""Exact column sums of a float64 matrix by error-free extraction (Rump, Ogita and Oishi's ExtractVector).

For a column whose values satisfy ``|x| <= 2**e`` and ``sigma = 2**(e + k)`` with ``2**k > 2n`` (``n`` rows),
``t = (sigma + x) - sigma`` and ``x - t`` are exact, every ``t`` is a multiple of ``ulp(sigma)/2`` and their sum,
below ``sigma`` in magnitude, is exact in any order. Each pass thus moves the top ``53 - k`` bits of every value
into one exact float per column and leaves remainders below ``2**(e + k - 53)``; a few passes leave nothing, and
the column's exact sum is the exact sum of the few floats the passes produced. ``sigma`` is kept at or above
2**-1021, where the grid reaches the smallest subnormal: one last pass takes everything that small.
"""

from __future__ import annotations

import math

import numpy as np

from metricbus.fixed import Array

MAX_PASSES = 64  # ~38 bits a pass at 8,192 rows: enough for any span of finite doubles
_LOWEST_SIGMA = -1021


def column_parts(values: Array) -> list[Array]:
    """Per column of an (n, C) matrix, floats whose exact sum is the column's exact sum (non-finite values and
    zeros count as 0): one (C,) array per pass. Raises OverflowError for values too large to extract (|x| beyond
    ``2**(1023 - k)``): the caller then sums another way."""
    x = np.array(values, dtype=np.float64)  # a copy: extraction works in place
    if not np.isfinite(x).all():
        x[~np.isfinite(x)] = 0.0
    k = math.ceil(math.log2(2 * max(1, x.shape[0]) + 1))
    t = np.empty_like(x)
    out: list[Array] = []
    for _ in range(MAX_PASSES):
        largest = np.maximum(x.max(axis=0, initial=0.0), -x.min(axis=0, initial=0.0))
        if not largest.any():
            return out
        exponent = np.maximum(np.frexp(largest)[1] + k, _LOWEST_SIGMA)  # largest < 2**(exponent - k)
        if exponent.max() > 1023:
            raise OverflowError("values too large for extraction")
        sigma = np.ldexp(1.0, exponent)
        np.add(x, sigma, out=t)
        np.subtract(t, sigma, out=t)
        np.subtract(x, t, out=x)
        out.append(t.sum(axis=0))
    raise OverflowError("extraction did not finish")  # pragma: no cover  (finite doubles span 2098 bits)


def double_double(parts: list[Array], width: int) -> tuple[Array, Array, Array]:
    """``(hi, lo, ok)`` per column of the exact sum of ``parts`` (as :func:`column_parts` gives them): where ``ok``,
    ``hi`` is the correctly rounded sum and ``lo`` the exact remainder (so ``(hi, lo)``, or ``(hi,)`` when ``lo`` is
    0, are its greedy components). TwoSum folds the parts into ``s`` and error terms; when those errors add up to one
    double ``r`` exactly (no TwoSum of theirs leaves an error), the sum is exactly ``s + r``, whose rounding is
    ``hi`` and whose TwoSum error is ``lo``. Elsewhere (``ok`` False) the caller sums the column another way."""
    s = parts[0] if parts else np.zeros(width)
    r: Array = np.zeros(width) if len(parts) < 2 else None  # else the first error term
    ok: Array = None  # where every error term's TwoSum was exact (None: all so far)
    with np.errstate(all="ignore"):
        for p in parts[1:]:
            t = s + p
            bb = t - s
            e = (s - (t - bb)) + (p - bb)
            s = t
            if r is None:  # 0 + e is exact (+ 0.0: the same bits as 0.0 + e); a non-finite e leaves hi non-finite
                r = e + 0.0
                continue
            t = r + e
            bb = t - r
            exact = (r - (t - bb)) + (e - bb) == 0.0
            ok = exact if ok is None else ok & exact
            r = t
        hi = s + r
        bb = hi - s
        lo = (s - (hi - bb)) + (r - bb)
    finite = np.isfinite(hi) & np.isfinite(lo)
    return hi, lo, finite if ok is None else ok & finite
