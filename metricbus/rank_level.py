"""The rank level: many workers' states of a column merged exactly, in two order-free passes.

A *column* is one rank-level input of a metric (a worker-level state, lifted where the chain's update kind differs
from its rank kind); a *block* holds R workers' Summaries of C columns. Merging a column across workers needs only
two associative passes, so under torch.distributed it costs two collectives of O(C) values, whatever R:

1. **maxima** (all_reduce MAX, float64, ``NM`` per column): per sum slot the largest exponent ``E`` and the
   negated smallest ``Q`` (see :mod:`metricbus.fixed`), ``max``, ``-min`` and ``-rank`` (so every participant
   learns the lowest rank that has the column);
2. **sums** (all_reduce SUM, int64): ``NS`` fixed slots per column (count, number of workers, the bit patterns of
   ``first``/``last``/``m2`` contributed only by the lowest rank, counts of NaN/±inf/-0.0 terms and of the workers
   whose ``min`` is -0.0 or whose ``max`` is +0.0), then the limbs of
   the four exact sums Σw, Σw·x, Σx and ``t`` (below), aligned to the agreed exponents.

The result (:func:`finish`) is, per column: ``count``, ``weight``, ``wsum``, ``total`` as the greedy components of
the exact sums (bit for bit what :meth:`Summary.merge` gives, in any grouping); ``min``/``max`` (NaN if any worker's
is NaN; -0.0 below +0.0, :mod:`metricbus.signed_zero`); ``first``/``last`` from the lowest rank that has the
column; and ``m2``:

* one worker has the column: its own ``m2``, unchanged (so the rank level of one worker is the identity);
* several, where a chain reads it (the column's rank kind is ``std``): ``m2 = Σ t_r - S²/W`` with
  ``t_r = m2_r + S_r²/W_r`` (``S`` = Σw·x, ``W`` = Σw). Each ``t_r`` is a short expansion computed by the same
  numpy code on every path, exact but for a term of ~2**-150 · W_r·mean_r² (:func:`second_moment.t_parts`);
  ``Σ t_r`` is exact, and ``(T·W - S²)/W`` is evaluated in exact integer arithmetic, then correctly rounded. So
  ``m2`` is the same bits on every path, exactly 0 for a constant metric, and its error beyond the workers' own
  ``m2_r`` is at most ``(2**-140 · (1 + mean²/variance) + 2**-52) · m2`` (tests/test_rank_level.py,
  tests/test_review_exactness_2.py): the final rounding alone at mean 1e9 and spread 1e-6;
* several, where no chain reads it: NaN (not computed: ``t`` costs as much as the rest of the merge).

Unit weights (every worker's Σw is its count and Σw·x its Σx, the common case) are agreed in pass 1, and such a
column sends no limbs for Σw and Σw·x.

Every path (a single process's workers, the driver's ``ingest()``, journal replay, torch.distributed) computes
:func:`maxima`, :func:`sums` and :func:`finish` on its rows, so live, ingest and replay agree bit for bit. The
Summaries are assembled column-wise, vectorized, by :mod:`metricbus.rank_finish`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, replace

import numpy as np

from metricbus import exact, extract, fixed, rank_finish, second_moment, signed_zero, sketch_level
from metricbus.fixed import Array
from metricbus.native import speedups
from metricbus.rank_finish import (
    BITS_FIELDS,
    COUNT,
    FIRST,
    M2,
    NAN_MINMAX,
    NEGATIVE_ZERO_MIN,
    NONFINITE,
    POSITIVE_ZERO_MAX,
    WORKERS,
)
from metricbus.sketch import Sketch, unknown
from metricbus.summary import N_FIELDS, Summary, with_sketch

SLOTS = rank_finish.SLOTS  # the exact sums of a column: weight, wsum, total, t
# maxima, per column: E of each slot, -Q of each slot, max, -min, -rank, whether any worker has weights
NM = rank_finish.NM
_MAX, _NEG_MIN, _NEG_RANK, _WEIGHTED = range(2 * SLOTS, NM)
NS = rank_finish.NS  # sums, per column: fixed slots (count, workers, first/last/m2 bits, non-finite and -0.0 counts)
ABSENT_RANK = -float(2**53)  # -rank of a column no worker has
_EMPTY_FIELDS = Summary().as_tuple()


@dataclass(frozen=True, slots=True)
class Block:
    """R workers' Summaries of C columns, field-major: ``fields[:, r, c]`` is ``as_tuple()`` (count 0: the worker
    lacks the column)."""

    fields: Array  # (N_FIELDS, R, C) float64
    ranks: Array  # (R,) int64: each row's rank (the order first/last follow)
    moments: Array  # (C,) bool: the columns whose merged m2 is read (see the module docstring)
    rests: tuple[tuple[int, int, int, tuple[float, ...]], ...] = ()  # (row, column, sum 0..2, further components)
    sketches: tuple[tuple[int, int, Sketch], ...] = ()  # (row, column, its sketch) where a state carries one


def block_of(rows: Sequence[Sequence[Summary | None]], ranks: Sequence[int], moments: Sequence[bool]) -> Block:
    """A block from per-worker lists of per-column Summaries (None: the worker lacks the column)."""
    width = len(moments)
    flat: list[float] = []
    rests: list[tuple[int, int, int, tuple[float, ...]]] = []
    sketches: list[tuple[int, int, Sketch]] = []
    for r, row in enumerate(rows):
        for c, state in enumerate(row):
            if state is None or not state.count:
                flat.extend(_EMPTY_FIELDS)
                continue
            flat.extend(state.as_tuple())
            if state.rest:
                rests.extend((r, c, which, parts) for which, parts in enumerate(state.rest) if parts)
            if state.sketch is not None:
                sketches.append((r, c, state.sketch))
    fields = np.array(flat, dtype=np.float64).reshape(len(rows), width, N_FIELDS).transpose(2, 0, 1).copy()
    ranks_of = np.asarray(ranks, dtype=np.int64)
    return Block(fields, ranks_of, np.asarray(moments, dtype=bool), tuple(rests), tuple(sketches))


@dataclass(frozen=True, slots=True)
class Prepared:
    """What both passes read of a block, computed once."""

    block: Block
    present: Array  # (R, C) bool
    unit: Array  # (R, C) bool: present, unit weights (weight = count, Σw·x = Σx), no further weight components
    weighted: Array  # (R, C) bool: present, not unit
    sources: tuple[tuple[int, Array], ...]  # (slot, (n, C) values): the dense terms of each sum slot
    extra: fixed.Terms  # the rests' further components
    t_hi: Array | None  # (R, C): t's leading part where the column's m2 is merged (moments), else 0; None: none
    dense: fixed.Terms  # the sources' terms, decomposed once for both passes


def prepare(block: Block) -> Prepared:
    """Gather a block's sum terms once for both passes."""
    return _prepared(block, decompose=True)


