"""Summaries of records held in numpy arrays (``log(name, array)``), vectorized and exact.

The exact sum comes from error-free extraction (:func:`metricbus.exact.array_components`); min, max, first and
last from numpy, in log order; m2 from numpy's two-pass sum. Short, non-finite or huge blocks take
:meth:`Summary.of_batch`'s list path.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from metricbus import exact
from metricbus.summary import EMPTY, Summary, split_parts

_MAX = exact.MAX
_QUIET = 2.0**480
_SHORT_ARRAY = 16  # at most this many records: the list path is cheaper than a dozen numpy calls
_BLOCK = 8192  # records summarised by one round of numpy calls (64 KiB scratch arrays)
_SCRATCH = threading.local()  # each thread's scratch arrays, made on first use
_new = tuple.__new__


def of_arrays(chunks: Sequence[np.ndarray[Any, Any]]) -> Summary:
    """Summarise unit-weight records held in 1-D float64 arrays (in order, not all empty), vectorized: the same
    fields as :meth:`Summary.of_batch` of their concatenated ``tolist()``, bit for bit, except ``m2`` (numpy's
    two-pass sum: within a few ulps). Blocks of up to ``_BLOCK`` records are summarised by one round of numpy
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
    """This thread's arrays for :func:`_of_block`: a joined block, ones, two work arrays (``_BLOCK`` each)."""
    held: tuple[np.ndarray[Any, Any], ...] | None = getattr(_SCRATCH, "arrays", None)
    if held is None:
        held = _SCRATCH.arrays = (np.empty(_BLOCK), np.ones(_BLOCK), np.empty(_BLOCK), np.empty(_BLOCK))
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
    # argmin/argmax return the first occurrence (as min() keeps the first of 0.0 and -0.0), and a NaN if any
    lowest, highest = float(values[values.argmin()]), float(values[values.argmax()])
    largest = highest if highest >= -lowest else -lowest
    scratch = _scratch()
    parts = exact.array_components(values, largest, scratch[1:]) if lowest > -_MAX and highest < _MAX else None
    if parts is None:  # non-finite, beyond the array path's range, or all zeros
        return Summary.of_batch(values.tolist(), None)
    total, total_lo, rest_t = split_parts(parts)
    deviations = np.subtract(values, total / n, out=scratch[2][:n])
    if largest < _QUIET:  # no square (nor their sum) can overflow
        m2 = float(np.dot(deviations, deviations))
    else:  # overflows to inf, as d * d does, without numpy's warning
        with np.errstate(over="ignore", invalid="ignore"):
            m2 = float(np.dot(deviations, deviations))
    rest = ((), rest_t, rest_t) if rest_t else ()
    first, last = float(values[0]), float(values[-1])
    return _new(
        Summary, (n, float(n), 0.0, total, total_lo, total, total_lo, m2, lowest, highest, first, last, rest, None)
    )
