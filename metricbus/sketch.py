"""``Sketch``: the mergeable state of the quantile and ``hist`` kinds, a DDSketch with integer bucket counts.

A record ``x`` falls in one bucket: ``zero`` where ``|x| < TINY`` (2**-64, ~5.4e-20, exact zeros included), the
positive or negative bucket ``key(|x|)`` otherwise, or the NaN / +inf / -inf counters. Merging two sketches adds
their counts, so a sketch is exactly the same (same integers) under every split of its records into micro-batches,
updates, ranks and commits, and merge is associative and commutative with the empty sketch as identity.

**The mapping** is DDSketch's cubically interpolated logarithm (``ddsketch.CubicallyInterpolatedMapping`` with
relative accuracy ``ALPHA`` = 1%, offset 0; tests/test_sketch.py checks every key against the library's). It is
computed here, vectorized with numpy from the float's bits, because the library adds one value per Python call
(~1 ms for 1024 values) and because the key must be the same bits on every path and machine: the cubic uses only
``+``, ``*`` and an exact exponent split, no ``log`` from a maths library, and ``MULTIPLIER`` is a literal.

**Guarantee.** ``quantile(q)`` reports, for the order statistic ``x_k``, ``k = floor(q·(n−1))`` (0-based, the
``method="lower"`` rank of :func:`numpy.quantile`) of the ``n`` records, a value within ``ALPHA·|x_k|`` of it, for
``TINY <= |x_k| < HUGE`` (``HUGE`` = 2**64); a zero-bucket record is reported as 0 (error below ``TINY``), and one of
magnitude ``HUGE`` or more counts in the outermost bucket (the bound on memory) and is reported as that bucket's value,
±``value_of(MAX_KEY)`` (~0.9915·2**64, within ALPHA of the bucket's records below HUGE).
±inf records are reported as ±inf; any NaN record makes every quantile NaN (as ``min``/``max``).

**Memory.** Counts are kept densely between a sketch's lowest and highest key, per sign: at most
``2 · (MAX_KEY − MIN_KEY + 1)`` = 8,960 counts (70 KB) whatever the number of records; data spanning three decades
uses ~350 counts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Array = Any  # numpy arrays (numpy's stubs are too loose to add checking here)

ALPHA = 0.01
GAMMA = 1.02020202020202  # (1 + ALPHA) / (1 - ALPHA)
MULTIPLIER = 34.99883330222059  # 1 / log1p(GAMMA - 1) / C: ddsketch's, as a literal (tests check it)
_A, _B, _C = 6.0 / 35.0, -3.0 / 5.0, 10.0 / 7.0
TINY = 2.0**-64
HUGE = 2.0**64
_ONE = 0x3FF0000000000000  # the exponent bits of [1, 2)
_MANTISSA = 0x000FFFFFFFFFFFFF
MAX_KEYS = 4480  # MAX_KEY - MIN_KEY + 1: the keys of one sign (value_of remembers each one it computed)
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def keys(magnitudes: Array, *, below_huge: bool = False) -> Array:
    """The bucket keys of positive finite float64 ``magnitudes`` of TINY or more (ddsketch's cubic mapping, offset
    0, its operations in its order; those of ``HUGE`` or more get ``MAX_KEY``), minus ``MIN_KEY`` (so >= 0).
    ``below_huge``: the caller knows every magnitude is below HUGE.

    Most keys come from a table of *cells* (an exponent and the top ``_CELL_BITS`` bits of the significand): a cell
    whose every value has one key holds it; the rest (~3% of the cells, those a bucket boundary crosses) are
    computed by :func:`exact_keys`, so the result is exact_keys' bit for bit (tests/test_sketch.py)."""
    if not below_huge and len(magnitudes) and magnitudes.max() >= HUGE:
        magnitudes = np.minimum(magnitudes, HUGE)
    bits = np.ascontiguousarray(magnitudes).view(np.int64)
    cell = bits >> (52 - _CELL_BITS)
    cell -= _FIRST_CELL
    found = _cells()[cell]
    crossed = np.flatnonzero(found < 0)
    if len(crossed):
        found[crossed] = exact_keys(magnitudes[crossed])
    return found


