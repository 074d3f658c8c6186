"""Which zero a ``min``, ``max`` or zero sum is: every path orders ``-0.0`` below ``+0.0``, and sums as IEEE 754 does.

IEEE comparison finds ``-0.0 == +0.0``, so Python's ``min()``, numpy's reductions, ``torch.minimum`` and an
all_reduce(MAX) each keep an unspecified one of two tied zeros (the first, the last, or the hardware's choice).
metricbus orders them as IEEE 754's totalOrder does: the min of records holding both zeros is ``-0.0`` and their max
``+0.0``, whatever the order of the records, the split into micro-batches, updates and workers, and the path (log,
ingest, torch.distributed, replay). A NaN among them still makes the min and max NaN.

A zero *sum* (``sum``, ``mean``: Σx, Σw·x, Σw) is ``-0.0`` exactly when every term is ``-0.0`` (the records,
or for Σw·x every product ``w·x``), else ``+0.0``: what IEEE 754 addition gives in any order (``x + (-x)`` is
``+0.0``), and what :func:`math.fsum` gives from Python 3.12 on (before, it gives ``+0.0`` for ``-0.0``s). Every
path follows it: :func:`metricbus.exact.components` (and so ``Summary.of_batch`` and the list paths), the columns
of :mod:`metricbus.micro_columns`, ``Summary.merge`` (TwoSum keeps IEEE's sign) and the rank level, which counts
the workers whose sum is ``-0.0`` (:mod:`metricbus.rank_finish`). So the sign does not depend on the split.

Only a zero extreme or sum needs this: the helpers here fix one up after the ordinary reduction found it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

_NAN = math.nan
_COPYSIGN = math.copysign
NEGATIVE_ZERO_BITS = -(2**63)  # the bits of -0.0, read as an int64 (+0.0's are 0)


def of_sum(terms: Iterable[float]) -> float:
    """The zero that a sum of ``terms`` is when it is exactly zero: ``-0.0`` if every term is ``-0.0``."""
    for x in terms:
        if x != 0.0 or _COPYSIGN(1.0, x) > 0.0:
            return 0.0
    return -0.0


def least(a: float, b: float) -> float:
    """The min of ``a`` and ``b`` (NaN if either is NaN; ``-0.0`` if either is and the other is a zero)."""
    if a < b:
        return a
    if b < a:
        return b
    if a == b:
        return a if a != 0.0 or _COPYSIGN(1.0, a) < 0.0 else b
    return _NAN


def greatest(a: float, b: float) -> float:
    """The max of ``a`` and ``b`` (NaN if either is NaN; ``+0.0`` if either is and the other is a zero)."""
    if a > b:
        return a
    if b > a:
        return b
    if a == b:
        return a if a != 0.0 or _COPYSIGN(1.0, a) > 0.0 else b
    return _NAN


def pairs(a: Any, b: Any, *, minimum: bool) -> Any:
    """Elementwise :func:`least` (or :func:`greatest`) of the float64 arrays ``a`` and ``b``."""
    nan = np.isnan(a) | np.isnan(b)
    tied = (a == b) & (np.signbit(a) if minimum else ~np.signbit(a))  # a is the zero to keep, or equals b
    take_a = ((a < b) if minimum else (a > b)) | tied
    return np.where(nan, _NAN, np.where(take_a, a, b))


def of_values(values: Iterable[float], lowest: float, highest: float) -> tuple[float, float]:
    """``(lowest, highest)`` of ``values`` (no NaN among them) found by IEEE comparison, with a zero extreme given
    its sign: ``-0.0`` for the min if any value is ``-0.0``, ``+0.0`` for the max if any value is ``+0.0``."""
    if lowest != 0.0 and highest != 0.0:
        return lowest, highest
    signs = {_COPYSIGN(1.0, x) for x in values if x == 0.0}
    if lowest == 0.0:
        lowest = -0.0 if -1.0 in signs else 0.0
    if highest == 0.0:
        highest = 0.0 if 1.0 in signs else -0.0
    return lowest, highest


def of_sorted(ordered: list[float]) -> tuple[float, float]:
    """:func:`of_values` of a sorted list (no NaN): only the run of zeros at an end is read."""
    lowest, highest = ordered[0], ordered[-1]
    if lowest == 0.0:
        lowest = 0.0
        for x in ordered:
            if x != 0.0:
                break
            if _COPYSIGN(1.0, x) < 0.0:
                lowest = -0.0
                break
    if highest == 0.0:
        highest = -0.0
        for x in reversed(ordered):
            if x != 0.0:
                break
            if _COPYSIGN(1.0, x) > 0.0:
                highest = 0.0
                break
    return lowest, highest


def of_array(values: Any, lowest: float, highest: float) -> tuple[float, float]:
    """:func:`of_values` of a float64 numpy array."""
    if lowest != 0.0 and highest != 0.0:
        return lowest, highest
    negative = np.signbit(values[values == 0.0])
    if lowest == 0.0:
        lowest = -0.0 if negative.any() else 0.0
    if highest == 0.0:
        highest = -0.0 if negative.all() else 0.0
    return lowest, highest


def columns(reduced: Any, held: Any, *, axis: int, minimum: bool) -> Any:
    """``reduced`` (``held``'s min or max along ``axis``, by numpy) with each zero given its sign; ``held`` holds
    the candidates (fill values that are not zeros where an entry is absent)."""
    zero = reduced == 0.0
    if not zero.any():
        return reduced
    bits = held.view(np.int64)
    if minimum:  # -0.0 where any candidate is -0.0
        signed = np.where((bits == NEGATIVE_ZERO_BITS).any(axis=axis), -0.0, 0.0)
    else:  # +0.0 where any candidate is +0.0
        signed = np.where((bits == 0).any(axis=axis), 0.0, -0.0)
    return np.where(zero, signed, reduced)


def segments(reduced: Any, flat: Any, starts: Any, *, minimum: bool) -> Any:
    """``reduced`` (each segment's min or max of ``flat``, the segments starting at ``starts``, by
    ``np.minimum.reduceat`` or ``np.maximum.reduceat``) with each zero given its sign, in place."""
    zero = np.flatnonzero(reduced == 0.0)
    if len(zero):
        target = NEGATIVE_ZERO_BITS if minimum else 0
        hits = np.add.reduceat((flat.view(np.int64) == target).astype(np.int64), starts)[zero] > 0
        keep, other = (-0.0, 0.0) if minimum else (0.0, -0.0)
        reduced[zero] = np.where(hits, keep, other)
    return reduced
