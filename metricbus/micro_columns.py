"""One optimizer update's micro summaries as columns: every metric's fields in one float64 array, vectorized.

At a commit most metrics hold a few plain unit-weight records each (``log(name, float)``, ``log(dict)``).
Summarising them one :meth:`Summary.of_batch` at a time costs ~1 µs of Python per metric, which is most of a
commit of 100 metrics; here all of them are summarised together: their records are joined into one array and each
field is one numpy call over every metric (``reduceat`` over the metrics' segments), the exact sums one ``fsum``
each. :class:`MicroUpdate` holds the result as a ``(N_FIELDS, K)`` array, the layout of
:class:`metricbus.partial.Packed`, so the journal and a single worker's commit read the columns without a
``Summary`` per metric; anything else reads it as a mapping of Summaries, built on first use.

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
from collections.abc import Iterator, Mapping
from operator import is_
from typing import Any

import numpy as np

from metricbus.partial import Packed, layout_of, pack
from metricbus.sketch import Sketch
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, Rest, Summary

_fsum = math.fsum
COLUMNS_FROM = 8  # plain metrics in an update from which they are summarised in columns
_new = tuple.__new__


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
        yield from self.names
        yield from self.others

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
        return Packed(names, last.specs, fields, (), last.layout, True, ())
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


def summarize(names: list[str], chunks: list[list[float]], others: dict[str, Summary]) -> Mapping[str, Summary]:
    """The micro summaries of ``names``' plain unit-weight records (``chunks``, each non-empty, in log order) and
    ``others`` (already summarised): a :class:`MicroUpdate`, or a dict when no metric has records in columns."""
    if len(names) < COLUMNS_FROM:  # a few metrics: numpy's per-call cost would exceed of_batch's
        for name, chunk in zip(names, chunks, strict=True):
            others[name] = Summary.of_batch(chunk, None)
        return others
    counts = [*map(len, chunks)]
    joined: list[float] = []
    for chunk in chunks:
        joined += chunk
    flat = np.fromiter(joined, dtype=np.float64, count=len(joined))
    if not np.isfinite(flat).all():
        return _some_nonfinite(names, chunks, others)
    try:
        totals = [*map(_fsum, chunks)]
    except OverflowError:  # an intermediate sum beyond the double range: one metric at a time
        return _one_at_a_time(names, chunks, others)
    los = [_fsum([*c, -t]) for c, t in zip(chunks, totals, strict=True)]
    if any(los):  # a remainder: make sure nothing is left beyond (total, lo), else that metric takes of_batch
        left = [i for i, lo in enumerate(los) if lo and _fsum([*chunks[i], -totals[i], -lo])]
        if left:
            return _split(names, chunks, others, left)
    k = len(names)
    sizes = np.array(counts, dtype=np.intp)
    starts = np.zeros(k, dtype=np.intp)
    np.cumsum(sizes[:-1], out=starts[1:])
    n = sizes.astype(np.float64)
    total = np.array(totals, dtype=np.float64)
    if 1 in counts:  # one record: its value is the sum (of_value keeps -0.0, which fsum makes 0.0)
        total = np.where(sizes == 1, flat[starts], total)
    with np.errstate(over="ignore", invalid="ignore"):  # deviations beyond the double range: inf, as of_batch's
        deviations = flat - np.repeat(total / n, sizes)
    fields = np.empty((N_FIELDS, k))
    fields[0] = n
    fields[1] = n
    fields[2] = 0.0
    fields[3] = total
    fields[4] = los
    fields[5] = total
    fields[6] = los
    with np.errstate(over="ignore", invalid="ignore"):  # a square beyond the double range: inf, as of_batch's
        fields[7] = np.add.reduceat(deviations * deviations, starts)
    fields[8] = np.minimum.reduceat(flat, starts)
    fields[9] = np.maximum.reduceat(flat, starts)
    fields[10] = flat[starts]
    fields[11] = flat[starts + (sizes - 1)]
    zeros = flat == 0.0
    if zeros.any() and np.signbit(flat[zeros]).any():  # -0.0 and 0.0 tie: the first in log order, as of_batch
        _first_of_ties(fields, chunks)
    fields.flags.writeable = False
    return MicroUpdate(names=tuple(names), fields=fields, others=others)


def _first_of_ties(fields: Any, chunks: list[list[float]]) -> None:
    """Where a metric's min or max is a zero, take the zero ``of_batch`` takes: ``sorted()``'s first and last (the
    first and the last of equal zeros in log order) up to 32 records, else ``min()``'s and ``max()``'s (the first)."""
    for i in np.flatnonzero((fields[8] == 0.0) | (fields[9] == 0.0)).tolist():
        chunk = chunks[i]
        if len(chunk) <= 32:
            ordered = sorted(chunk)
            fields[8, i], fields[9, i] = ordered[0], ordered[-1]
        else:
            fields[8, i], fields[9, i] = min(chunk), max(chunk)


def _split(
    names: list[str], chunks: list[list[float]], others: dict[str, Summary], single: list[int]
) -> Mapping[str, Summary]:
    """``single`` (indices) summarised by ``of_batch``, the rest in columns."""
    apart = set(single)
    for i in single:
        others[names[i]] = Summary.of_batch(chunks[i], None)
    keep = [i for i in range(len(names)) if i not in apart]
    return summarize([names[i] for i in keep], [chunks[i] for i in keep], others)


def _some_nonfinite(names: list[str], chunks: list[list[float]], others: dict[str, Summary]) -> Mapping[str, Summary]:
    finite = math.isfinite
    return _split(names, chunks, others, [i for i, c in enumerate(chunks) if not all(map(finite, c))])


def _one_at_a_time(names: list[str], chunks: list[list[float]], others: dict[str, Summary]) -> Mapping[str, Summary]:
    single = []
    for i, chunk in enumerate(chunks):
        try:
            _fsum(chunk)
        except OverflowError:
            single.append(i)
    return _split(names, chunks, others, single)
