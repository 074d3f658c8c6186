"""The sums pass laid out by a guess, so a steady commit's two collectives run at once instead of one after the other.

The rank level's sums (:func:`metricbus.rank_level.sums`) need a layout that the maxima pass agrees: per exact sum
the largest exponent ``E`` and the smallest ``Q`` of every worker's terms, whether the column is weighted, and the
lowest rank that has it. In a steady run these change little from one commit to the next, so every rank lays its
sums out by a *guess* made from the previous commit's agreed maxima, widened (:func:`guess_of`: ``E`` plus
``E_MARGIN`` bits, ``-Q`` plus ``Q_MARGIN`` bits, about one more limb per sum, and never narrower than the guess
before it less ``SHRINK`` bit per commit), and issues both all_reduces together (or the sums pass alone, checked
inside itself: :mod:`metricbus.one_pass`). A guess holds no extrema (NaN): they are agreed, not guessed.

The guess is identical on every rank (made from values every rank agreed), and so is the check once both passes are
back (:func:`fits`): every agreed ``E`` at most the guessed one, every agreed ``-Q`` at most the guessed one (so
every rank's terms lay inside the guessed window and were added exactly), the same weighted columns and the same
lowest ranks. Then the sums are finished under the guess's layout with the agreed extrema (:func:`within`); the
exact sums are the same integers in a wider window, and :func:`metricbus.fixed.components` is canonical in the value,
so the result is bit for bit the sequential one. Otherwise (a value grew beyond the margin, a metric moved to
another rank, a slot empty at the last commit has terms) every rank runs the sums pass again under the agreed
maxima: one extra collective, on every rank. A rank whose own row already does not fit the guess (terms outside its
windows, :func:`holds`; weights in a column guessed unweighted, or another lowest rank:
:func:`metricbus.one_pass.own_fit`) sends zeros of the guess's length (:func:`blank`) rather than limbs outside
their slots; the agreed maxima, at least its own, then miss the guess on every rank.
"""

from __future__ import annotations

import numpy as np

from metricbus import fixed
from metricbus.fixed import Array
from metricbus.rank_finish import plan
from metricbus.rank_level import NM, SLOTS, layout

E_MARGIN = 8.0  # values may grow 256-fold before the guess misses
Q_MARGIN = 32.0  # and their lowest bit may drop 32 bits (one more limb per exact sum)
SHRINK = 1.0  # bits a guessed window narrows per commit at most
# positions in a column's maxima (see metricbus.rank_level): E per slot, -Q per slot, max, -min, -rank, weighted
_E, _NQ = slice(0, SLOTS), slice(SLOTS, 2 * SLOTS)
_EXTREMA = slice(2 * SLOTS, 2 * SLOTS + 2)
_LAYOUT = slice(2 * SLOTS + 2, NM)  # -rank and weighted: they pick the rows and slots the sums hold
_NONE = float(fixed.NONE)


def guess_of(agreed: Array, previous: Array | None, *, commits: int = 1) -> Array:
    """The next commit's guessed maxima: ``agreed``'s columns, ranks and weights; each slot's ``E`` and ``-Q`` the
    agreed ones plus the margins, or the ``previous`` guess's (made ``commits`` commits ago) less ``SHRINK`` bits
    per commit where that is wider (so a slot that is sometimes empty or a value that dips for one commit do not
    make the next guess miss; a window widened by a spike narrows again over the following commits)."""
    guess = agreed.copy()
    guess[:, _EXTREMA] = np.nan  # not guessed: a one-pass commit (metricbus.one_pass) finishes without them
    for part, margin in ((_E, E_MARGIN), (_NQ, Q_MARGIN)):
        held = guess[:, part]
        held[held != _NONE] += margin
        if previous is not None and previous.shape == agreed.shape:
            before = previous[:, part]
            kept = before != _NONE
            held[kept] = np.maximum(held[kept], before[kept] - SHRINK * commits)
    return guess


def holds(maxima: Array, guess: Array) -> bool:
    """True if every term behind ``maxima`` (one rank's, or every rank's agreed ones) lies inside the windows of
    ``guess``: each non-empty slot's ``E`` and ``-Q`` at most the guessed ones, in a slot the guess holds non-empty.
    A rank whose own terms do not sends no sums laid out by the guess (its limbs would fall outside their slots)."""
    if maxima.shape != guess.shape:
        return False
    below = maxima[:, : 2 * SLOTS] <= plan(guess).caps  # E, then -Q, at most the guess's (E: in a non-empty slot)
    inside = (below[:, _E] & below[:, _NQ]) | (maxima[:, _E] == _NONE)
    return bool(inside.all())


def fits(agreed: Array, guess: Array) -> bool:
    """True if sums laid out by ``guess`` hold every rank's terms exactly and pick the same rows as ``agreed``."""
    return holds(agreed, guess) and bool((agreed[:, _LAYOUT] == guess[:, _LAYOUT]).all())


def blank(guess: Array) -> Array:
    """The sums a rank whose own terms do not fit ``guess`` sends: zeros of the guess's layout (every rank then sees
    that the agreed maxima do not fit it, and runs the sums pass again)."""
    return np.zeros(layout(guess)[2], dtype=np.int64)


def within(agreed: Array, guess: Array) -> Array:
    """The maxima to finish sums laid out by ``guess`` with: the guess's layout, the agreed extrema."""
    out = guess.copy()
    out[:, _EXTREMA] = agreed[:, _EXTREMA]
    return np.asarray(out)
