"""Per-metric micro-level accumulation on one worker: buffers folded into a Summary, safe across threads.

Two buffers keep log order (``first``/``last``) without a lock on the hot path:

* ``plain``: unit-weight records. ``log(name, float)`` appends here from any thread without a lock (a single
  ``list.append`` is atomic under the GIL, and :meth:`Accumulator.fold` takes a prefix with ``values[:n]`` then
  ``del values[:n]``, so a record appended meanwhile stays for the next fold).
* ``weighted``: records with weights (appended under the collector's lock). Before a weighted record is buffered
  the other buffers are folded, so every weighted record is older than every plain or array one and a fold takes
  the weighted buffer first.
* ``chunks``: unit-weight numpy arrays (float64 copies, appended under the lock), summarised with numpy at fold
  time (:func:`metricbus.summary_arrays.of_arrays`). Before a chunk is buffered the plain buffer is folded, so a
  fold takes weighted, then chunks, then plain records: log order.

Memory stays O(metrics): the buffers are folded into the metric's Summary every ``FOLD_AT`` records
(``FOLD_ELEMENTS`` array elements) and at commit (or at an update boundary).

:class:`PlainBuffers` takes the plain buffers of many accumulators at once, as ``fold`` takes one: by count.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from functools import reduce
from itertools import chain, compress
from operator import delitem, getitem, iadd
from struct import pack
from typing import Any

import numpy as np

from metricbus.native import speedups
from metricbus.sketch import Sketch
from metricbus.spec import NanPolicy, Spec, micro_sketch
from metricbus.summary import EMPTY, Summary, with_sketch
from metricbus.summary_arrays import of_arrays
from metricbus.values import drop_nonfinite

FOLD_AT = 256
FOLD_ELEMENTS = 1 << 16  # buffered array elements (512 KiB) that trigger a fold
_consume: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend  # runs an iterator in C, keeping nothing


class Accumulator:
    """The uncommitted records of one metric on one worker (mutated under the collector's lock, except ``plain``)."""

    __slots__ = ("chunked", "chunks", "name", "nan", "plain", "sketched", "spec", "state", "values", "weights")

    def __init__(self, *, name: str, spec: Spec, nan: NanPolicy) -> None:
        self.name = name
        self.spec = spec
        self.sketched = micro_sketch(spec)  # a distribution kind reads the micro level: keep a sketch too
        self.nan: NanPolicy = nan
        self.plain: list[float] = []  # the lock-free fast path appends here; never replaced
        self.values: list[float] = []  # weighted records, older than every plain record
        self.weights: list[float] = []
        self.chunks: list[np.ndarray[Any, Any]] = []  # unit-weight arrays, older than every plain record
        self.chunked = 0  # elements in ``chunks``
        self.state = EMPTY

    def add(self, values: list[float], weights: list[float] | None) -> None:
        """Buffer records (``weights`` None: weight 1 each). Caller holds the collector's lock."""
        if weights is None:
            self.plain.extend(values)
            if len(self.plain) >= FOLD_AT:
                self.fold()
            return
        if self.plain or self.chunks:
            self.fold()
        self.values.extend(values)
        self.weights.extend(weights)
        if len(self.values) >= FOLD_AT:
            self.fold()

    def add_array(self, values: np.ndarray[Any, Any]) -> None:
        """Buffer a 1-D float64 array of unit-weight records that nothing else holds (a copy of what was logged)."""
        if self.plain:
            self.fold()
        self.chunks.append(values)
        self.chunked += values.size
        if self.chunked >= FOLD_ELEMENTS:
            self.fold()

    def fold(self) -> None:
        """Fold the buffers into the state, weighted (oldest), arrays, then plain. Caller holds the collector's lock."""
        if self.values:
            self._merge(self.values, self.weights)
            self.values = []
            self.weights = []
        if self.chunks:
            chunks = self.chunks
            self.chunks, self.chunked = [], 0
            self._merge_arrays(chunks)
        plain = self.plain
        n = len(plain)
        if n:
            chunk = plain[:n]
            del plain[:n]  # records appended since the slice stay for the next fold
            self._merge(chunk, None)

    def _merge(self, values: list[float], weights: list[float] | None) -> None:
        if self.nan == "ignore":
            values, weights = drop_nonfinite(values, weights)
            if not values:
                return
        batch = Summary.of_batch(values, weights)
        if self.sketched:
            batch = with_sketch(batch, Sketch.of_values(np.array(values, dtype=np.float64)))
        self.state = batch if self.state.count == 0 else self.state.merge(batch)

    def _merge_arrays(self, chunks: list[np.ndarray[Any, Any]]) -> None:
        if self.nan == "ignore":
            chunks = [c if np.isfinite(c).all() else c[np.isfinite(c)] for c in chunks]
            if not any(c.size for c in chunks):
                return
        batch = of_arrays(chunks)
        if self.sketched:
            batch = with_sketch(batch, Sketch.of_values(chunks[0] if len(chunks) == 1 else np.concatenate(chunks)))
        self.state = batch if self.state.count == 0 else self.state.merge(batch)

    def take(self) -> Summary:
        """The state of everything since the last take (one update's micro level), and reset."""
        plain = self.plain
        simple = plain and not self.values and not self.chunks and not self.sketched
        if simple and not self.state.count and self.nan != "ignore":
            n = len(plain)  # the common commit: only unit-weight records, nothing folded yet
            chunk = plain[:n]
            del plain[:n]
            return Summary.of_batch(chunk, None)
        self.fold()
        state, self.state = self.state, EMPTY
        return state

    @property
    def pending(self) -> bool:
        """True if records were added since the last take."""
        return bool(self.plain) or bool(self.values) or bool(self.chunks) or self.state.count > 0


class PlainBuffers:
    """The plain buffers of several accumulators (``names``, in order), taken together in a few C loops.

    Each buffer gives up the records it held when its length was read, as :meth:`Accumulator.fold` does: ``del
    buffer[:n]``, so a record appended meanwhile by the lock-free path stays for the next take.
    """

    __slots__ = ("_counts", "_cuts", "buffers", "names")

    def __init__(self, names: tuple[str, ...], buffers: list[list[float]]) -> None:
        self.names = names
        self.buffers = buffers
        self._counts: list[int] = []  # the last counts taken and their slices (a commit's counts mostly repeat)
        self._cuts: list[slice] = []

    def take(self) -> tuple[tuple[str, ...], list[int], bytes]:
        """The names whose buffers hold records, their counts, and those records one after another (native
        doubles); the buffers are left with what was appended since their counts were read. Caller holds the
        collector's lock."""
        buffers = self.buffers
        names = self.names
        taken = None if speedups is None else speedups.take_plain(buffers)  # the same in one C loop
        if taken is not None:
            counts, records = taken
            if 0 in counts:
                names, counts = tuple(compress(names, counts)), [*compress(counts, counts)]
            return names, counts, records
        counts = [*map(len, buffers)]
        if 0 in counts:  # a metric without records in this update: left out
            names = tuple(compress(names, counts))
            buffers = [*compress(buffers, counts)]
            counts = [*compress(counts, counts)]
        total = sum(counts)
        floats: list[float] = reduce(iadd, buffers, [])  # every record, one list, built in C
        if counts == self._counts:
            cuts = self._cuts
        else:
            cuts = self._cuts = [*map(slice, counts)]
            self._counts = counts
        if len(floats) != total:  # a record was appended after its buffer's length was read: take by count
            floats = [*chain.from_iterable(map(getitem, buffers, cuts))]
        _consume(map(delitem, buffers, cuts))
        return names, counts, pack(f"{total}d", *floats)
