"""Exact sums of many doubles as int64 fixed-point limbs: the same integers whatever the order or grouping.

A finite nonzero double is ``m · 2**q`` with ``m`` an odd integer (``|m| < 2**53``). For a set of doubles (one
*slot*: e.g. every rank's components of one metric's Σw·x), let ``E`` be the largest ``frexp`` exponent and ``Q``
the smallest ``q``: every value is then an integer multiple of ``2**Q`` below ``2**(E - Q)`` in magnitude, and is
written exactly as ``L = (E - Q) // 32 + 3`` signed 32-bit *limbs* ``Σ c_i · 2**(32·i + Q)``. Adding limbs is
integer addition, exact and associative, so the slot's exact sum is ``Σ_i (Σ c_i) · 2**(32·i + Q)`` however the
values were split across ranks, and whatever order a collective adds in. An int64 limb holds the sum of up to 2**30
contributions (each below 2**33), i.e. ~1e9 ranks.

Under torch.distributed, ``E`` and ``-Q`` come from an all_reduce(MAX) (:func:`scan`), the limbs from an
all_reduce(SUM) (:func:`limbs`); on one process the same two functions run over every worker's values at once.
Zeros and non-finite values contribute nothing here (non-finite data is counted separately by the caller).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from metricbus import exact

NONE = -4096  # E and -Q of a slot with no finite nonzero value: no limbs
LIMB_BITS = 32
_MASK = (1 << LIMB_BITS) - 1
_CHUNK = 1 << 19  # components per bincount: a bin's float64 total stays below 2**52 (exact)
Array = Any  # numpy arrays (numpy's own stubs are too loose to help here)


def decompose(values: Array) -> tuple[Array, Array, Array, Array]:
    """``(ok, m, q, top)`` of float64 ``values``: finite nonzero mask; odd |mantissa|, signed; exponent of the
    lowest set bit; frexp exponent (``m``, ``q``, ``top`` are 0 where not ``ok``)."""
    ok = np.isfinite(values) & (values != 0.0)
    frac, top = np.frexp(np.where(ok, values, 1.0))
    m53 = (frac * 9007199254740992.0).astype(np.int64)  # frac · 2**53: exact
    low = np.abs(m53) & -np.abs(m53)  # the lowest set bit of |m53|, a power of two
    ctz = np.frexp(low.astype(np.float64))[1] - 1
    m = np.where(ok, m53 >> ctz, 0)
    q = np.where(ok, top - 53 + ctz, 0)
    return ok, m, q, np.where(ok, top, 0)


def scan(values: Array, slots: Array, n_slots: int) -> tuple[Array, Array]:
    """Per slot ``(E, -Q)`` of ``values`` (``slots``: each value's slot index), as float64; NONE where empty."""
    ok, _, q, top = decompose(values)
    e_max = np.full(n_slots, float(NONE))
    nq_max = np.full(n_slots, float(NONE))
    if ok.any():
        idx = slots[ok]
        np.maximum.at(e_max, idx, top[ok].astype(np.float64))
        np.maximum.at(nq_max, idx, (-q[ok]).astype(np.float64))
    return e_max, nq_max


def widths(e_max: Array, nq_max: Array) -> Array:
    """The number of limbs of each slot, from the agreed ``E`` and ``-Q`` (0 for an empty slot)."""
    e = e_max.astype(np.int64)
    q = -nq_max.astype(np.int64)
    return np.where(e == NONE, 0, (e - q) // LIMB_BITS + 3)


def limbs(values: Array, slots: Array, nq_max: Array, offsets: Array, total: int) -> Array:
    """The int64 limb vector (``total`` long) of ``values``: slot ``s``'s limbs start at ``offsets[s]``, aligned to
    the agreed ``Q = -nq_max[s]``."""
    out = np.zeros(total, dtype=np.int64)
    ok, m, q, _ = decompose(values)
    if not ok.any():
        return out
    idx = slots[ok]
    m, q = m[ok], q[ok]
    shift = q + nq_max.astype(np.int64)[idx]  # q - Q >= 0
    sign = np.where(m < 0, -1, 1)
    am = np.abs(m)
    k0 = offsets[idx] + (shift >> 5)
    r = shift & 31
    low = (am & _MASK) << r  # < 2**63
    high = (am >> LIMB_BITS) << r  # < 2**52
    parts = (
        (k0, sign * (low & _MASK)),
        (k0 + 1, sign * ((low >> LIMB_BITS) + (high & _MASK))),
        (k0 + 2, sign * (high >> LIMB_BITS)),
    )
    for start in range(0, len(m), _CHUNK):
        for where, what in parts:
            binned = np.bincount(where[start : start + _CHUNK], weights=what[start : start + _CHUNK], minlength=total)
            out += binned.astype(np.int64)
    return out


def integer(limb_values: Array) -> int:
    """``Σ c_i · 2**(32·i)`` of one slot's summed limbs, as a Python int."""
    n = 0
    for i, c in enumerate(limb_values.tolist()):
        if c:
            n += c << (LIMB_BITS * i)
    return n


def components(n: int, q: int) -> tuple[float, ...]:
    """The greedy components (see :mod:`metricbus.exact`) of ``n · 2**q``."""
    if n == 0:
        return (0.0,)
    if q >= 0:
        return exact._of_ratio(n << q, 1)
    return exact._of_ratio(n, 1 << -q)
