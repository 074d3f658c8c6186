"""One optimizer update's micro summaries as columns: every metric's fields in one float64 array, vectorized.

At a commit most metrics hold a few plain unit-weight records each (``log(name, float)``, ``log(dict)``).
Summarising them one :meth:`Summary.of_batch` at a time costs ~1 µs of Python per metric, which is most of a
commit of 100 metrics; here all of them are summarised together: their records are joined into one array and each
field is one numpy call over every metric (``reduceat`` over the metrics' segments), the exact sums two error-free
extractions (:func:`_exact_sums`; ``fsum`` for the few they leave). :class:`MicroUpdate` holds the result as a
``(N_FIELDS, K)`` array, the layout of :class:`metricbus.partial.Packed`, so the journal and a single worker's
commit read the columns without a ``Summary`` per metric; anything else reads it as a mapping of Summaries, built on
first use.

The fields are those of :meth:`Summary.of_batch` of each metric's records, bit for bit, except ``m2``: here the
sum of the squared deviations from the correctly rounded mean is numpy's (pairwise) sum, within a few ulps of
``of_batch``'s. Which way a metric's records are summarised depends only on the worker's update (its metrics of
plain records, at most ``FOLD_AT`` each, nothing folded: columns from ``COLUMNS_FROM`` of them), which the journal
keeps, so live, ``export()``/``ingest()`` and replay see the same bits. A metric whose records are not all finite,
whose exact sum needs more than two components or lies beyond the double range, is summarised by ``of_batch``
(and kept as a Summary next to the columns).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress
from operator import is_
from struct import pack as _pack
from typing import Any

import numpy as np

from metricbus import signed_zero
from metricbus.native import speedups
from metricbus.partial import Packed, layout_of, pack, with_fields
from metricbus.sketch import Sketch
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, NEAR, Rest, Summary, near_mean_m2

_fsum = math.fsum
COLUMNS_FROM = 8  # plain metrics in an update from which they are summarised in columns
_new = tuple.__new__
_EXP_TOP = 1020  # _exact_sums takes magnitudes below 2**(_EXP_TOP - M) (so sigma and every partial sum are finite)
_MAX = sys.float_info.max
_QUIET = 2.0**500  # below this magnitude no square of a deviation overflows, and _exact_sums stays in range


class MicroUpdate(Mapping[str, Summary]):
    """One update's micro summaries: ``names`` (with ``fields[:, i]`` the ``as_tuple()`` of name ``i``'s Summary,
    no ``rest``, no sketch) then ``others`` (Summaries of metrics summarised one at a time). Read-only."""

    __slots__ = ("_built", "_index", "fields", "names", "others")

    def __init__(self, *, names: tuple[str, ...], fields: Any, others: dict[str, Summary]) -> None:
        self.names = names
        self.fields = fields
        self.others = others
        self._index: frozenset[str] | None = None
        self._built: dict[str, Summary] = {}

    def __getitem__(self, name: str) -> Summary:
        held = self._built.get(name)
        if held is not None:
            return held
        other = self.others.get(name)
        if other is not None:
            return other
        if not self._built:  # every row at once: one tolist() of the array, far cheaper than a column at a time
            new = _new
            self._built = {
                n: new(Summary, (int(row[0]), *row[1:], (), None))
                for n, row in zip(self.names, self.fields.T.tolist(), strict=True)
            }
        return self._built[name]  # KeyError for an unknown name, as a dict

    def __iter__(self) -> Iterator[str]:
        return iter(self.names) if not self.others else chain(self.names, self.others)

    def __len__(self) -> int:
        return len(self.names) + len(self.others)

    def __contains__(self, name: object) -> bool:
        if name in self.others:
            return True
        index = self._index
        if index is None:
            index = self._index = frozenset(self.names)
        return name in index


def packed_update(
    update: MicroUpdate, specs: Mapping[str, Spec], undeclared: frozenset[str], *, last: Packed | None, same: bool
) -> Packed:
    """``update`` as the packed form of a Partial (its entries: the columns' names, then the others). ``last``, a
    previous one of the same ``undeclared``, lends its specs and layout digest when it has the same names and their
    specs are the same objects (``same``: the caller knows that ``specs`` did not change since ``last``)."""
    names = update.names
    fields = update.fields
    if not update.others and last is not None and same and last.names == names:  # the usual commit
        return with_fields(last, fields)
    rests: tuple[tuple[int, Rest], ...] = ()
    sketches: tuple[tuple[int, Sketch], ...] = ()
    if update.others:
        rest = pack(tuple((name, specs[name], s) for name, s in update.others.items()), frozenset())
        names = names + rest.names
        fields = np.concatenate((fields, rest.fields), axis=1)
        fields.flags.writeable = False
        shift = len(update.names)
        rests = tuple((i + shift, r) for i, r in rest.rests)
        sketches = tuple((i + shift, k) for i, k in rest.sketches)
    of_name = tuple(map(specs.__getitem__, names))
    if last is not None and last.names == names and all(map(is_, last.specs, of_name)):
        return Packed(names, last.specs, fields, rests, last.layout, True, sketches)
    return Packed(names, of_name, fields, rests, layout_of(names, of_name, undeclared), True, sketches)


class Segments:
    """Where each metric's records lie in the joined array of an update's records (``counts``: each metric's
    records, every one >= 1). Built once per list of counts: a collector keeps the last one, as the counts of one
    commit are mostly those of the one before."""

    __slots__ = ("counts", "ends", "n", "near", "scale", "shift", "sigma", "sizes", "starts", "top")

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts
        sizes = np.array(counts, dtype=np.intp)
        starts = np.zeros(len(counts), dtype=np.intp)
        np.cumsum(sizes[:-1], out=starts[1:])
        self.sizes = sizes
        self.starts = starts
        self.ends = np.stack((starts, starts + (sizes - 1)))  # each metric's first and last record
        self.n = sizes.astype(np.float64)
        self.near = self.n * NEAR  # m2 up to near·mean² is taken again (summary.NEAR)
        self.shift = (2 * max(counts) - 1).bit_length()  # M of _exact_sums: 2**M >= twice the longest metric
        self.sigma = 2.0**self.shift
        self.scale = 2.0 ** (self.shift - 53)  # the second extraction's sigma over the first's
        self.top = 2.0 ** (_EXP_TOP - self.shift)  # magnitudes from here are left to fsum (sigma stays finite)

    def rows(self, flat: Any, indices: Iterable[int]) -> list[list[float]]:
        """The records of the metrics at ``indices`` (in order), as lists."""
        counts, starts = self.counts, self.starts.tolist()
        return [flat[starts[i] : starts[i] + counts[i]].tolist() for i in indices]


def joined(chunks: list[list[float]]) -> Any:
    """The records of ``chunks`` (lists of floats) one after another, as a read-only float64 array."""
    floats = [*chain.from_iterable(chunks)]
    return np.frombuffer(_pack(f"{len(floats)}d", *floats), dtype=np.float64)


def summarize(names: list[str], chunks: list[list[float]], others: dict[str, Summary]) -> Mapping[str, Summary]:
    """The micro summaries of ``names``' plain unit-weight records (``chunks``, each non-empty, in log order) and
    ``others`` (already summarised): a :class:`MicroUpdate`, or a dict when no metric has records in columns."""
    if len(names) < COLUMNS_FROM:  # a few metrics: numpy's per-call cost would exceed of_batch's
        for name, chunk in zip(names, chunks, strict=True):
            others[name] = Summary.of_batch(chunk, None)
        return others
    return summarize_joined(names, Segments([*map(len, chunks)]), joined(chunks), others)


def summarize_joined(
    names: Sequence[str], segments: Segments, flat: Any, others: dict[str, Summary]
) -> Mapping[str, Summary]:
    """:func:`summarize` of the records ``flat`` (float64), metric ``i``'s at ``segments`` ``i``."""
    k = len(names)
    if k < COLUMNS_FROM:
        for name, chunk in zip(names, segments.rows(flat, range(k)), strict=True):
            others[name] = Summary.of_batch(chunk, None)
        return others
    fields = np.empty((N_FIELDS, k))
    if speedups is not None and flat.flags.c_contiguous and not speedups.columns(flat, segments.sizes, fields, NEAR):
        fields.flags.writeable = False  # the common case in one C loop, the same bits; else (rare) numpy's below
        return MicroUpdate(names=tuple(names), fields=fields, others=others)
    low = np.minimum.reduceat(flat, segments.starts, out=fields[8])
    high = np.maximum.reduceat(flat, segments.starts, out=fields[9])
    big = np.maximum(np.negative(low), high)  # each metric's largest magnitude (NaN where it has a NaN)
    largest = big.max()
    if not largest <= _MAX:  # a NaN or an infinity
        finite = math.isfinite
        rows = segments.rows(flat, range(k))
        return _split(names, segments, flat, others, [i for i, c in enumerate(rows) if not all(map(finite, c))])
    if largest < _QUIET:
        return _columns(names, segments, flat, others, fields=fields, big=big)
    with np.errstate(over="ignore", invalid="ignore"):  # a square beyond the double range: inf, as of_batch's
        return _columns(names, segments, flat, others, fields=fields, big=big)


def _columns(
    names: Sequence[str], segments: Segments, flat: Any, others: dict[str, Summary], *, fields: Any, big: Any
) -> Mapping[str, Summary]:
    """The rest of :func:`summarize_joined` for finite records (``fields``: min and max filled in)."""
    total, lo, unsettled = _exact_sums(flat, segments, big)
    if unsettled:  # fsum, as of_batch, where the extraction does not settle the sum
        if lo is None:
            lo = np.zeros(len(names))
        left = _settle(segments.rows(flat, unsettled), unsettled, total, lo)
        if left:
            return _split(names, segments, flat, others, left)
    negative_zero = flat.view(np.int64).min() == signed_zero.NEGATIVE_ZERO_BITS  # its bits are the least int64
    sizes, starts = segments.sizes, segments.starts
    if negative_zero:  # a zero sum is -0.0 where every record is (signed_zero.of_sum), else +0.0
        negative = np.add.reduceat((flat.view(np.int64) == signed_zero.NEGATIVE_ZERO_BITS).astype(np.intp), starts)
        total = np.where(total == 0.0, np.where(negative == sizes, -0.0, 0.0), total)
    means = total / segments.n
    deviations = flat - np.repeat(means, sizes)
    deviations *= deviations
    m2 = np.add.reduceat(deviations, starts, out=fields[7])
    bound = np.multiply(means, means)  # (below _QUIET no overflow; above it summarize_joined's errstate is on)
    bound *= segments.near
    near = [i for i in np.flatnonzero(m2 <= bound).tolist() if m2[i]]  # (m2 == 0: nothing to take again)
    if near:  # a spread tiny next to the mean (summary.NEAR); rows() lists every start: only when needed
        for i, row in zip(near, segments.rows(flat, near), strict=True):
            num = (float(total[i]), 0.0 if lo is None else float(lo[i]))
            m2[i] = near_mean_m2(row, None, num, (float(len(row)), 0.0))
    fields[0:2] = segments.n  # count, weight
    fields[3:6:2] = total  # total (hi), wsum (hi)
    if lo is None:
        fields[2:7:2] = 0.0  # weight_lo, wsum_lo, total_lo
    else:
        fields[2] = 0.0
        fields[4:7:2] = lo
    fields[10:12] = flat[segments.ends]  # first, last (np.take with out= buffers: slower)
    if negative_zero:  # a zero min or max may tie -0.0 with +0.0: -0.0 is below (signed_zero)
        signed_zero.segments(fields[8], flat, starts, minimum=True)
        signed_zero.segments(fields[9], flat, starts, minimum=False)
    fields.flags.writeable = False
    return MicroUpdate(names=tuple(names), fields=fields, others=others)


def _exact_sums(flat: Any, segments: Segments, big: Any) -> tuple[Any, Any, list[int]]:
    """Each metric's exact sum as ``(total, lo)``: ``total`` its correct rounding (fsum's) and ``lo`` the rounded
    remainder (None: all 0.0), with nothing left beyond; and the metrics this leaves unsettled (their entries are
    meaningless). ``big``: each metric's largest magnitude.

    Two error-free extractions (Rump, Ogita and Oishi, "Accurate floating-point summation", 2008): with ``sigma``
    a power of two at least ``2**M`` times a metric's largest magnitude (``2**M`` >= twice its records),
    ``q = (sigma + x) - sigma`` is exact, a multiple of ``sigma * 2**-53``, and so is ``x - q``; the ``q`` of a
    metric sum exactly in any order (every partial sum is such a multiple below ``sigma``), as ``reduceat`` does.
    The second extraction takes the remainders the same way at ``sigma * 2**(M-53)``. Where nothing remains after
    it (records within ~40 binades of the largest), the exact sum is ``tau1 + tau2``: one IEEE addition rounds it
    correctly, and TwoSum's error is the remainder, exactly. Others (and magnitudes near the top of the range,
    kept away from overflow) are left to fsum.
    """
    unsettled: list[int] = []
    huge = big >= segments.top
    if huge.any():
        unsettled = np.flatnonzero(huge).tolist()
        big = np.where(huge, 0.0, big)
    sigma = np.repeat(np.ldexp(segments.sigma, np.frexp(big)[1]), segments.sizes)  # 2**M * 2**e > 2**M * big
    q = sigma + flat
    q -= sigma
    left = flat - q
    total = np.add.reduceat(q, segments.starts)
    if not left.any():  # the common case of short binary fractions: one extraction takes everything
        return total, None, unsettled
    sigma *= segments.scale
    np.add(sigma, left, out=q)
    q -= sigma
    left -= q
    tail = np.add.reduceat(q, segments.starts)
    if left.any():
        unsettled = sorted({*unsettled, *np.flatnonzero(np.logical_or.reduceat(left != 0.0, segments.starts)).tolist()})
    hi = total + tail
    b = hi - total
    lo = total - (hi - b)
    lo += tail - b
    return hi, lo, unsettled


def _settle(rows: list[list[float]], indices: list[int], total: Any, lo: Any) -> list[int]:
    """Put the exact sums of ``rows`` (the metrics at ``indices``) as fsum gives them into ``total`` and ``lo``;
    return the indices of those that leave the columns (beyond the double range, or more than two components)."""
    over = []
    three = []
    for i, row in zip(indices, rows, strict=True):
        try:
            hi = _fsum(row)
        except OverflowError:  # an intermediate sum beyond the double range
            over.append(i)
            continue
        rest = _fsum([*row, -hi])
        if rest and _fsum([*row, -hi, -rest]):
            three.append(i)
        total[i], lo[i] = hi, rest
    return over or three  # as before: those beyond the range leave first, the others are checked again


def _split(
    names: Sequence[str], segments: Segments, flat: Any, others: dict[str, Summary], single: list[int]
) -> Mapping[str, Summary]:
    """``single`` (indices, ascending) summarised by ``of_batch``, the rest in columns."""
    for i, chunk in zip(single, segments.rows(flat, single), strict=True):
        others[names[i]] = Summary.of_batch(chunk, None)
    keep = np.ones(len(names), dtype=bool)
    keep[single] = False
    kept = keep.tolist()
    counts = [*compress(segments.counts, kept)]
    if not counts:
        return others
    return summarize_joined([*compress(names, kept)], Segments(counts), flat[np.repeat(keep, segments.sizes)], others)