def exact_keys(magnitudes: Array) -> Array:
    """:func:`keys` computed for every value (the cubic's operations, vectorized)."""
    return _keys_of_scaled(_scaled(magnitudes))


def _scaled(magnitudes: Array) -> Array:
    """``log_gamma`` of each magnitude: the cubic's log2 times MULTIPLIER, before the ceiling (a new array)."""
    bits = np.ascontiguousarray(magnitudes).view(np.int64)
    # frexp(x) = (m, e) with 2m - 1 = the significand's fraction f, and e - 1 = the unbiased exponent E - 1023.
    # Integers move between int64 and float64 through their bits (exact below 2**51; twice as fast as astype).
    fraction = bits & _MANTISSA
    fraction |= _ONE
    log2 = fraction.view(np.float64)  # 1.f, in [1, 2)
    s = log2 - 1.0  # f exactly
    np.multiply(s, _A, out=log2)
    log2 += _B
    log2 *= s
    log2 += _C
    log2 *= s
    exponent = bits >> 52  # E (the sign bit is 0)
    exponent |= _TWO_52_BITS
    unbiased = exponent.view(np.float64)
    unbiased -= _TWO_52 + 1023.0  # E - 1023, exactly
    log2 += unbiased
    log2 *= MULTIPLIER
    return log2


def _keys_of_scaled(log2: Array) -> Array:
    np.ceil(log2, out=log2)
    log2 += _ROUNDER  # the key, now in the low bits
    found = log2.view(np.int64)
    found -= _ROUNDER_BITS + _MIN_KEY
    return found


_CELL_BITS = 10  # a cell: an exponent and this many top bits of the significand
_FIRST_CELL = (1023 - 64) << _CELL_BITS  # the cell of TINY (2**-64)
_MARGIN = 1e-9  # a cell's scaled logarithms must stay this far inside one key's interval (rounding is ~1e-12)
@functools.cache  # built on first use (two threads may both build it: the same table, harmless)
def _cells() -> Array:
    """Per cell from TINY's to HUGE's: its one key (minus MIN_KEY), or -1 where a key boundary crosses it."""
    first = np.arange(_FIRST_CELL, ((1023 + 64) << _CELL_BITS) + 1, dtype=np.int64)
    lowest = (first << (52 - _CELL_BITS)).view(np.float64)
    highest = (((first + 1) << (52 - _CELL_BITS)) - 1).view(np.float64)
    low, high = _scaled(lowest), _scaled(highest)
    key = np.ceil(high)
    inside = (np.ceil(low) == key) & (low - (key - 1.0) > _MARGIN) & (key - high > _MARGIN)
    table = np.where(inside, key - _MIN_KEY, -1.0).astype(np.int16)  # keys - MIN_KEY < 2**15: a 264 KB table
    table.flags.writeable = False
    return table


_TWO_52 = 2.0**52
_TWO_52_BITS = 0x4330000000000000  # the bits of 2**52
_ROUNDER = 1.5 * 2.0**52
_ROUNDER_BITS = 0x4338000000000000  # the bits of 1.5 * 2**52
_MIN_KEY = -2239  # MIN_KEY (checked below)


def key_of(magnitude: float) -> int:
    """The bucket key of one value (:func:`keys` without the shift)."""
    return int(exact_keys(np.array([min(magnitude, HUGE)], dtype=np.float64))[0] + _MIN_KEY)


MIN_KEY = key_of(TINY)
MAX_KEY = key_of(HUGE)
assert MIN_KEY == _MIN_KEY


