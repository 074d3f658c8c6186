"""The rank level of sketches: the sketches of C columns merged across workers in the two collectives of
:mod:`metricbus.rank_level`.

Pass 1 (all_reduce MAX, float64) carries, per sketched column, the highest and the negated lowest key of each sign
(``NB`` values), so every participant learns the key range the column's counts span; pass 2 (all_reduce SUM, int64)
carries the zero, NaN, +inf and -inf counts, then the positive and the negative counts over that agreed range.
Counts add exactly, so the result is the same integers as :meth:`Sketch.merge` in any grouping (what the
single-process merge computes), and it costs O(keys spanned) per column, whatever the number of workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from metricbus.fixed import Array
from metricbus.sketch import Sketch, make, merge_all

NB = 4  # per column: positive keys' highest, -lowest; negative keys' highest, -lowest
_HEAD = 4  # summed per column before the counts: zero, nan, inf, ninf
_ABSENT = -(2.0**40)  # a bound no key reaches: the sign has no counts


def bounds(sketches: Sequence[Sketch | None]) -> Array:
    """Pass 1: the (S, NB) float64 key bounds of one participant's sketches (None: it lacks the column)."""
    out = np.full((len(sketches), NB), _ABSENT)
    for i, sketch in enumerate(sketches):
        if sketch is None:
            continue
        if len(sketch.pos):
            out[i, 0], out[i, 1] = sketch.pos_lo + len(sketch.pos) - 1, -sketch.pos_lo
        if len(sketch.neg):
            out[i, 2], out[i, 3] = sketch.neg_lo + len(sketch.neg) - 1, -sketch.neg_lo
    return out


def layout(agreed: Array) -> tuple[list[int], list[int], list[int], int]:
    """Per column: where its slots start, its positive range's length and its negative range's length; the total."""
    starts, n_pos, n_neg = [], [], []
    at = 0
    for hi_p, neg_lo_p, hi_n, neg_lo_n in agreed.tolist():
        starts.append(at)
        n_pos.append(int(hi_p + neg_lo_p) + 1 if hi_p > _ABSENT else 0)
        n_neg.append(int(hi_n + neg_lo_n) + 1 if hi_n > _ABSENT else 0)
        at += _HEAD + n_pos[-1] + n_neg[-1]
    return starts, n_pos, n_neg, at


def counts(sketches: Sequence[Sketch | None], agreed: Array) -> Array:
    """Pass 2: one participant's int64 count vector under the ``agreed`` bounds (all_reduce SUM it)."""
    starts, n_pos, _, total = layout(agreed)
    out = np.zeros(total, dtype=np.int64)
    for i, sketch in enumerate(sketches):
        if sketch is None:
            continue
        at = starts[i]
        out[at : at + _HEAD] = (sketch.zero, sketch.nan, sketch.inf, sketch.ninf)
        at += _HEAD
        if len(sketch.pos):
            start = at + sketch.pos_lo + int(agreed[i, 1])
            out[start : start + len(sketch.pos)] = sketch.pos
        at += n_pos[i]
        if len(sketch.neg):
            start = at + sketch.neg_lo + int(agreed[i, 3])
            out[start : start + len(sketch.neg)] = sketch.neg
    return out


def finish(agreed: Array, summed: Array) -> list[Sketch]:
    """Each column's merged sketch from the reduced bounds and counts."""
    starts, n_pos, n_neg, _ = layout(agreed)
    out = []
    for i, at in enumerate(starts):
        zero, nan, inf, ninf = (int(v) for v in summed[at : at + _HEAD])
        pos = summed[at + _HEAD : at + _HEAD + n_pos[i]]
        neg = summed[at + _HEAD + n_pos[i] : at + _HEAD + n_pos[i] + n_neg[i]]
        pos_lo, neg_lo = -int(agreed[i, 1]) if n_pos[i] else 0, -int(agreed[i, 3]) if n_neg[i] else 0
        out.append(make((zero, nan, inf, ninf), pos_lo, pos, neg_lo, neg))
    return out


def merge(columns: Sequence[Sequence[Sketch]]) -> list[Sketch]:
    """The single-process form: each column's workers' sketches merged (the same integers as the two passes)."""
    return [merge_all(list(held)) for held in columns]
