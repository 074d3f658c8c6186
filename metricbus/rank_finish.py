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
(:func:`metricbus.extract.double_double`, which says where that sum is exact). Where each slot's limbs lie in the
sums, and what else the sums pass and this step read of the agreed maxima, is found once per maxima (:func:`plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, overload

import numpy as np

from metricbus import extract, fixed, second_moment
from metricbus.fixed import Array
from metricbus.summary import N_FIELDS, Rest, Summary

SLOTS = 4  # the exact sums of a column: weight, wsum, total, t
# the fixed slots, per column: count, workers, first/last/m2 bits, then per slot NaN, +inf, -inf, -0.0 counts, then
# the workers with a NaN min or max, with a +0.0 max, with a -0.0 min (which zero a zero extreme is: signed_zero)
COUNT, WORKERS, FIRST, LAST, M2 = 0, 1, 2, 3, 4
NONFINITE = 5  # + 4 * slot + (0 NaN, 1 +inf, 2 -inf, 3 -0.0)
NAN_MINMAX = NONFINITE + 4 * SLOTS
POSITIVE_ZERO_MAX = NAN_MINMAX + 1
NEGATIVE_ZERO_MIN = NAN_MINMAX + 2
NS = NAN_MINMAX + 3
EXACT_COUNT = 2**53  # a count below this is its own float
# the maxima, per column: E of each slot, -Q of each slot, max, -min, -rank, whether any worker has weights
NM = 2 * SLOTS + 4
MAXIMUM, NEG_MINIMUM, NEG_RANK, WEIGHTED = range(2 * SLOTS, NM)

Quick = tuple[Array, Array, Array] | None  # one slot's (hi, lo, ok) per column; None: ask exact_sum everywhere
ExactSum = Callable[[int, int], tuple[float, ...] | None]  # (column, slot) -> components, None for a zero sum

_WIDEST = 9  # limbs: a wider slot (a span beyond ~200 bits, which a double-double rarely holds) takes Python ints
_LIMB_LIMIT = 1 << 36
# the two 48-bit pieces of limbs a, b, c (planned_limb_sums): (a >> 0) + ((b & 0xFFFF) << 32), (b >> 16) + (c << 16)
_SHIFT_DOWN = np.array([0, 16], dtype=np.int64)[:, None, None]
_KEPT_BITS = np.array([0xFFFF, -1], dtype=np.int64)[:, None, None]
_SHIFT_UP = np.array([32, 16], dtype=np.int64)[:, None, None]
_new = tuple.__new__
BITS_FIELDS = [10, 11, 7]  # the Summary fields whose bits the fixed slots FIRST, LAST, M2 carry: first, last, m2


@dataclass(frozen=True, slots=True)
class LimbPlan:
    """Where :func:`limb_sums` reads each slot's limbs and at what exponents, found once per layout."""

    empty: Array  # (n,) bool: the slots with no limbs (a zero sum)
    live: Array  # the slots read: every other one's window is wider than _WIDEST limbs
    inside: Array  # (3, G, m) bool: limb 3·g + k of live slot j at [k, g, j] lies in its window
    at: Array  # (3, G, m) int64: that limb's position in the sums (0 outside the window)
    exponents: Array  # (2·G, m) int64: the exponent of each 48-bit piece of three limbs


def limb_plan(nq_max: Array, offsets: Array, sizes: Array) -> LimbPlan:
    """The :class:`LimbPlan` of slots whose limbs start at ``offsets``, ``sizes`` of them, at ``Q = -nq_max``."""
    live = np.flatnonzero((sizes > 0) & (sizes <= _WIDEST))
    widths = sizes[live]
    groups = -(-int(widths.max(initial=0)) // 3)
    limb = np.arange(3 * groups).reshape(groups, 3).T[:, :, None]
    inside = limb < widths
    at = np.where(inside, offsets[live] + limb, 0)
    exponents = 48 * np.arange(2 * groups)[:, None] - nq_max[live].astype(np.int64)
    return LimbPlan(sizes == 0, live, inside, at, exponents)


def limb_sums(summed: Array, nq_max: Array, offsets: Array, sizes: Array) -> tuple[Array, Array, Array]:
    """Per slot ``(hi, lo, ok)`` of the exact sum ``Σ_i c_i · 2**(32·i + Q)`` of its int64 limbs ``c_i`` (at
    ``summed[offsets[s]:offsets[s] + sizes[s]]``, ``Q = -nq_max[s]``); an empty slot is a zero sum."""
    return planned_limb_sums(summed, limb_plan(nq_max, offsets, sizes))


def planned_limb_sums(summed: Array, where: LimbPlan) -> tuple[Array, Array, Array]:
    """:func:`limb_sums` with the slots' :class:`LimbPlan`."""
    n = where.empty.shape[0]
    hi, lo, ok, live = np.zeros(n), np.zeros(n), where.empty.copy(), where.live
    if not live.size:
        return hi, lo, ok
    limbs = np.where(where.inside, summed[where.at], 0)
    # Three limbs a, b, c are a + b·2**32 + c·2**64 = (a + (b mod 2**16)·2**32) + (b // 2**16 + c·2**16)·2**48:
    # below 2**53 each (exact doubles) where every |limb| < 2**36 (a few thousand terms of the slot). Piece 2·g + k
    # of a slot is the k-th of these of its limbs 3·g, 3·g + 1, 3·g + 2.
    pieces = (limbs[0:2] >> _SHIFT_DOWN) + ((limbs[1:3] & _KEPT_BITS) << _SHIFT_UP)
    pieces = pieces.transpose(1, 0, 2).reshape(-1, live.size)
    used = np.nonzero(pieces.any(axis=1))[0]
    if not used.size:
        ok[live] = True
        return hi, lo, ok
    first, last = int(used[0]), int(used[-1]) + 1
    with np.errstate(over="ignore"):
        parts = np.ldexp(pieces[first:last].astype(np.float64), where.exponents[first:last])
    hi[live], lo[live], found = extract.double_double(list(parts), live.size)
    ok[live] = found & (np.abs(limbs).max(axis=(0, 1)) < _LIMB_LIMIT)
    return hi, lo, ok


@dataclass(frozen=True, slots=True)
class Layout:
    """What the sums pass and the finish read of one agreed (or guessed) maxima, found once per maxima."""

    nq_max: Array  # (C * SLOTS,) float64: each slot's agreed -Q
    offsets: Array  # (C * SLOTS,) int64: where each slot's limbs start after the fixed slots
    sizes: Array  # (C * SLOTS,) int64: each slot's number of limbs
    total: int  # the length of the sums
    starts: Array  # each slot's 2**Q as a bit position in the sums (fixed.bit_starts)
    weighted: Array  # (C,) bool: the columns some worker weights (their weight and wsum have limbs)
    unweighted: Array  # (C,) bool: those no worker weights
    n_weighted: int
    lowest: Array  # (C,) int64: the lowest rank that has each column (2**53 where none has it)
    limbs: LimbPlan
    caps: Array  # (C, 2 * SLOTS): each slot's E where it holds terms (else -inf), then its -Q (speculate.holds)


def plan(agreed: Array) -> Layout:
    """The :class:`Layout` of ``agreed`` maxima, found once per maxima (a steady commit's sums and finish read the
    same guess's, commit after commit; the few latest are kept)."""
    global _plans
    held = _plans  # one tuple: a reader on another thread sees keys and their own layouts
    frozen = not agreed.flags.writeable and agreed.flags.owndata  # (a frozen array is known again by identity)
    if frozen and held and held[0][1] is agreed:
        return held[0][2]  # the frozen array the last layout was found for (a steady commit's guess)
    key = agreed.tobytes()
    for i, (held_key, _, found) in enumerate(held):
        if held_key == key:
            if frozen:  # first, known by identity
                _plans = ((key, agreed, found), *held[:i], *held[i + 1 :])
            return found
    found = _plan_of(agreed)
    limbs = found.limbs
    for value in (*map(found.__getattribute__, found.__slots__), *map(limbs.__getattribute__, limbs.__slots__)):
        if isinstance(value, np.ndarray):  # kept and shared: read-only
            value.flags.writeable = False
    _plans = ((key, agreed if frozen else None, found), *held[: _KEPT_PLANS - 1])
    return found


_KEPT_PLANS = 4
_plans: tuple[tuple[bytes, Any, Layout], ...] = ()  # (the maxima's bytes, the array they were read from, layout)


def _plan_of(agreed: Array) -> Layout:
    """:func:`plan`, found (an unweighted column has no weight and wsum limbs: its count and Σx say them)."""
    n_cols = agreed.shape[0]
    weighted, unweighted = agreed[:, WEIGHTED] > 0, agreed[:, WEIGHTED] == 0
    e_max = agreed[:, :SLOTS].copy()
    e_max[unweighted, :2] = fixed.NONE
    nq_max = agreed[:, SLOTS : 2 * SLOTS].flatten()  # a copy: the layout outlives the caller's array
    sizes = fixed.widths(e_max.ravel(), nq_max)
    ends = np.cumsum(sizes) + n_cols * NS
    offsets = ends - sizes
    caps = agreed[:, : 2 * SLOTS].copy()
    caps[:, :SLOTS][caps[:, :SLOTS] == fixed.NONE] = -np.inf  # no term fits a slot the guess holds empty
    return Layout(
        nq_max=nq_max,
        offsets=offsets,
        sizes=sizes,
        total=int(ends[-1]) if n_cols else 0,
        starts=fixed.bit_starts(nq_max, offsets),
        weighted=weighted,
        unweighted=unweighted,
        n_weighted=int(weighted.sum()),
        lowest=-agreed[:, NEG_RANK].astype(np.int64),
        limbs=limb_plan(nq_max, offsets, sizes),
        caps=caps,
    )


class Merged(MutableSequence[Summary | None]):
    """Each column's merged Summary (None: no worker has it), built on first use: the columns that took the fast
    path are held as one array until then (a steady torch.distributed commit reads only the array). ``fields``
    (N_FIELDS, m) is that array where every column a worker has took the fast path (else None, and None once an
    item is replaced): the ``as_tuple()`` of ``self[c]`` in column ``j`` for ``c = picks[j]`` (``picks`` None: every
    column, in order)."""

    __slots__ = ("_built", "_columns", "_counts", "_n", "_others", "fields", "picks")

    def __init__(self, *, n: int, columns: Array, counts: Array, picks: Array | None, others: dict[int, Summary]):
        self._n = n
        self._columns = columns  # the fast columns' fields (counts as float64)
        self._counts = counts  # their counts (int64)
        self._others = others  # the other columns a worker has: their Summaries
        self._built: list[Summary | None] | None = None
        self.fields = None if others else columns
        self.picks = picks

    def _items(self) -> list[Summary | None]:
        built = self._built
        if built is None:
            rows = zip(self._counts.tolist(), *self._columns[1:].tolist(), repeat(()), repeat(None))
            fast: list[Summary | None] = list(map(_new, repeat(Summary), rows))
            if self.picks is None:
                built = fast
            else:
                built = [None] * self._n
                for c, state in zip(self.picks.tolist(), fast, strict=True):
                    built[c] = state
            for c, state in self._others.items():
                built[c] = state
            self._built = built
        return built

    @overload
    def __getitem__(self, index: int) -> Summary | None: ...
    @overload
    def __getitem__(self, index: slice) -> list[Summary | None]: ...
    def __getitem__(self, index: int | slice) -> Summary | list[Summary | None] | None:
        return self._items()[index]

    @overload
    def __setitem__(self, index: int, value: Summary | None) -> None: ...
    @overload
    def __setitem__(self, index: slice, value: Iterable[Summary | None]) -> None: ...
    def __setitem__(self, index: Any, value: Any) -> None:
        self._items()[index] = value
        self.fields = None

    def __delitem__(self, index: int | slice) -> None:
        raise TypeError("a Merged holds one item per column: replace an item instead")

    def insert(self, index: int, value: Summary | None) -> None:
        raise TypeError("a Merged holds one item per column: replace an item instead")

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Summary | None]:
        return iter(self._items())


def assemble(head: Array, extrema: Array, moments: Array, quick: Sequence[Quick], exact_sum: ExactSum) -> Merged:
    """Each column's Summary (None: no worker has it) from its fixed slots ``head`` (C, NS), ``extrema`` (C, 4: max,
    -min, -lowest rank, weighted), the ``quick`` sums of each slot and ``exact_sum`` where those are not ``ok``."""
    n_cols = head.shape[0]
    workers, count = head[:, WORKERS], head[:, COUNT]
    weighted = extrema[:, 3] > 0
    flagged = bool(head[:, NONFINITE:].any())  # (rarely) either of:
    rare = flagged and bool(head[:, NONFINITE:NAN_MINMAX].any())  # a non-finite or -0.0 sum in some column
    odd_ends = flagged and bool(head[:, NAN_MINMAX:].any())  # a NaN min or max, a -0.0 min or a +0.0 max in some column
    # a merged m2 (exact integer arithmetic) or a count beyond 2**53 takes the per-column path
    slow = count >= EXACT_COUNT
    if moments.any():
        slow |= moments & (workers > 1)
    total_hi, total_lo, bad = _slot(head, workers, 2, quick[2], rare=rare)
    slow |= bad
    any_weighted = bool(weighted.any())
    if any_weighted:
        weight_hi, weight_lo, bad_weight = _slot(head, workers, 0, quick[0], rare=rare)
        wsum_hi, wsum_lo, bad_wsum = _slot(head, workers, 1, quick[1], rare=rare)
        slow |= weighted & (bad_weight | bad_wsum)
    every = not slow.any() and bool(workers.all())
    picks: Any = slice(None) if every else np.flatnonzero((workers > 0) & ~slow)
    columns = np.empty((N_FIELDS, n_cols if every else picks.size))  # float64: the count's int64 converts exactly
    columns[0] = count[picks]
    columns[5], columns[6] = total_hi[picks], total_lo[picks]
    if any_weighted:
        chosen = weighted[picks]
        columns[1] = np.where(chosen, weight_hi[picks], columns[0])
        columns[2] = np.where(chosen, weight_lo[picks], 0.0)
        columns[3] = np.where(chosen, wsum_hi[picks], columns[5])
        columns[4] = np.where(chosen, wsum_lo[picks], columns[6])
    else:  # unit weights: Σw is the count, Σw·x is Σx
        columns[1], columns[2], columns[3:5] = columns[0], 0.0, columns[5:7]
    columns[BITS_FIELDS] = head[picks, FIRST : M2 + 1].view(np.float64).T  # first, last, m2
    single = workers[picks] == 1
    if not single.all():  # several workers, no chain reads the merged m2: not computed
        columns[7, ~single] = math.nan
    columns[8:10] = extrema[picks, 1::-1].T  # -min, max
    np.negative(columns[8], out=columns[8])
    if odd_ends:
        for f, signed, counted in ((8, -0.0, NEGATIVE_ZERO_MIN), (9, 0.0, POSITIVE_ZERO_MAX)):
            hit = head[picks, counted] != 0
            if hit.any():
                columns[f] = np.where((columns[f] == 0.0) & hit, signed, columns[f])
        nan = head[picks, NAN_MINMAX] != 0
        if nan.any():
            columns[8:10, nan] = math.nan
    others: dict[int, Summary] = {}
    slow_ones = () if every else np.flatnonzero((workers > 0) & slow).tolist()
    if slow_ones:
        found = _quick_or_exact(quick, exact_sum)
        for c in slow_ones:
            others[c] = column(head[c].tolist(), extrema[c].tolist(), bool(moments[c]), c, found)
    return Merged(n=n_cols, columns=columns, counts=count[picks], picks=None if every else picks, others=others)


def _slot(head: Array, workers: Array, slot: int, quick: Quick, *, rare: bool) -> tuple[Array, Array, Array]:
    """One slot's ``(hi, lo, bad)`` per column: IEEE's sum of the non-finite terms where there are any, a signed
    zero for a zero sum, else the quick sum; ``bad`` where that is not known exact (then ask ``exact_sum``).
    ``rare``: whether any column counts non-finite terms (else none is looked for)."""
    base = NONFINITE + 4 * slot
    n_cols = head.shape[0]
    hi, lo, ok = (np.zeros(n_cols), np.zeros(n_cols), np.zeros(n_cols, dtype=bool)) if quick is None else quick
    zero = hi == 0.0
    if zero.any():  # a zero sum is -0.0 when every worker's is
        hi = np.where(zero, np.where(head[:, base + 3] == workers, -0.0, 0.0), hi)
        lo = np.where(zero, 0.0, lo)
    lo = lo + 0.0  # a zero remainder is +0.0, as the components' absent lo
    special = head[:, base : base + 3].any(axis=1) if rare else None  # NaN, +inf, -inf terms
    if special is None or not special.any():
        return hi, lo, ~ok
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
    if lowest == 0.0 and h[NEGATIVE_ZERO_MIN]:
        lowest = -0.0
    if highest == 0.0 and h[POSITIVE_ZERO_MAX]:
        highest = 0.0
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