@functools.lru_cache(maxsize=MAX_KEYS)
def value_of(key: int) -> float:
    """The value a bucket reports: ddsketch's ``value(key)``, within ALPHA of every magnitude with that key."""
    target = key / MULTIPLIER
    exponent = math.floor(target)
    delta_0 = _B * _B - 3 * _A * _C
    delta_1 = 2.0 * _B * _B * _B - 9.0 * _A * _B * _C - 27.0 * _A * _A * (target - exponent)
    inner = (delta_1 - (delta_1 * delta_1 - 4 * delta_0 * delta_0 * delta_0) ** 0.5) / 2.0
    cardano = -(abs(inner) ** (1.0 / 3.0)) if inner < 0 else inner ** (1.0 / 3.0)
    significand_plus_one = -(_B + cardano + delta_0 / cardano) / (3.0 * _A) + 1.0
    return math.ldexp(significand_plus_one / 2, exponent + 1) * (2.0 / (1.0 + GAMMA))


def lower_of(key: int) -> float:
    """The lowest magnitude a bucket holds (exclusive): the upper bound of the key below."""
    return value_of(key - 1) * (1.0 + GAMMA) / 2.0 if key > MIN_KEY else TINY


def upper_of(key: int) -> float:
    """The highest magnitude a bucket holds (inclusive), ``HUGE`` for the outermost one."""
    return value_of(key) * (1.0 + GAMMA) / 2.0 if key < MAX_KEY else HUGE


