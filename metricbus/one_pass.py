"""A steady commit in one collective: the guessed sums pass checked inside itself.

The maxima pass (all_reduce MAX) gives every rank what the sums pass is laid out by, and the merged ``min``/``max``.
Where no agreed chain reads a merged ``min`` or ``max`` at the rank level (:func:`reads_extrema`: the default
``mean``, and ``sum``, ``std``, ``count``, ``first``, ``last``) and no column is sketched, a steady commit needs
neither: every rank lays its sums out by the guess (:mod:`metricbus.speculate`) and sends, in the same
all_reduce(SUM), what the guess's check needs (:func:`flags`):

* a miss count: 1 from a rank whose own row does not fit the guess (:func:`own_fit`): a term outside its window,
  a column it has below the guessed lowest rank, a column it lacks as the guessed lowest rank, weights in a column
  guessed unweighted. The sums of every rank whose row fits are exact in the window, and the guessed lowest rank
  of each column is the lowest that has it, so the reduced sums are the ones the maxima would have laid out;
* per column guessed weighted, the number of ranks with weights there (0: the column is unweighted now, a miss);
* the bits of the byte length of this rank's new claims, each as a count, so every rank learns their OR (at least
  the longest, less than twice it) and the byte gather of an agreement needs no maxima pass either.

Every rank reads the same reduced flags (:func:`read`). A hit finishes the sums under the guess's layout with the
extrema unknown (the guess's are NaN: nothing reads them); a miss costs the maxima pass and the sums pass
again (three collectives that commit, every rank alike). The windows of a guess only widen on a miss, so after
:data:`REFRESH` one-pass commits the next runs both passes (issued together) to narrow them again.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from metricbus.fixed import Array
from metricbus.rank_finish import plan
from metricbus.rank_level import Prepared, sums
from metricbus.spec import Spec
from metricbus.speculate import blank, holds

REFRESH = 16  # one-pass commits between two commits that agree the maxima (and narrow the guess)
LENGTH_BITS = 48  # a claims payload's length is below 2**48 bytes
EXTREMA_KINDS = frozenset({"min", "max"})
_BITS = np.arange(LENGTH_BITS, dtype=np.int64)
_HEAD = 1 + LENGTH_BITS  # the miss count, then the length bits, then the weighted counts


def reads_extrema(specs: Mapping[str, Spec]) -> bool:
    """True if a chain of ``specs`` reads a merged ``min`` or ``max`` at the rank level (the step level reads the
    rank level's merged state only where its kind is the rank kind)."""
    return any(chain.rank in EXTREMA_KINDS for spec in specs.values() for chain in spec.chains)


def own_fit(*, maxima: Array, present: Array, weighted: Array, rank: int, guess: Array) -> bool:
    """True if this rank's row (its (C, NM) ``maxima``, the columns it has and those it has weights in) fits
    ``guess``: every term inside the guessed windows, no column it has below the guessed lowest rank, none it lacks
    as that rank, no weights in a column guessed unweighted."""
    if not holds(maxima, guess):
        return False
    held = plan(guess)
    lowest = held.lowest
    if not np.where(present, lowest <= rank, lowest != rank).all():
        return False
    return not (weighted.any() and (weighted & held.unweighted).any())


def vector(prep: Prepared, *, maxima: Array, rank: int, guess: Array, length: int) -> Array:
    """What this rank all-reduces (SUM) in a one-pass commit: its checks (:func:`flags`), then its sums laid out by
    ``guess`` (zeros of their length where its row does not fit it). ``prep``: this rank's one-row block, ``maxima``
    its maxima, ``length`` the byte length of its claims payload (0: none)."""
    present, weighted = prep.present[0], prep.weighted[0]
    fits = own_fit(maxima=maxima, present=present, weighted=weighted, rank=rank, guess=guess)
    checks = flags(fits=fits, length=length, weighted=weighted, guess=guess)
    return np.concatenate((checks, sums(prep, guess) if fits else blank(guess)))


def flags(*, fits: bool, length: int, weighted: Array, guess: Array) -> Array:
    """The int64 checks this rank sends ahead of its sums (see the module docstring)."""
    if not 0 <= length < 1 << LENGTH_BITS:
        raise ValueError(f"a claims payload of {length} bytes: at most 2**{LENGTH_BITS} - 1 are sent")
    held = plan(guess)
    out = np.empty(_HEAD + held.n_weighted, dtype=np.int64)
    out[0] = 0 if fits else 1
    out[1:_HEAD] = (length >> _BITS) & 1 if length else 0
    out[_HEAD:] = weighted[held.weighted]
    return out


def read(summed: Array, guess: Array) -> tuple[bool, int, Array]:
    """``(hit, longest, sums)`` of the reduced flags and sums: whether the guess held on every rank, a bound on the
    longest claims payload (0: none), and the reduced sums laid out by the guess."""
    end = _HEAD + plan(guess).n_weighted
    hit = summed[0] == 0 and bool((summed[_HEAD:end] > 0).all())
    lengths = summed[1:_HEAD]
    longest = int(((lengths > 0).astype(np.int64) << _BITS).sum()) if lengths.any() else 0
    return hit, longest, summed[end:]
