"""The rank level: many workers' states of a column merged exactly, in two order-free passes.

A *column* is one rank-level input of a metric (a worker-level state, lifted where the chain's update kind differs
from its rank kind); a *block* holds R workers' Summaries of C columns. Merging a column across workers needs only
two associative passes, so under torch.distributed it costs two collectives of O(C) values, whatever R:

1. **maxima** (all_reduce MAX, float64, ``NM`` per column): per sum slot the largest exponent ``E`` and the
   negated smallest ``Q`` (see :mod:`metricbus.fixed`), ``max``, ``-min`` and ``-rank`` (so every participant
   learns the lowest rank that has the column);
2. **sums** (all_reduce SUM, int64): ``NS`` fixed slots per column (count, number of workers, the bit patterns of
   ``first``/``last``/``m2`` contributed only by the lowest rank, counts of NaN/±inf/-0.0 terms), then the limbs of
   the four exact sums Σw, Σw·x, Σx and ``t`` (below), aligned to the agreed exponents.

The result (:func:`finish`) is, per column: ``count``, ``weight``, ``wsum``, ``total`` as the greedy components of
the exact sums (bit for bit what :meth:`Summary.merge` gives, in any grouping); ``min``/``max`` (NaN if any worker's
is NaN); ``first``/``last`` from the lowest rank that has the column; and ``m2``:

* one worker has the column: its own ``m2``, unchanged (so the rank level of one worker is the identity);
* several: ``m2 = Σ t_r - S²/W`` with ``t_r = m2_r + S_r²/W_r`` (``S`` = Σw·x, ``W`` = Σw). Each ``t_r`` is a
  double-double computed by the same numpy code on every path (error ≤ ~2**-104 · t_r); ``Σ t_r`` is exact, and
  ``(T·W - S²)/W`` is evaluated in exact integer arithmetic, then correctly rounded. So ``m2`` is the same bits on
  every path and under every split of workers, with relative error about ``2**-104 · (mean²/variance)``: ~1e-19
  at mean 1e6 and spread 1e-3 (Chan's pairwise update, used within a worker, is order-dependent).

Every path (a single process's workers, the driver's ``ingest()``, journal replay, torch.distributed) computes
:func:`maxima`, :func:`sums` and :func:`finish` on its rows, so live, ingest and replay agree bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from metricbus import fixed
from metricbus.fixed import Array
from metricbus.summary import N_FIELDS, Summary

SLOTS = 4  # the exact sums of a column: weight, wsum, total, t
# maxima, per column: E of each slot, -Q of each slot, max, -min, -rank
NM = 2 * SLOTS + 3
_MAX, _NEG_MIN, _NEG_RANK = 2 * SLOTS, 2 * SLOTS + 1, 2 * SLOTS + 2
# sums, per column: count, workers, first/last/m2 bits, then per slot NaN, +inf, -inf, -0.0 counts, then NaN min/max
_COUNT, _WORKERS, _FIRST, _LAST, _M2 = 0, 1, 2, 3, 4
_NONFINITE = 5  # + 4 * slot + (0 NaN, 1 +inf, 2 -inf, 3 -0.0)
_NAN_MINMAX = _NONFINITE + 4 * SLOTS
NS = _NAN_MINMAX + 1
ABSENT_RANK = -float(2**53)  # -rank of a column no worker has
_EMPTY_FIELDS = Summary().as_tuple()
_DD_SAFE = 2.0**480  # within (1/_DD_SAFE, _DD_SAFE) the double-double of t_r cannot overflow or underflow


@dataclass(frozen=True, slots=True)
class Block:
    """R workers' Summaries of C columns: ``fields[r, c]`` is ``as_tuple()`` (count 0: the worker lacks it)."""

    fields: Array  # (R, C, N_FIELDS) float64
    ranks: Array  # (R,) int64: each row's rank (the order first/last follow)
    rests: tuple[tuple[int, int, int, tuple[float, ...]], ...] = ()  # (row, column, sum 0..2, further components)

    @property
    def columns(self) -> int:
        """C."""
        return int(self.fields.shape[1])


def block_of(rows: Sequence[Sequence[Summary | None]], ranks: Sequence[int]) -> Block:
    """A block from per-worker lists of per-column Summaries (None: the worker lacks the column)."""
    width = len(rows[0]) if rows else 0
    flat: list[float] = []
    rests: list[tuple[int, int, int, tuple[float, ...]]] = []
    for r, row in enumerate(rows):
        for c, state in enumerate(row):
            if state is None or not state.count:
                flat.extend(_EMPTY_FIELDS)
                continue
            flat.extend(state.as_tuple())
            if state.rest:
                rests.extend((r, c, which, parts) for which, parts in enumerate(state.rest) if parts)
    fields = np.array(flat, dtype=np.float64).reshape(len(rows), width, N_FIELDS)
    return Block(fields, np.asarray(ranks, dtype=np.int64), tuple(rests))


# -- the per-row quantities -----------------------------------------------------------------------------------------


