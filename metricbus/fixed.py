"""Exact sums of many doubles as int64 fixed-point limbs: the same integers whatever the order or grouping.

A finite nonzero double is ``m · 2**q`` with ``m`` an odd integer (``|m| < 2**53``). For a set of doubles (one
*slot*: e.g. every rank's components of one metric's Σw·x), let ``E`` be the largest ``frexp`` exponent and ``Q``
the smallest ``q``: every value is then an integer multiple of ``2**Q`` below ``2**(E - Q)`` in magnitude, and is
written exactly as ``L = (E - Q) // 32 + 3`` signed 32-bit *limbs* ``Σ c_i · 2**(32·i + Q)``. Adding limbs is
integer addition, exact and associative, so the slot's exact sum is ``Σ_i (Σ c_i) · 2**(32·i + Q)`` however the
values were split across ranks, and whatever order a collective adds in. An int64 limb holds the sum of up to 2**30
contributions (each below 2**33): with a few terms per rank and slot, ~1e8 ranks.

Under torch.distributed, ``E`` and ``-Q`` come from an all_reduce(MAX) (:func:`scan` of each rank's terms), the
limbs from an all_reduce(SUM) (:func:`add_limbs`); see :mod:`metricbus.rank_level`. On one process the same exact
sums come from :mod:`metricbus.extract` (no exponent pass).
Zeros and non-finite values contribute nothing here (non-finite data is counted separately by the caller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from metricbus import exact

NONE = -4096  # E and -Q of a slot with no finite nonzero value: no limbs
LIMB_BITS = 32
_MASK = (1 << LIMB_BITS) - 1
Array = Any  # numpy arrays (numpy's own stubs are too loose to help here)


@dataclass(frozen=True, slots=True)
class Terms:
    """Finite nonzero values, decomposed: ``value = m · 2**q`` (``m`` odd, signed) in ``slot``, with ``top`` its
    frexp exponent. Zeros and non-finite values are left out (non-finite data is counted by the caller)."""

    slot: Array  # int64
    m: Array  # int64
    q: Array  # an integer dtype (int32 from decompose): exponents within ±1,100
    top: Array  # float64 (the type of the maxima pass)

    def where(self, keep: Array) -> Terms:
        """The terms where ``keep`` (a bool per term) is True."""
        return Terms(self.slot[keep], self.m[keep], self.q[keep], self.top[keep])


NO_TERMS = Terms(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))


def concat(*terms: Terms) -> Terms:
    """All of ``terms`` in one."""
    held = [t for t in terms if len(t.m)]
    if len(held) <= 1:
        return held[0] if held else terms[0]
    return Terms(*(np.concatenate([getattr(t, f) for t in held]) for f in ("slot", "m", "q", "top")))


def decompose(values: Array, slots: Array) -> Terms:
    """The :class:`Terms` of float64 ``values`` (``slots``: each value's slot index)."""
    keep = (np.isfinite(values) & (values != 0.0)).nonzero()[0]  # (indices: a bool mask indexes slowly when large)
    if len(keep) == len(values):  # every value kept: no copy
        frac, top = np.frexp(values)
        return _terms_of(slots, frac, top)
    frac, top = np.frexp(values[keep])
    return _terms_of(slots[keep], frac, top)


def _terms_of(slots: Array, frac: Array, top: Array) -> Terms:
    """The :class:`Terms` of finite nonzero values ``frac · 2**top`` (numpy's frexp) in ``slots``."""
    m53 = (frac * 9007199254740992.0).astype(np.int64)  # frac · 2**53: exact
    magnitude = np.abs(m53)
    ctz = np.frexp((magnitude & -magnitude).astype(np.float64))[1] - 1  # the lowest set bit's position
    return Terms(slots, m53 >> ctz, top + (ctz - 53), top.astype(np.float64))


def scan(terms: Terms, n_slots: int) -> tuple[Array, Array]:
    """Per slot ``(E, -Q)`` of ``terms``, as float64; NONE where a slot has none."""
    e_max = np.full(n_slots, float(NONE))
    nq_max = np.full(n_slots, float(NONE))
    if len(terms.m):
        np.maximum.at(e_max, terms.slot, terms.top)
        np.maximum.at(nq_max, terms.slot, (-terms.q).astype(np.float64))
    return e_max, nq_max


def widths(e_max: Array, nq_max: Array) -> Array:
    """The number of limbs of each slot, from the agreed ``E`` and ``-Q`` (0 for an empty slot)."""
    e = e_max.astype(np.int64)
    q = -nq_max.astype(np.int64)
    return np.where(e == NONE, 0, (e - q) // LIMB_BITS + 3)


def bit_starts(nq_max: Array, offsets: Array) -> Array:
    """Where each slot's ``2**Q`` sits in a limb vector, in bits: ``32 · offsets[s] - Q`` (``Q = -nq_max[s]``)."""
    return offsets * LIMB_BITS + nq_max.astype(np.int64)


def add_limbs(out: Array, terms: Terms, starts: Array) -> None:
    """Add ``terms`` to the int64 limb vector ``out``: slot ``s``'s limbs start at ``offsets[s]``, aligned to the
    agreed ``Q = -nq_max[s]``, as :func:`bit_starts` gives them."""
    if not len(terms.m):
        return
    m = terms.m
    at = terms.q + starts[terms.slot]  # each term's lowest bit in ``out``: 32 · offset + (q - Q), q - Q >= 0
    am = np.abs(m)
    r = at & 31
    low = (am & _MASK) << r  # < 2**63
    high = (am >> LIMB_BITS) << r  # < 2**52
    parts = np.empty((3, m.size), dtype=np.int64)  # the three limbs each term adds to, from its lowest
    np.bitwise_and(low, _MASK, out=parts[0])
    np.right_shift(low, LIMB_BITS, out=parts[1])
    parts[1] += high & _MASK
    np.right_shift(high, LIMB_BITS, out=parts[2])
    parts *= np.sign(m)
    np.add.at(out, ((at >> 5) + _THREE).ravel(), parts.ravel())  # int64 sums: exact


_THREE = np.arange(3, dtype=np.int64)[:, None]


def integer(limb_values: list[int]) -> int:
    """``Σ c_i · 2**(32·i)`` of one slot's summed limbs, as a Python int."""
    n = 0
    for i, c in enumerate(limb_values):
        if c:
            n += c << (LIMB_BITS * i)
    return n


def components(n: int, q: int) -> tuple[float, ...]:
    """The greedy components (see :mod:`metricbus.exact`) of ``n · 2**q``: a function of the value alone, so a sum
    held in a wider limb window (a lower ``q``) gives the same components."""
    if n == 0:
        return (0.0,)
    tz = (n & -n).bit_length() - 1  # n's trailing zero bits: the value's canonical form first
    n >>= tz
    q += tz
    out = []
    try:
        while n:
            f = float(n)  # n correctly rounded: the mantissa of n · 2**q, correctly rounded, where that is normal
            part = math.ldexp(f, q)
            if not _SMALLEST_NORMAL <= abs(part) < math.inf:
                break
            out.append(part)
            n -= int(f)
        else:
            return tuple(out)
    except OverflowError:
        pass
    return (*out, *_of_ratio(n, q))  # beyond the double range, or into the subnormals: exact ratios


def _of_ratio(n: int, q: int) -> tuple[float, ...]:
    if q >= 0:
        return exact._of_ratio(n << q, 1)
    return exact._of_ratio(n, 1 << -q)


_SMALLEST_NORMAL = 2.0**-1022
