"""Summaries of records held in numpy arrays (``log(name, array)``), vectorized and exact.

The exact sum comes from error-free extraction (:func:`metricbus.exact.array_components`); min, max, first and
last from numpy, in log order; m2 from the deviations from the mean, by short BLAS dots. Short, non-finite or
huge blocks take :meth:`Summary.of_batch`'s list path.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from metricbus import exact, signed_zero
from metricbus.native import speedups
from metricbus.summary import EMPTY, NEAR, Summary, near_mean_m2, split_parts

_MAX = exact.MAX
_QUIET = 2.0**480
_SHORT_ARRAY = 16  # at most this many records: the list path is cheaper than a dozen numpy calls
# Records summarised by one round of numpy calls: each call costs ~0.4 µs besides its ~0.2 ns a record, so a fold
# of twenty 1024-record arrays is one block. Its three scratch arrays (768 KiB) stay in a core's L2 cache.
_BLOCK = 32768
_ROW = 1024  # records in each of m2's dots
_SCRATCH = threading.local()  # each thread's scratch arrays, made on first use
_new = tuple.__new__


def of_arrays(chunks: Sequence[np.ndarray[Any, Any]]) -> Summary:
    """Summarise unit-weight records held in 1-D float64 arrays (in order, not all empty), vectorized: the same
    fields as :meth:`Summary.of_batch` of their concatenated ``tolist()``, bit for bit, except ``m2`` (two-pass,
    by BLAS: within an ulp or two). Blocks of up to ``_BLOCK`` records are summarised by one round of numpy
    calls in per-thread scratch arrays (no allocation, and they stay in cache) and merged; non-finite or huge
    data, and short blocks, take the list path."""
    state = EMPTY
    pending: list[np.ndarray[Any, Any]] = []
    size = 0
    for chunk in chunks:
        if size and size + chunk.size > _BLOCK:
            state = state.merge(_of_block(_joined(pending, size)))
            pending, size = [], 0
        if chunk.size >= _BLOCK:
            for start in range(0, chunk.size, _BLOCK):
                state = state.merge(_of_block(chunk[start : start + _BLOCK]))
        elif chunk.size:
            pending.append(chunk)
            size += chunk.size
    if size:
        state = state.merge(_of_block(_joined(pending, size)))
    return state


def _scratch() -> tuple[np.ndarray[Any, Any], ...]:
    """This thread's arrays for :func:`_of_block` (``_BLOCK`` each): a joined block and two work arrays."""
    held: tuple[np.ndarray[Any, Any], ...] | None = getattr(_SCRATCH, "arrays", None)
    if held is None:
        held = _SCRATCH.arrays = (np.empty(_BLOCK), np.empty(_BLOCK), np.empty(_BLOCK))
    return held


def _joined(chunks: list[np.ndarray[Any, Any]], size: int) -> np.ndarray[Any, Any]:
    """``chunks`` (``size`` <= _BLOCK elements in all) as one array: the chunk itself, or this thread's block."""
    if len(chunks) == 1:
        return chunks[0]
    return np.concatenate(chunks, out=_scratch()[0][:size])


def _of_block(values: np.ndarray[Any, Any]) -> Summary:
    """:func:`of_arrays` of one array of at most ``_BLOCK`` records."""
    n = values.size
    if n <= _SHORT_ARRAY:
        return Summary.of_batch(values.tolist(), None)
    scratch = _scratch()
    if speedups is not None and values.flags.c_contiguous and values.dtype == np.float64:
        found = speedups.array_parts(values)  # the same min, max and exact sums: one C pass, then one per round
        if found is None:  # non-finite, all zeros, or beyond the array path's range
            return Summary.of_batch(values.tolist(), None)
        lowest, highest, sums = found
        largest = highest if highest >= -lowest else -lowest
        parts: tuple[float, ...] | None = exact.components(sums)
    else:
        lowest, highest = values.item(values.argmin()), values.item(values.argmax())  # a NaN if any
        if not (lowest > -_MAX and highest < _MAX):  # non-finite or beyond the array path's range
            return Summary.of_batch(values.tolist(), None)
        lowest, highest = signed_zero.of_array(values, lowest, highest)  # which zero: -0.0 below +0.0
        largest = highest if highest >= -lowest else -lowest
        smallest = lowest if lowest > 0.0 else -highest if highest < 0.0 else None  # one-signed data: free
        parts = exact.array_components(values, largest, scratch[1:], smallest)
    if parts is None:  # all zeros, or beyond the array path's range
        return Summary.of_batch(values.tolist(), None)
    total, total_lo, rest_t = split_parts(parts)
    mean = total / n
    deviations = np.subtract(values, mean, out=scratch[1][:n])
    if largest < _QUIET:  # no square (nor their sum) can overflow
        m2 = _sum_of_squares(deviations)
    else:  # overflows to inf, as d * d does, without numpy's warning
        with np.errstate(over="ignore", invalid="ignore"):
            m2 = _sum_of_squares(deviations)
    if m2 <= n * mean * mean * NEAR and m2 and not rest_t:  # a spread tiny next to the mean (summary.NEAR)
        m2 = near_mean_m2(values.tolist(), None, (total, total_lo), (float(n), 0.0))
    rest = ((), rest_t, rest_t) if rest_t else ()
    first, last = values.item(0), values.item(-1)
    return _new(
        Summary, (n, float(n), 0.0, total, total_lo, total, total_lo, m2, lowest, highest, first, last, rest, None)
    )


def _sum_of_squares(deviations: np.ndarray[Any, Any]) -> float:
    """Σd²: a BLAS dot per ``_ROW`` records (a stack of them in one matmul) and one for the rest, added by fsum.

    Short dots keep few terms in each of the kernel's accumulators (within an ulp or two, where one dot of 20000
    records is off by several on integer data) and run on one thread, so the bits depend on the records only."""
    n = deviations.size
    whole = n - n % _ROW
    rows = deviations[:whole].reshape(-1, 1, _ROW)
    parts: list[float] = np.matmul(rows, rows.reshape(-1, _ROW, 1)).ravel().tolist() if whole else []
    if whole < n:
        parts.append(float(np.dot(deviations[whole:], deviations[whole:])))
    try:
        return math.fsum(parts)
    except OverflowError:  # the sum is beyond the double range: inf, as d * d gives
        return math.inf