def _two_prod(a: Array, b: Array) -> tuple[Array, Array]:
    p = a * b
    c = 134217729.0 * a
    a_hi = c - (c - a)
    a_lo = a - a_hi
    c = 134217729.0 * b
    b_hi = c - (c - b)
    b_lo = b - b_hi
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def _t_parts(fields: Array) -> tuple[Array, Array]:
    """``t = m2 + S²/W`` of each row as a double-double ``(hi, lo)`` (see the module docstring)."""
    w_hi, w_lo = fields[..., 1], fields[..., 2]
    s_hi, s_lo = fields[..., 3], fields[..., 4]
    m2 = fields[..., 7]
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
    risky &= fields[..., 0] > 0
    if risky.any():
        hi, lo = hi.copy(), lo.copy()
        for index in zip(*np.nonzero(risky), strict=True):
            hi[index], lo[index] = _t_exact(*(float(fields[index][i]) for i in (7, 3, 4, 1, 2)))
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


def _slot_values(block: Block) -> tuple[list[Array], list[Array]]:
    """The sum slots' values of every row, as (column-major) value and slot-index arrays: hi and lo of each sum,
    then the rests' further components."""
    fields = block.fields
    n_rows, n_cols = fields.shape[0], fields.shape[1]
    t_hi, t_lo = _t_parts(fields)
    cols = np.broadcast_to(np.arange(n_cols, dtype=np.int64), (n_rows, n_cols))
    values: list[Array] = []
    slots: list[Array] = []
    for slot, (hi, lo) in enumerate(
        ((fields[..., 1], fields[..., 2]), (fields[..., 3], fields[..., 4]), (fields[..., 5], fields[..., 6]),
         (t_hi, t_lo))
    ):
        index = (cols * SLOTS + slot).ravel()
        values.extend((hi.ravel(), lo.ravel()))
        slots.extend((index, index))
    if block.rests:
        values.append(np.array([x for _, _, _, parts in block.rests for x in parts], dtype=np.float64))
        slots.append(
            np.array([c * SLOTS + which for _, c, which, parts in block.rests for _ in parts], dtype=np.int64)
        )
    return values, slots


# -- the two passes ---------------------------------------------------------------------------------------------------


def maxima(block: Block) -> Array:
    """Pass 1: the (C, NM) float64 maxima of this block's rows (all_reduce MAX them across participants)."""
    fields = block.fields
    n_cols = fields.shape[1]
    out = np.empty((n_cols, NM))
    values, slots = _slot_values(block)
    e_max, nq_max = fixed.scan(np.concatenate(values), np.concatenate(slots), n_cols * SLOTS)
    out[:, :SLOTS] = e_max.reshape(n_cols, SLOTS)
    out[:, SLOTS : 2 * SLOTS] = nq_max.reshape(n_cols, SLOTS)
    present = fields[..., 0] > 0
    with np.errstate(invalid="ignore"):
        highest = np.where(present & ~np.isnan(fields[..., 9]), fields[..., 9], -np.inf)
        lowest = np.where(present & ~np.isnan(fields[..., 8]), -fields[..., 8], -np.inf)
    out[:, _MAX] = highest.max(axis=0, initial=-np.inf)
    out[:, _NEG_MIN] = lowest.max(axis=0, initial=-np.inf)
    neg_rank = np.where(present, -block.ranks.astype(np.float64)[:, None], ABSENT_RANK)
    out[:, _NEG_RANK] = neg_rank.max(axis=0, initial=ABSENT_RANK)
    return out


def layout(agreed: Array) -> tuple[Array, Array, int]:
    """``(nq_max, offsets, total)``: each slot's agreed -Q and where its limbs start after the fixed slots."""
    n_cols = agreed.shape[0]
    e_max = agreed[:, :SLOTS].ravel()
    nq_max = agreed[:, SLOTS : 2 * SLOTS].ravel()
    sizes = fixed.widths(e_max, nq_max)
    offsets = n_cols * NS + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    return nq_max, offsets, int(n_cols * NS + sizes.sum())


def sums(block: Block, agreed: Array) -> Array:
    """Pass 2: this block's int64 sum vector under the ``agreed`` maxima (all_reduce SUM it across participants)."""
    fields = block.fields
    n_cols = fields.shape[1]
    nq_max, offsets, total = layout(agreed)
    values, slots = _slot_values(block)
    out = fixed.limbs(np.concatenate(values), np.concatenate(slots), nq_max, offsets, total)
    head = out[: n_cols * NS].reshape(n_cols, NS)  # a view: the fixed slots
    present = fields[..., 0] > 0
    head[:, _COUNT] = fields[..., 0].sum(axis=0, dtype=np.float64).astype(np.int64)
    head[:, _WORKERS] = present.sum(axis=0)
    lowest_rank = -agreed[:, _NEG_RANK].astype(np.int64)
    mine = present & (block.ranks[:, None] == lowest_rank[None, :])  # at most one row per column
    bits = fields.view(np.int64)
    for slot, field in ((_FIRST, 10), (_LAST, 11), (_M2, 7)):
        head[:, slot] = np.where(mine, bits[..., field], 0).sum(axis=0)
    t_hi, _ = _t_parts(fields)
    for slot, hi in enumerate((fields[..., 1], fields[..., 3], fields[..., 5], t_hi)):
        base = _NONFINITE + 4 * slot
        head[:, base] = (present & np.isnan(hi)).sum(axis=0)
        head[:, base + 1] = (present & (hi == np.inf)).sum(axis=0)
        head[:, base + 2] = (present & (hi == -np.inf)).sum(axis=0)
        head[:, base + 3] = (present & (hi == 0.0) & np.signbit(hi)).sum(axis=0)
    head[:, _NAN_MINMAX] = (present & (np.isnan(fields[..., 8]) | np.isnan(fields[..., 9]))).sum(axis=0)
    return out


