"""The rank level of many commits at once, as arrays, for the workers' states the vectorized merge settles.

``fields`` is ``(T, R, M, N_FIELDS)``: T commits, R ranks (ascending), M metrics, each a worker's micro Summary
fields (an absent worker's row holds ``Summary().as_tuple()``). :func:`merge_columns` returns each (commit, metric)'s
merged fields as :class:`metricbus.column_kinds.Merged` arrays and the mask ``ok`` of the elements computed exactly
as :func:`metricbus.rank_level.merge` would: every worker the layout says has the metric has it (count > 0), unit
weights, finite fields, an exact sum that is a double-double (:func:`metricbus.extract.double_double`). Those are
the common case (one record or a few unit-weight records per worker); every other element is left to the scalar
merge, so the results are bit for bit the rank level's.

A merged state read this way has ``weight`` = its count and ``wsum`` = its ``total`` (unit weights); ``first`` and
``last`` are the lowest rank's (as the rank level takes them); ``m2`` only where one worker has the metric (its
own; several workers' merged m2 is left to the scalar merge, so ``std`` there is unsettled).
"""

from __future__ import annotations

import numpy as np

from metricbus import extract, signed_zero
from metricbus.column_kinds import Merged
from metricbus.fixed import Array

_EXACT_COUNT = 2.0**53


def merge_columns(fields: Array, present: Array, lowest: Array) -> tuple[Merged, Array]:
    """``(merged, ok)`` of ``fields`` (T, R, M, N_FIELDS); ``present``: (R, M) which workers have each metric in the
    layout; ``lowest``: (M,) the first of them."""
    t, _, m, _ = fields.shape
    full = bool(present.all())
    count = fields[..., 0]
    total, total_lo = fields[..., 5], fields[..., 6]
    good = (count > 0) & (fields[..., 1] == count) & (fields[..., 2] == 0.0)
    good &= (fields[..., 3] == total) & (fields[..., 4] == total_lo)
    for f in (5, 6, 8, 9, 10, 11):
        good &= np.isfinite(fields[..., f])
    if not full:
        good |= ~present[None]
    ok = good.all(axis=1)  # (T, M)
    counts = count.sum(axis=1)
    ok &= counts < _EXACT_COUNT
    hi, lo, exact = _exact_sum(total, total_lo, ok)
    ok &= exact
    if (hi == 0.0).any():  # a zero sum is -0.0 when every worker's is (rank_level._slot_sum)
        negative = (total == 0.0) & np.signbit(total)
        if not full:
            negative |= ~present[None]
        hi = np.where((hi == 0.0) & negative.all(axis=1), -0.0, hi)
    columns = np.arange(m)
    single = present.sum(axis=0) == 1
    m2 = np.where(single[None], fields[:, lowest, columns, 7], np.nan)
    lowest_value = _extreme(fields[..., 8], present, full, minimum=True)
    highest = _extreme(fields[..., 9], present, full, minimum=False)
    merged = Merged(
        count=counts, weight=counts, weight_lo=np.zeros((t, m)), wsum=hi, wsum_lo=lo, total=hi, m2=m2,
        min=lowest_value, max=highest, first=fields[:, lowest, columns, 10], last=fields[:, lowest, columns, 11],
    )
    return merged, ok


def single_columns(fields: Array) -> tuple[Merged, Array]:
    """``(merged, ok)`` of one worker's states (T, M, N_FIELDS): the rank level of one worker is its state, so
    ``ok`` only asks for records and finite fields (weights may be anything)."""
    ok = fields[..., 0] > 0
    for f in (1, 2, 3, 4, 5, 6, 8, 9, 10, 11):
        ok &= np.isfinite(fields[..., f])
    merged = Merged(
        count=fields[..., 0], weight=fields[..., 1], weight_lo=fields[..., 2], wsum=fields[..., 3],
        wsum_lo=fields[..., 4], total=fields[..., 5], m2=fields[..., 7], min=fields[..., 8], max=fields[..., 9],
        first=fields[..., 10], last=fields[..., 11],
    )
    return merged, ok


def _exact_sum(total: Array, total_lo: Array, ok: Array) -> tuple[Array, Array, Array]:
    """Per (commit, metric), ``(hi, lo, exact)`` of Σ(total + total_lo) over the workers (absent ones hold 0)."""
    t, r, m = total.shape
    sources = [total] if not total_lo.any() else [total, total_lo]
    terms = np.empty((len(sources) * r, t, m))
    for i, source in enumerate(sources):
        terms[i * r : (i + 1) * r] = source.transpose(1, 0, 2)
    terms[:, ~ok] = 0.0  # an element left to the scalar merge may hold anything
    try:
        parts = extract.column_parts(terms.reshape(len(sources) * r, t * m))
    except OverflowError:  # values near the top of the range: the scalar merge sums them
        return np.zeros((t, m)), np.zeros((t, m)), np.zeros((t, m), dtype=bool)
    hi, lo, exact = extract.double_double(parts, t * m)
    return hi.reshape(t, m), lo.reshape(t, m), exact.reshape(t, m)


def _extreme(values: Array, present: Array, full: bool, *, minimum: bool) -> Array:
    """The min (or max) over the workers having the metric, ``-0.0`` below ``+0.0`` (:mod:`~metricbus.signed_zero`)."""
    fill = np.inf if minimum else -np.inf
    held = values if full else np.where(present[None], values, fill)
    out = held.min(axis=1) if minimum else held.max(axis=1)
    return signed_zero.columns(out, held, axis=1, minimum=minimum)