def _prepared(block: Block, *, decompose: bool) -> Prepared:
    """:func:`prepare`; without ``decompose`` the dense terms are left out (the one-process merge extracts)."""
    fields = block.fields
    present = fields[0] > 0
    # weight = count, wsum = total (hi and lo), no weight_lo
    unit = present & (fields[2] == 0.0) & (fields[_UNIT_OF] == fields[_UNIT_IS]).all(axis=0)
    for r, c, which, _ in block.rests:
        if which < 2:
            unit[r, c] = False
    sources: list[tuple[int, Array]] = [(2, fields[5]), (2, fields[6])]
    t_hi = None
    chosen = present & block.moments if block.moments.any() else None
    if chosen is not None and chosen.any():
        where = np.nonzero(chosen)
        rests: list[Array | None] = [None, None]  # Σw's and Σw·x's further components, summed, where any
        for r, c, which, parts in block.rests:
            if which < 2 and chosen[r, c]:
                if rests[which] is None:
                    rests[which] = np.zeros(present.shape)
                rests[which][r, c] = _summed(parts)  # type: ignore[index]
        picked = [None if rest is None else rest[where] for rest in rests]
        for part in second_moment.t_parts(fields[:, where[0], where[1]], *picked):
            held = np.zeros(present.shape)
            held[where] = part
            sources.append((3, held))
        t_hi = sources[2][1]  # the leading part: NaN or ±inf where t is not finite
    weighted = present ^ unit  # (unit rows are present)
    if weighted.any():
        sources.extend((slot, np.where(weighted, fields[f], 0.0)) for slot, f in ((0, 1), (0, 2), (1, 3), (1, 4)))
    extra = fixed.NO_TERMS
    if block.rests:
        values = [x for _, _, _, parts in block.rests for x in parts]
        slots = [c * SLOTS + w for _, c, w, parts in block.rests for _ in parts]
        extra = fixed.decompose(np.array(values, dtype=np.float64), np.array(slots, dtype=np.int64))
    dense = _terms(sources) if decompose else fixed.NO_TERMS
    return Prepared(block, present, unit, weighted, tuple(sources), extra, t_hi, dense)