def finish(agreed: Array, summed: Array) -> list[Summary | None]:
    """Each column's merged Summary (None: no worker has it) from the reduced maxima and sums."""
    n_cols = agreed.shape[0]
    nq_max, offsets, _ = layout(agreed)
    fixed_part = summed[: n_cols * NS].reshape(n_cols, NS)
    head = fixed_part.tolist()
    floats = fixed_part[:, _FIRST : _M2 + 1].copy().view(np.float64).tolist()  # first, last, m2 bit patterns
    ends = [*offsets[1:].tolist(), len(summed)]
    starts = offsets.tolist()
    q = (-nq_max.astype(np.int64)).tolist()
    maxes = agreed[:, _MAX].tolist()
    neg_mins = agreed[:, _NEG_MIN].tolist()
    out: list[Summary | None] = []
    for c in range(n_cols):
        h = head[c]
        if not h[_WORKERS]:
            out.append(None)
            continue
        exact_sums = []
        for slot in range(SLOTS):
            i = c * SLOTS + slot
            flags = h[_NONFINITE + 4 * slot : _NONFINITE + 4 * slot + 4]
            exact_sums.append(_sum_of(flags, h[_WORKERS], summed[starts[i] : ends[i]], q[i]))
        (weight, wsum, total, t) = exact_sums
        nan_mm = h[_NAN_MINMAX] > 0
        if h[_WORKERS] == 1:
            m2 = floats[c][2]
        else:
            slots = (c * SLOTS, c * SLOTS + 1, c * SLOTS + 3)  # W, S, T
            m2 = _m2(
                finite=math.isfinite(total[0]),
                t_s=(t[0], wsum[0]),
                ints=[(fixed.integer(summed[starts[i] : ends[i]]), q[i]) for i in slots],
            )
        rest = (weight[2:], wsum[2:], total[2:])
        out.append(
            tuple.__new__(
                Summary,
                (
                    h[_COUNT],
                    weight[0], _lo(weight), wsum[0], _lo(wsum), total[0], _lo(total), m2,
                    math.nan if nan_mm else -neg_mins[c],
                    math.nan if nan_mm else maxes[c],
                    floats[c][0],
                    floats[c][1],
                    rest if any(rest) else (),
                ),
            )
        )
    return out


def merge(block: Block) -> list[Summary | None]:
    """Both passes on one process (the driver's ingest, journal replay, a single process's workers)."""
    agreed = maxima(block)
    return finish(agreed, sums(block, agreed))


# -- helpers -----------------------------------------------------------------------------------------------------------


def _lo(parts: tuple[float, ...]) -> float:
    return parts[1] if len(parts) > 1 else 0.0


def _sum_of(flags: list[int], workers: int, limb_values: Array, q: int) -> tuple[float, ...]:
    """The components of one slot's exact sum; IEEE's sum of the non-finite terms where there are any."""
    nan, pos, neg, negzero = flags
    if nan or (pos and neg):
        return (math.nan,)
    if pos:
        return (math.inf,)
    if neg:
        return (-math.inf,)
    n = fixed.integer(limb_values)
    if n == 0:
        return (-0.0,) if negzero == workers else (0.0,)
    return fixed.components(n, q)


def _m2(*, finite: bool, t_s: tuple[float, float], ints: list[tuple[int, int]]) -> float:
    """``(T·W - S²)/W`` in exact integer arithmetic, correctly rounded; ``ints``: ``(n, q)`` of W, S and T, each
    ``n · 2**q`` (non-finite data: NaN; an overflow: inf)."""
    if not finite:
        return math.nan
    if not (math.isfinite(t_s[0]) and math.isfinite(t_s[1])):
        return math.nan if math.isnan(t_s[0]) or math.isnan(t_s[1]) else math.inf
    (w_n, w_q), (s_n, s_q), (t_n, t_q) = ints
    if w_n <= 0:
        return _ratio_float(t_n, t_q)
    e1, e2 = t_q + w_q, 2 * s_q
    low = min(e1, e2)
    top = ((t_n * w_n) << (e1 - low)) - ((s_n * s_n) << (e2 - low))
    if top <= 0:
        return 0.0
    return _ratio_float(top, low - w_q, w_n)


def _ratio_float(num: int, exp: int, den: int = 1) -> float:
    """``num · 2**exp / den`` correctly rounded (inf beyond the range)."""
    try:
        if exp >= 0:
            return (num << exp) / den
        return num / (den << -exp)
    except OverflowError:
        return math.inf if num > 0 else -math.inf
