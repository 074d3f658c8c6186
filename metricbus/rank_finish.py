"""The rank level's last step: each column's merged Summary from the reduced fixed slots and the exact sums.

The exact sums arrive per slot as arrays ``(hi, lo, ok)`` over the columns: where ``ok``, the column's exact sum is
``hi + lo`` exactly with ``hi`` its correctly rounded value, so ``(hi, lo)`` (``(hi,)`` when ``lo`` is 0; a zero sum
when ``hi`` is 0) are its greedy components (:mod:`metricbus.exact`). The common column (every sum it reads ``ok``,
its merged ``m2`` not computed) is built from whole columns at once; any other (a sum with a third component, beyond
the double range, a count beyond 2**53, a merged ``m2``) takes the per-column path :func:`column`, which asks
``exact_sum`` for the sums that are not ``ok``. Both give the same bits: the fast path only reads what the
per-column path would compute from the same ``(hi, lo)``.

:func:`limb_sums` finds ``(hi, lo, ok)`` of fixed-point limbs (:mod:`metricbus.fixed`) without Python integers:
the limbs are regrouped into 48-bit pieces (exact doubles) and added by TwoSum
(:func:`metricbus.extract.double_double`, which says where that sum is exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from metricbus import extract, fixed, second_moment
from metricbus.fixed import Array
from metricbus.summary import Rest, Summary

SLOTS = 4  # the exact sums of a column: weight, wsum, total, t
# the fixed slots, per column: count, workers, first/last/m2 bits, then per slot NaN, +inf, -inf, -0.0 counts, then
# NaN min/max
COUNT, WORKERS, FIRST, LAST, M2 = 0, 1, 2, 3, 4
NONFINITE = 5  # + 4 * slot + (0 NaN, 1 +inf, 2 -inf, 3 -0.0)
NAN_MINMAX = NONFINITE + 4 * SLOTS
NS = NAN_MINMAX + 1
EXACT_COUNT = 2**53  # a count below this is its own float

Quick = tuple[Array, Array, Array] | None  # one slot's (hi, lo, ok) per column; None: ask exact_sum everywhere
ExactSum = Callable[[int, int], tuple[float, ...] | None]  # (column, slot) -> components, None for a zero sum

_WIDEST = 9  # limbs: a wider slot (a span beyond ~200 bits, which a double-double rarely holds) takes Python ints
_LIMB_LIMIT = 1 << 36
_new = tuple.__new__


def limb_sums(summed: Array, nq_max: Array, offsets: Array, sizes: Array) -> tuple[Array, Array, Array]:
    """Per slot ``(hi, lo, ok)`` of the exact sum ``Σ_i c_i · 2**(32·i + Q)`` of its int64 limbs ``c_i`` (at
    ``summed[offsets[s]:offsets[s] + sizes[s]]``, ``Q = -nq_max[s]``); an empty slot is a zero sum."""
    n = sizes.shape[0]
    hi, lo, ok = np.zeros(n), np.zeros(n), sizes == 0
    live = np.flatnonzero(sizes)
    if not live.size:
        return hi, lo, ok
    widths = sizes[live]
    width = int(widths.max())
    if width > _WIDEST:
        live = live[widths <= _WIDEST]
        if not live.size:
            return hi, lo, ok
        widths = sizes[live]
        width = int(widths.max())
    start = int(offsets[live[0]])
    if int(widths.min()) == width and start + width * live.size == int(offsets[live[-1]]) + width:
        limbs = summed[start : start + width * live.size].reshape(live.size, width).T  # (width, m): no gaps
    else:
        at = offsets[live] + np.arange(width)[:, None]
        inside = np.arange(width)[:, None] < widths
        limbs = np.where(inside, summed[np.where(inside, at, 0)], 0)
    if width % 3:
        limbs = np.concatenate((limbs, np.zeros((3 - width % 3, live.size), dtype=np.int64)))
    # Three limbs a, b, c are a + b·2**32 + c·2**64 = (a + (b mod 2**16)·2**32) + (b // 2**16 + c·2**16)·2**48:
    # below 2**53 each (exact doubles) where every |limb| < 2**36 (a few thousand terms of the slot).
    a, b, c = limbs[0::3], limbs[1::3], limbs[2::3]
    pieces = np.empty((2 * a.shape[0], live.size), dtype=np.int64)
    pieces[0::2] = a + ((b & 0xFFFF) << 32)
    pieces[1::2] = (b >> 16) + (c << 16)
    used = np.flatnonzero(pieces.any(axis=1))
    if not used.size:
        ok[live] = True
        return hi, lo, ok
    first, last = int(used[0]), int(used[-1]) + 1
    exponents = 48 * np.arange(first, last)[:, None] - nq_max[live].astype(np.int64)
    with np.errstate(over="ignore"):
        parts = np.ldexp(pieces[first:last].astype(np.float64), exponents)
    hi[live], lo[live], found = extract.double_double(list(parts), live.size)
    ok[live] = found & (np.abs(limbs).max(axis=0) < _LIMB_LIMIT)
    return hi, lo, ok


class Merged(list[Summary | None]):
    """Each column's merged Summary (None: no worker has it), as a list; where every column that a worker has took
    the fast path, also those columns' fields as one array: ``fields`` (N_FIELDS, m), the ``as_tuple()`` of
    ``self[c]`` in column ``j`` for ``c = picks[j]`` (``picks`` None: every column, in order). ``fields`` is None
    otherwise, and once an item is replaced."""

    __slots__ = ("fields", "picks")

    def __init__(self, items: Iterable[Summary | None], *, fields: Array | None = None, picks: Array | None = None):
        super().__init__(items)
        self.fields = fields
        self.picks = picks

    def __setitem__(self, index: Any, value: Any) -> None:
        self.fields = None
        super().__setitem__(index, value)


def assemble(head: Array, extrema: Array, moments: Array, quick: Sequence[Quick], exact_sum: ExactSum) -> Merged:
    """Each column's Summary (None: no worker has it) from its fixed slots ``head`` (C, NS), ``extrema`` (C, 4: max,
    -min, -lowest rank, weighted), the ``quick`` sums of each slot and ``exact_sum`` where those are not ``ok``."""
    n_cols = head.shape[0]
    workers, count = head[:, WORKERS], head[:, COUNT]
    weighted = extrema[:, 3] > 0
    # a merged m2 (exact integer arithmetic) or a count beyond 2**53 takes the per-column path
    slow = (moments & (workers > 1)) | (count >= EXACT_COUNT)
    total_hi, total_lo, bad = _slot(head, workers, 2, quick[2])
    slow |= bad
    if weighted.any():
        weight_hi, weight_lo, bad_weight = _slot(head, workers, 0, quick[0])
        wsum_hi, wsum_lo, bad_wsum = _slot(head, workers, 1, quick[1])
        slow |= weighted & (bad_weight | bad_wsum)
        weight_hi = np.where(weighted, weight_hi, count.astype(np.float64))
        weight_lo = np.where(weighted, weight_lo, 0.0)
        wsum_hi = np.where(weighted, wsum_hi, total_hi)
        wsum_lo = np.where(weighted, wsum_lo, total_lo)
    else:  # unit weights: Σw is the count, Σw·x is Σx
        weight_hi, weight_lo, wsum_hi, wsum_lo = count.astype(np.float64), np.zeros(n_cols), total_hi, total_lo
    fast = (workers > 0) & ~slow
    every = bool(fast.all())
    picks = slice(None) if every else np.flatnonzero(fast)
    bits = head[picks, FIRST : M2 + 1].view(np.float64)  # first, last, m2
    m2 = bits[:, 2]
    single = workers[picks] == 1
    if not single.all():  # several workers, no chain reads the merged m2: not computed
        m2 = np.where(single, m2, math.nan)
    lowest, highest = -extrema[picks, 1], extrema[picks, 0]
    no_order = head[picks, NAN_MINMAX] != 0
    if no_order.any():
        lowest, highest = np.where(no_order, math.nan, lowest), np.where(no_order, math.nan, highest)
    fields = (
        count[picks], weight_hi[picks], weight_lo[picks], wsum_hi[picks], wsum_lo[picks], total_hi[picks],
        total_lo[picks], m2, lowest, highest, bits[:, 0], bits[:, 1],
    )
    rows = zip(*(f.tolist() for f in fields), repeat(()), repeat(None))
    built: list[Summary | None] = list(map(_new, repeat(Summary), rows))
    others = np.flatnonzero((workers > 0) & slow)
    columns = None if others.size else np.stack(fields)  # float64: the count's int64 converts exactly
    if every:
        return Merged(built, fields=columns)
    out = Merged([None] * n_cols)
    for c, state in zip(np.flatnonzero(fast).tolist(), built, strict=True):
        out[c] = state
    out.fields, out.picks = columns, picks
    if others.size:
        found = _quick_or_exact(quick, exact_sum)
        for c in others.tolist():
            out[c] = column(head[c].tolist(), extrema[c].tolist(), bool(moments[c]), c, found)
    return out


def _slot(head: Array, workers: Array, slot: int, quick: Quick) -> tuple[Array, Array, Array]:
    """One slot's ``(hi, lo, bad)`` per column: IEEE's sum of the non-finite terms where there are any, a signed
    zero for a zero sum, else the quick sum; ``bad`` where that is not known exact (then ask ``exact_sum``)."""
    base = NONFINITE + 4 * slot
    n_cols = head.shape[0]
    hi, lo, ok = (np.zeros(n_cols), np.zeros(n_cols), np.zeros(n_cols, dtype=bool)) if quick is None else quick
    zero = hi == 0.0
    if zero.any():  # a zero sum is -0.0 when every worker's is
        hi = np.where(zero, np.where(head[:, base + 3] == workers, -0.0, 0.0), hi)
        lo = np.where(zero, 0.0, lo)
    lo = lo + 0.0  # a zero remainder is +0.0, as the components' absent lo
    special = head[:, base : base + 3].any(axis=1)  # NaN, +inf, -inf terms
    if special.any():
        nan, pos, neg = head[:, base] != 0, head[:, base + 1] != 0, head[:, base + 2] != 0
        value = np.where(nan | (pos & neg), math.nan, np.where(pos, math.inf, -math.inf))
        hi, lo = np.where(special, value, hi), np.where(special, 0.0, lo)
    return hi, lo, ~(special | ok)


def _quick_or_exact(quick: Sequence[Quick], exact_sum: ExactSum) -> ExactSum:
    """``exact_sum`` that reads the quick sums where they are ``ok``."""
    held = [None if q is None else (q[0].tolist(), q[1].tolist(), q[2].tolist()) for q in quick]

    def found(c: int, slot: int) -> tuple[float, ...] | None:
        lists = held[slot]
        if lists is not None and lists[2][c]:
            hi, lo = lists[0][c], lists[1][c]
            if hi == 0.0:
                return None
            return (hi, lo) if lo != 0.0 else (hi,)
        return exact_sum(c, slot)

    return found


def column(h: list[int], extrema: list[float], moment: bool, c: int, exact_sum: ExactSum) -> Summary:
    """One present column's Summary, component by component (``h``: its fixed slots; ``extrema``: its row)."""
    floats = np.array(h[FIRST : M2 + 1], dtype=np.int64).view(np.float64).tolist()  # first, last, m2
    workers, count = h[WORKERS], h[COUNT]
    total = _slot_sum(h, c, 2, exact_sum)
    if extrema[3] > 0:
        weight, wsum = _slot_sum(h, c, 0, exact_sum), _slot_sum(h, c, 1, exact_sum)
    else:  # unit weights: Σw is the count, Σw·x is Σx
        weight, wsum = (float(count),) if count < EXACT_COUNT else fixed.components(count, 0), total
    if workers == 1:
        m2 = floats[2]
    elif moment:
        m2 = second_moment.m2(total=total, weight=weight, wsum=wsum, t=_slot_sum(h, c, 3, exact_sum))
    else:  # no chain reads this column's merged m2
        m2 = math.nan
    rest: Rest = () if len(weight) < 3 and len(wsum) < 3 and len(total) < 3 else (weight[2:], wsum[2:], total[2:])
    lowest, highest = (math.nan, math.nan) if h[NAN_MINMAX] else (-extrema[1], extrema[0])
    return _new(
        Summary,
        (
            count,
            weight[0], weight[1] if len(weight) > 1 else 0.0,
            wsum[0], wsum[1] if len(wsum) > 1 else 0.0,
            total[0], total[1] if len(total) > 1 else 0.0,
            m2, lowest, highest, floats[0], floats[1], rest, None,
        ),
    )


def _slot_sum(h: list[int], c: int, slot: int, exact_sum: ExactSum) -> tuple[float, ...]:
    """One slot's exact sum: IEEE's sum of the non-finite terms where there are any, else ``exact_sum``'s
    components (a zero sum is -0.0 when every worker's is)."""
    base = NONFINITE + 4 * slot
    nan, pos, neg = h[base], h[base + 1], h[base + 2]
    if nan or pos or neg:
        if nan or (pos and neg):
            return (math.nan,)
        return (math.inf if pos else -math.inf,)
    held = exact_sum(c, slot)
    if held is None:
        return (-0.0,) if h[base + 3] == h[WORKERS] else (0.0,)
    return held