_UNIT_OF, _UNIT_IS = [1, 3, 4], [0, 5, 6]  # a unit row's weight, wsum, wsum_lo equal its count, total, total_lo


def _summed(parts: tuple[float, ...]) -> float:
    """The correctly rounded sum of a state's further components (greedy: the first carries the sign), ±inf
    beyond the double range (then ``t`` is inf: the merged second moment overflows, as it does from ``S²/W``)."""
    try:
        return math.fsum(parts)
    except OverflowError:  # (a Σw·x of records near the top of the range, in several components)
        return math.copysign(math.inf, parts[0])


def _terms(sources: Sequence[tuple[int, Array]]) -> fixed.Terms:
    """The terms of dense sources (each an (R, C) matrix), each matrix's column ``c`` in slot ``c * SLOTS + slot``."""
    rows, n_cols = sources[0][1].shape
    values = np.concatenate([v.ravel() for _, v in sources])
    slots = tuple(slot for slot, _ in sources)
    index = _slot_index if len(values) <= _CACHED_TERMS else _slot_index.__wrapped__
    return fixed.decompose(values, index(slots, rows, n_cols))


_CACHED_TERMS = 1 << 13  # the slot index of blocks up to this many dense terms is kept (64 KiB each, 64 shapes)


@functools.lru_cache(maxsize=64)
def _slot_index(slots: tuple[int, ...], rows: int, n_cols: int) -> Array:
    """The slot of each of :func:`_terms`' values (read-only: it is shared)."""
    at = np.arange(n_cols, dtype=np.int64) * SLOTS + np.array(slots, dtype=np.int64)[:, None, None]
    out = np.broadcast_to(at, (len(slots), rows, n_cols)).ravel()
    out.flags.writeable = False
    return out


# -- the two passes ---------------------------------------------------------------------------------------------------


def maxima(prep: Prepared, *, extrema: bool = True) -> Array:
    """Pass 1: the (C, NM) float64 maxima of this block's rows (all_reduce MAX them across participants). Without
    ``extrema`` the last four per column are left unset (a one-pass commit reads only the exponents; it sets them
    with :func:`set_extrema` where it runs the maxima pass after all)."""
    unit, fields = prep.unit, prep.block.fields
    n_cols = fields.shape[2]
    e_max, nq_max = fixed.scan(fixed.concat(prep.dense, prep.extra), n_cols * SLOTS)
    out = np.empty((n_cols, NM))
    out[:, :SLOTS] = e_max.reshape(n_cols, SLOTS)
    out[:, SLOTS : 2 * SLOTS] = nq_max.reshape(n_cols, SLOTS)
    # Unit rows' weight is their count (an integer: Q = 0 is low enough), their Σw·x their Σx: their exponents
    # bound those slots too, in case another worker's weights make the column weighted.
    floor = out[:, _FLOOR_OF]  # per column: E of the count (below), E of Σx, -Q of the count (0), -Q of Σx
    floor[:, 0] = np.frexp(_row_max(np.where(unit, fields[0], 0.0), 0.0))[1]
    floor[:, 2] = 0.0
    out[:, _FLOORED] = np.maximum(out[:, _FLOORED], np.where(_row_max(unit, False)[:, None], floor, fixed.NONE))
    if extrema:
        set_extrema(prep, out)
    return out


def set_extrema(prep: Prepared, out: Array) -> None:
    """Fill the extrema (max, -min, -lowest rank, weighted) of :func:`maxima`'s ``out`` (in place)."""
    out[:, _MAX:] = _extrema(prep)


_FLOORED = [0, 1, SLOTS, SLOTS + 1]  # E and -Q of Σw and Σw·x, in a column's maxima
_FLOOR_OF = [2, 2, SLOTS + 2, SLOTS + 2]  # those of Σx


