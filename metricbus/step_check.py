"""Whether every torch.distributed rank commits the same step, inside the commit's own collectives.

Each rank writes its own journal file under the step it was given, so ranks that commit different steps would
deliver one timeline live and replay another. The check costs a few slots of the collectives a commit runs anyway:

- in an ``all_reduce(MAX)`` of float64 (:func:`max_slots`): the step, its high and low 32 bits, and their
  negations, so the maxima say exactly whether all ranks sent one step, and which are the lowest and the highest
  (:func:`steps_of_max`);
- in a one-pass commit's ``all_reduce(SUM)`` of int64 (:func:`sum_slots`): the step as three limbs ``l`` of at most
  22 bits (of ``step + 2**63``, so every int64 step is covered, any stride between commits) and their squares. The
  ranks sent one step exactly when ``R·Σl² = (Σl)²`` for every limb (Cauchy-Schwarz, in exact integers: a sum of
  squares stays below 2**63 for R < 2**19 ranks). Where that fails (:func:`sums_agree` False) every rank runs one
  more small MAX collective to learn the two steps, so all of them raise the same error.

Both forms also carry what the rank is doing: a commit (:data:`COMMIT`), or ``close()``'s check of whether any rank
has records left (:data:`CLOSE`, :data:`CLOSE_PENDING`: this rank has some), which runs the commit's own collectives
so that a rank calling ``close()`` while another calls ``commit()`` issues collectives of the same shapes as that
commit: both learn it (:func:`ending_of_max`, :func:`ending_of_sums`) and raise, instead of a collective of another
size meeting the commit's (gloo aborts the process on that; NCCL may hang).
"""

from __future__ import annotations

from typing import Any

import numpy as np

N_MAX = 8  # float64 slots in a MAX collective
N_SUM = 8  # int64 slots in a SUM collective
COMMIT, CLOSE, CLOSE_PENDING = 0, 1, 2  # what a rank is doing: commit(), or close() (with records left on it)
_LIMBS = ((0, 22), (22, 22), (44, 20))  # (shift, bits) of the three limbs of step + 2**63


def max_slots(step: int, doing: int = COMMIT) -> Any:
    """The float64 slots of ``step`` for an all_reduce(MAX): the step and its negation (exact up to 2**53), then its
    high and low 32 bits and their negations (exact for every int64), then ``doing`` and its negation."""
    high, low = step >> 32, step & 0xFFFFFFFF
    return np.array([step, -step, high, low, -high, -low, doing, -doing], dtype=np.float64)


def ending_of_max(slots: Any) -> tuple[bool, bool]:
    """From the reduced MAX ``slots``: ``(mixed, pending)``: whether some ranks are in ``close()`` while others
    commit, and (every rank closing) whether any has records left."""
    most, least = int(slots[6]), -int(slots[7])
    return most > COMMIT and least == COMMIT, most == CLOSE_PENDING and least > COMMIT


def steps_of_max(slots: Any) -> tuple[int, int] | None:
    """``(lowest, highest)`` step of the ranks from the reduced MAX ``slots`` where they differ (exact where the
    steps share their high 32 bits, or are below 2**53), else None."""
    top, neg_bottom, high, low, neg_high, neg_low = (int(v) for v in slots[:6])
    if top == -neg_bottom and high == -neg_high and low == -neg_low:
        return None
    if high == -neg_high:
        return (high << 32) + -neg_low, (high << 32) + low
    return -neg_bottom, top


def sum_slots(step: int, doing: int = COMMIT) -> Any:
    """The int64 slots of ``step`` for an all_reduce(SUM): each limb, then its square; then whether ``doing`` is a
    close, and a close with records left."""
    unsigned = step + (1 << 63)
    limbs = [(unsigned >> shift) & ((1 << bits) - 1) for shift, bits in _LIMBS]
    return np.array(
        [*limbs, *(limb * limb for limb in limbs), doing != COMMIT, doing == CLOSE_PENDING], dtype=np.int64
    )


def sums_agree(slots: Any, ranks: int) -> bool:
    """True when the reduced SUM ``slots`` of ``ranks`` ranks show that all sent the same step, and all commit or
    all close."""
    values = slots.tolist()  # (int64: Python ints)
    n = len(_LIMBS)
    return values[2 * n] in (0, ranks) and all(ranks * values[n + i] == values[i] * values[i] for i in range(n))


def ending_of_sums(slots: Any, ranks: int) -> tuple[bool, bool]:
    """:func:`ending_of_max`'s ``(mixed, pending)`` from the reduced SUM ``slots`` of ``ranks`` ranks."""
    closing, pending = int(slots[2 * len(_LIMBS)]), int(slots[2 * len(_LIMBS) + 1])
    return 0 < closing < ranks, closing == ranks and pending > 0