@dataclass(frozen=True, slots=True, eq=False)
class Sketch:
    """Bucket counts of a set of records. ``pos[i]`` counts the positive records with key ``pos_lo + i`` (``neg``
    likewise for negative ones, by magnitude); the arrays are trimmed (no zero count at either end) and read-only.
    The empty sketch is the identity of :meth:`merge`."""

    zero: int = 0
    nan: int = 0
    inf: int = 0
    ninf: int = 0
    pos_lo: int = 0
    pos: Array = field(default_factory=lambda: _EMPTY)
    neg_lo: int = 0
    neg: Array = field(default_factory=lambda: _EMPTY)
    _cumulative: Array = field(default=None, init=False, repr=False)  # ordered()'s running sum, made on first use

    @staticmethod
    def of_values(values: Array) -> Sketch:
        """The sketch of float64 ``values`` (any shape; each element is one record)."""
        x = np.asarray(values, dtype=np.float64).reshape(-1)
        if not x.size:
            return EMPTY_SKETCH
        if x.min() >= TINY and x.max() < HUGE:  # the common case: positive data in range (NaN fails the test)
            pos_lo, pos = _counts(keys(x, below_huge=True))
            return Sketch(0, 0, 0, 0, pos_lo, pos, 0, _EMPTY)
        magnitude = np.abs(x)
        counted = (magnitude >= TINY) & (magnitude < math.inf)  # False for NaN and ±inf
        nan = int(np.isnan(x).sum())
        inf = int((x == math.inf).sum())
        ninf = int((x == -math.inf).sum())
        zero = int(x.size - nan - inf - ninf - int(counted.sum()))
        negative = counted & (x < 0.0)
        pos_lo, pos = _counts(keys(magnitude[counted & ~negative]))
        neg_lo, neg = _counts(keys(magnitude[negative]))
        return Sketch(zero, nan, inf, ninf, pos_lo, pos, neg_lo, neg)

    @staticmethod
    def of_value(value: float) -> Sketch:
        """The sketch of one record."""
        return Sketch.of_values(np.array([value], dtype=np.float64))

    @property
    def count(self) -> int:
        """The number of records."""
        cumulative = self._cumulative
        if cumulative is not None:
            return int(cumulative[-1]) + self.nan
        return self.zero + self.nan + self.inf + self.ninf + int(self.pos.sum()) + int(self.neg.sum())

    def merge(self, other: Sketch) -> Sketch:
        """The sketch of both sets of records: counts added."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        pos_lo, pos = _add(self.pos_lo, self.pos, other.pos_lo, other.pos)
        neg_lo, neg = _add(self.neg_lo, self.neg, other.neg_lo, other.neg)
        return Sketch(
            self.zero + other.zero, self.nan + other.nan, self.inf + other.inf, self.ninf + other.ninf,
            pos_lo, pos, neg_lo, neg,
        )  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sketch):
            return NotImplemented
        return (
            self.head() == other.head() and np.array_equal(self.pos, other.pos) and np.array_equal(self.neg, other.neg)
        )

    def __hash__(self) -> int:
        return hash((self.head(), self.pos.tobytes(), self.neg.tobytes()))

    def __repr__(self) -> str:
        return f"Sketch(count={self.count}, zero={self.zero}, pos={len(self.pos)} buckets, neg={len(self.neg)} buckets)"

    def head(self) -> tuple[int, int, int, int, int, int, int, int]:
        """The scalar fields: zero, nan, inf, ninf, pos_lo, len(pos), neg_lo, len(neg)."""
        return (self.zero, self.nan, self.inf, self.ninf, self.pos_lo, len(self.pos), self.neg_lo, len(self.neg))

    def ordered(self) -> Array:
        """The counts in value order, one per *position*: -inf, the negative keys from the highest down, zero, the
        positive keys up, +inf (NaN is not ordered; see :meth:`span` for what a position holds)."""
        return np.concatenate(([self.ninf], self.neg[::-1], [self.zero], self.pos, [self.inf]))

    def span(self, position: int) -> tuple[float, float, float]:
        """``(lower, upper, reported value)`` of a position of :meth:`ordered`."""
        n_neg = len(self.neg)
        if position == 0:
            return -math.inf, -math.inf, -math.inf
        if position <= n_neg:
            key = self.neg_lo + n_neg - position
            return -upper_of(key), -lower_of(key), -value_of(key)
        if position == n_neg + 1:
            return -TINY, TINY, 0.0
        if position <= n_neg + 1 + len(self.pos):
            key = self.pos_lo + position - n_neg - 2
            return lower_of(key), upper_of(key), value_of(key)
        return math.inf, math.inf, math.inf

    def quantile(self, q: float) -> float:
        """The value at rank ``floor(q·(n−1))`` within ALPHA (see the module docstring); NaN if empty or any NaN."""
        n = self.count
        if n == 0 or self.nan:
            return math.nan
        rank = math.floor(q * (n - 1))
        cumulative = self._cumulative
        if cumulative is None:
            cumulative = np.cumsum(self.ordered())
            object.__setattr__(self, "_cumulative", cumulative)  # a cache of frozen data: the sketch stays frozen
        return self.span(int(np.searchsorted(cumulative, rank, side="right")))[2]

    def histogram(self, *, bins: int = 64) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """``(edges, counts)``: the positions from the lowest to the highest finite one that holds records, in at
        most ``bins`` contiguous bins of equal numbers of positions (``len(edges) == len(counts) + 1``; equal
        widths in log scale on each side of zero); ±inf records count in the outermost bins (where no finite record
        is, in the outermost bucket of their sign, ``[lower_of(MAX_KEY), upper_of(MAX_KEY)]``)."""
        counts = self.ordered()
        finite = np.flatnonzero(counts[1:-1]) + 1
        if not len(finite):  # ±inf records alone: each in a bin of the outermost finite bucket of its sign
            return _infinite_bins(int(counts[0]), int(counts[-1]))
        first, last = int(finite[0]), int(finite[-1])
        size = -(-(last - first + 1) // bins)
        starts = list(range(first, last + 1, size))
        out = np.add.reduceat(counts[first : last + 1], [start - first for start in starts])
        out[0] += counts[0]
        out[-1] += counts[-1]
        edges = [self.span(first)[0], *(self.span(min(start + size, last + 1) - 1)[1] for start in starts)]
        return tuple(edges), tuple(int(c) for c in out)

    def to_ints(self) -> tuple[int, ...]:
        """The flat integer form: :meth:`head` then the positive and negative counts (inverse: :meth:`from_ints`)."""
        return (*self.head(), *self.pos.tolist(), *self.neg.tolist())

    @staticmethod
    def from_ints(ints: Any) -> Sketch:
        """Inverse of :meth:`to_ints`; raise ValueError if the lengths do not agree."""
        values = [int(v) for v in ints]
        if len(values) < 8 or len(values) != 8 + values[5] + values[7] or min(values[5], values[7]) < 0:
            raise ValueError(f"a sketch is 8 integers and its counts, got {len(values)} integers")
        zero, nan, inf, ninf, pos_lo, n_pos, neg_lo, _ = values[:8]
        pos = _frozen(np.array(values[8 : 8 + n_pos], dtype=np.int64))
        neg = _frozen(np.array(values[8 + n_pos :], dtype=np.int64))
        return Sketch(zero, nan, inf, ninf, pos_lo, pos, neg_lo, neg)


EMPTY_SKETCH = Sketch()


def _infinite_bins(ninf: int, inf: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """The bins of a sketch that holds ``ninf`` -inf and ``inf`` +inf records and no finite one: -inf in a bin of
    the outermost negative bucket, +inf in one of the outermost positive bucket (one bin of 0 records between)."""
    low, high = lower_of(MAX_KEY), upper_of(MAX_KEY)
    if ninf and inf:
        return (-high, -low, low, high), (ninf, 0, inf)
    if ninf:
        return (-high, -low), (ninf,)
    if inf:
        return (low, high), (inf,)
    return (), ()


def unknown(count: int) -> Sketch:
    """The sketch of ``count`` records whose values it never saw (a state that reached a distribution kind without
    its sketch: see the README's "Distributions"): they count as NaN, so the quantiles are NaN, never a quantile of
    part of the records."""
    return Sketch(nan=count)


def make(head: tuple[int, int, int, int], pos_lo: int, pos: Array, neg_lo: int, neg: Array) -> Sketch:
    """A sketch of counts in any form (``head``: zero, nan, inf, ninf; the arrays are copied, trimmed and frozen)."""
    pos_lo, pos = _trim(pos_lo, np.array(pos, dtype=np.int64))
    neg_lo, neg = _trim(neg_lo, np.array(neg, dtype=np.int64))
    return Sketch(*head, pos_lo, pos, neg_lo, neg)


def merge_all(sketches: list[Sketch]) -> Sketch:
    """The merge of many sketches at once (one allocation per sign)."""
    held = [s for s in sketches if s.count]
    if len(held) <= 1:
        return held[0] if held else EMPTY_SKETCH
    pos_lo, pos = _add_many([(s.pos_lo, s.pos) for s in held])
    neg_lo, neg = _add_many([(s.neg_lo, s.neg) for s in held])
    return Sketch(
        sum(s.zero for s in held), sum(s.nan for s in held), sum(s.inf for s in held), sum(s.ninf for s in held),
        pos_lo, pos, neg_lo, neg,
    )  # fmt: skip


def _frozen(array: Array) -> Array:
    array.flags.writeable = False
    return array


def _trim(lo: int, counts: Array) -> tuple[int, Array]:
    nonzero = np.flatnonzero(counts)
    if not len(nonzero):
        return 0, _EMPTY
    start, stop = int(nonzero[0]), int(nonzero[-1]) + 1
    return lo + start, _frozen(counts[start:stop])


def _counts(found: Array) -> tuple[int, Array]:
    """Counts of shifted keys (:func:`keys`)."""
    if not len(found):
        return 0, _EMPTY
    return _trim(MIN_KEY, np.bincount(found).astype(np.int64, copy=False))


def _add(a_lo: int, a: Array, b_lo: int, b: Array) -> tuple[int, Array]:
    if not len(b):
        return a_lo, a
    if not len(a):
        return b_lo, b
    return _add_many([(a_lo, a), (b_lo, b)])


def _add_many(parts: list[tuple[int, Array]]) -> tuple[int, Array]:
    parts = [(lo, counts) for lo, counts in parts if len(counts)]
    if not parts:
        return 0, _EMPTY
    lo = min(p[0] for p in parts)
    hi = max(p[0] + len(p[1]) for p in parts)
    out = np.zeros(hi - lo, dtype=np.int64)
    for start, counts in parts:
        out[start - lo : start - lo + len(counts)] += counts
    return _trim(lo, out)


assert MAX_KEYS == MAX_KEY - MIN_KEY + 1