def _extrema(prep: Prepared) -> Array:
    """Per column: max, -min, -(the lowest rank that has it), and whether any worker has weights."""
    block, present = prep.block, prep.present
    out = np.empty((block.fields.shape[2], 4))
    ends = block.fields[[9, 8]]  # max, then min (negated below)
    np.negative(ends[1], out=ends[1])
    out[:, :2] = _row_max(np.where(present & ~np.isnan(ends), ends, -np.inf), -np.inf).T  # NaN left out
    out[:, 2] = _row_max(np.where(present, -block.ranks.astype(np.float64)[:, None], ABSENT_RANK), ABSENT_RANK)
    out[:, 3] = _row_max(prep.weighted, False)
    return out


def _row_max(values: Array, initial: float) -> Array:
    """Per column, the largest of (..., R, C) ``values`` and ``initial`` (one row: its own; no value below
    ``initial``, none NaN)."""
    return values[..., 0, :] if values.shape[-2] == 1 else values.max(axis=-2, initial=initial)


def _row_count(mask: Array) -> Array:
    """Per column, how many rows of the (..., R, C) bool ``mask`` are set."""
    return mask[..., 0, :] if mask.shape[-2] == 1 else mask.sum(axis=-2)


def layout(agreed: Array) -> tuple[Array, Array, int]:
    """``(nq_max, offsets, total)``: each slot's agreed -Q and where its limbs start after the fixed slots (an
    unweighted column has no weight and wsum limbs: its count and Σx say them)."""
    found = rank_finish.plan(agreed)
    return found.nq_max, found.offsets, found.total


def sums(prep: Prepared, agreed: Array) -> Array:
    """Pass 2: this block's int64 sum vector under the ``agreed`` maxima (all_reduce SUM it across participants)."""
    block, unit = prep.block, prep.unit
    fields = block.fields
    n_cols = fields.shape[2]
    held = rank_finish.plan(agreed)
    out = np.zeros(held.total, dtype=np.int64)
    terms = [prep.dense]  # a worker's weight and wsum terms make its column weighted everywhere: all kept
    also = unit & held.weighted if held.n_weighted else None  # unit rows of a column another worker weights
    if also is not None and also.any():  # their weight and wsum
        terms.append(_terms([(slot, np.where(also, fields[f], 0.0)) for slot, f in ((0, 0), (1, 5), (1, 6))]))
    extra = prep.extra
    if len(extra.m):
        terms.append(extra.where((extra.slot % SLOTS >= 2) | held.weighted[extra.slot // SLOTS]))
        also_rests = [(c, p) for r, c, which, p in block.rests if which == 2 and also is not None and also[r, c]]
        if also_rests:  # Σx rests of those rows: their Σw·x
            values = [x for _, parts in also_rests for x in parts]
            terms.append(fixed.decompose(np.array(values), np.array([c * SLOTS + 1 for c, p in also_rests for _ in p])))
    fixed.add_limbs(out, fixed.concat(*terms), held.starts)
    _head(prep, held.lowest, out[: n_cols * NS].reshape(n_cols, NS))
    return out


def _head(prep: Prepared, lowest_rank: Array, head: Array) -> None:
    """Fill the (C, NS) int64 fixed slots ``head`` (zeros) of this block's rows (``lowest_rank``: per column, the
    lowest rank having it)."""
    block, present = prep.block, prep.present
    fields = block.fields
    mine = present & (block.ranks[:, None] == lowest_rank)  # at most one row per column
    if fields.shape[1] == 1:  # one row: its own count and fields
        head[:, COUNT] = fields[0, 0]
        head[:, WORKERS] = present[0]
        head[:, FIRST : M2 + 1] = np.where(mine[0], fields[BITS_FIELDS, 0].view(np.int64), 0).T
    else:
        n_cols = fields.shape[2]
        head[:, COUNT] = fields[0].astype(np.int64).sum(axis=0)  # exact beyond 2**53 in all
        head[:, WORKERS] = present.sum(axis=0)
        picked = fields[BITS_FIELDS][:, mine.argmax(axis=0), np.arange(n_cols)].view(np.int64)
        head[:, FIRST : M2 + 1] = np.where(mine.any(axis=0), picked, 0).T
    if prep.t_hi is None and _ordinary(fields):
        return  # (the usual block): no non-finite or zero sum, no NaN or zero min or max: the counts stay 0
    his = fields[_LEADING]  # (slot, R, C): each sum's leading component
    if prep.t_hi is not None:
        his = np.concatenate((his, prep.t_hi[None]))
    stop = NONFINITE + 4 * len(his)
    if not np.isfinite(his).all():
        special = present & ~np.isfinite(his)
        for k, hit in enumerate((np.isnan(his), his == np.inf, his == -np.inf)):
            head[:, NONFINITE + k : stop : 4] = _row_count(special & hit).T
    head[:, NONFINITE + 3 : stop : 4] = _row_count(present & (his.view(np.int64) == signed_zero.NEGATIVE_ZERO_BITS)).T
    low, high = fields[8], fields[9]
    odd = np.isnan(low) | np.isnan(high) | (low == 0.0) | (high == 0.0)  # a NaN or a zero min or max
    if odd.any():  # (rarely): count the workers whose min or max is NaN, whose min is -0.0, whose max is +0.0
        at = np.flatnonzero((odd & present).any(axis=0))  # in those columns only
        low, high, held = low[:, at], high[:, at], present[:, at]
        head[at, NAN_MINMAX] = _row_count(held & (np.isnan(low) | np.isnan(high)))
        head[at, NEGATIVE_ZERO_MIN] = _row_count(held & (low.view(np.int64) == signed_zero.NEGATIVE_ZERO_BITS))
        head[at, POSITIVE_ZERO_MAX] = _row_count(held & (high.view(np.int64) == 0))


_LEADING = [1, 3, 5]  # the leading components of weight, wsum, total (t's is Prepared.t_hi)
_ORDINARY = [1, 3, 5, 8, 9]  # those and min, max: where all are finite and nonzero, _head counts nothing


def _ordinary(fields: Array) -> bool:
    """:func:`_all_finite_nonzero` of the ``_ORDINARY`` rows of ``fields``: in one C pass where it is built."""
    if speedups is not None and fields.flags.c_contiguous and fields.dtype == np.float64:
        return bool(speedups.finite_nonzero(fields, _ORDINARY_ROWS, fields.shape[0]))
    return _all_finite_nonzero(fields[_ORDINARY])


_ORDINARY_ROWS = tuple(_ORDINARY)


def _all_finite_nonzero(values: Array) -> bool:
    """True if every one of ``values`` is finite and nonzero (a NaN fails both comparisons)."""
    size = np.abs(values)
    return bool(((size > 0.0) & (size < math.inf)).all())


def finish(agreed: Array, summed: Array, moments: Array) -> rank_finish.Merged:
    """Each column's merged Summary (None: no worker has it) from the reduced maxima and sums."""
    n_cols = agreed.shape[0]
    held = rank_finish.plan(agreed)
    nq_max, offsets, sizes = held.nq_max, held.offsets, held.sizes
    hi, lo, ok = (a.reshape(n_cols, SLOTS) for a in rank_finish.planned_limb_sums(summed, held.limbs))
    quick = [(hi[:, slot], lo[:, slot], ok[:, slot]) for slot in range(SLOTS)]

    def limbs_of(c: int, slot: int) -> tuple[float, ...] | None:
        i = c * SLOTS + slot
        start = int(offsets[i])
        n = fixed.integer(summed[start : start + int(sizes[i])].tolist())
        return None if n == 0 else fixed.components(n, -int(nq_max[i]))

    return rank_finish.assemble(summed[: n_cols * NS].reshape(n_cols, NS), agreed[:, _MAX:], moments, quick, limbs_of)


def merge_collective(block: Block) -> rank_finish.Merged:
    """Both passes of the collective merge run on one process (what torch.distributed computes, for checks): each
    row stands for one participant, so the sketches' passes run per row and are reduced here."""
    prep = prepare(block)
    agreed = maxima(prep)
    out = finish(agreed, sums(prep, agreed), block.moments)
    columns = sorted({c for _, c, _ in block.sketches})
    if columns:
        rows = sketch_rows(block, columns)
        bounds = np.max([sketch_level.bounds(row) for row in rows.values()], axis=0)
        summed = np.sum([sketch_level.counts(row, bounds) for row in rows.values()], axis=0)
        attach(out, columns, sketch_level.finish(bounds, summed))
    return out


def attach(out: MutableSequence[Summary | None], columns: Sequence[int], sketches: Sequence[Sketch]) -> None:
    """Put each merged sketch on its column's merged Summary (in place)."""
    for c, sketch in zip(columns, sketches, strict=True):
        held = out[c]
        if held is not None:
            out[c] = with_sketch(held, sketch)


def _merge_sketches(out: rank_finish.Merged, block: Block) -> rank_finish.Merged:
    if block.sketches:
        columns = sorted({c for _, c, _ in block.sketches})
        rows = list(sketch_rows(block, columns).values())
        held = [[sketch for row in rows if (sketch := row[i]) is not None] for i in range(len(columns))]
        attach(out, columns, sketch_level.merge(held))
    return out


def sketch_rows(block: Block, columns: Sequence[int]) -> dict[int, list[Sketch | None]]:
    """Per row that has any of ``columns``: its sketch of each (None: no records there). A row with records of a
    column but no sketch (logged before a distribution spec reached that worker) counts them as unknown
    (:func:`metricbus.sketch.unknown`); a sketch of a column not in ``columns`` is left out."""
    at = {c: i for i, c in enumerate(columns)}
    rows: dict[int, list[Sketch | None]] = {}
    for r, c, sketch in block.sketches:
        i = at.get(c)
        if i is not None:
            rows.setdefault(r, [None] * len(columns))[i] = sketch
    counts = block.fields[0][:, list(columns)]  # (R, len(columns))
    held = np.zeros(counts.shape, dtype=bool)
    for r, row in rows.items():
        held[r] = [sketch is not None for sketch in row]
    for r, i in zip(*np.nonzero((counts > 0) & ~held), strict=True):
        rows.setdefault(int(r), [None] * len(columns))[int(i)] = unknown(int(counts[r, i]))
    return rows


def merge(block: Block) -> rank_finish.Merged:
    """The rank level on one process (the driver's ingest, journal replay, a single process's workers): the same
    result as the collective merge, bit for bit (both are exact), with the exact sums found column-wise by
    error-free extraction instead of fixed-point limbs (no exponent pass needed)."""
    prep = _prepared(block, decompose=False)
    extrema = _extrema(prep)
    fields = block.fields
    head = np.zeros((fields.shape[2], NS), dtype=np.int64)
    _head(prep, -extrema[:, 2].astype(np.int64), head)
    weighted = extrema[:, 3] > 0
    by_slot: dict[int, list[Array]] = {}
    for slot, values in prep.sources:
        by_slot.setdefault(slot, []).append(values)
    also = prep.unit & weighted[None, :]
    if also.any():
        for slot, f in ((0, 0), (1, 5), (1, 6)):
            by_slot.setdefault(slot, []).append(np.where(also, fields[f], 0.0))
    width = fields.shape[2]
    try:
        parts = {slot: extract.column_parts(np.concatenate(matrices)) for slot, matrices in by_slot.items()}
    except OverflowError:  # values near the top of the double range: the limbs take any finite double
        return _merge_sketches(merge_collective(replace(block, sketches=())), block)
    extra: dict[tuple[int, int], list[float]] = {}
    for r, c, which, rest in block.rests:
        if which == 2 or (which < 2 and not prep.unit[r, c]):
            extra.setdefault((c, which), []).extend(rest)
        if which == 2 and also[r, c]:
            extra.setdefault((c, 1), []).extend(rest)
    # per slot (hi, lo, ok): the double-double of the parts where that is exact and no rest adds to it
    quick: list[rank_finish.Quick] = [None] * SLOTS
    for slot, arrays in parts.items():
        quick[slot] = extract.double_double(arrays, width)
    for c, slot in extra:
        held = quick[slot]
        if held is not None:
            held[2][c] = False

    def extracted(c: int, slot: int) -> tuple[float, ...] | None:
        more = extra.get((c, slot))
        if slot not in parts:
            return exact.components(more) if more and any(more) else None
        floats = [float(p[c]) for p in parts[slot]]
        if more:
            floats.extend(more)
        return exact.components(floats) if any(floats) else None

    return _merge_sketches(rank_finish.assemble(head, extrema, block.moments, quick, extracted), block)
