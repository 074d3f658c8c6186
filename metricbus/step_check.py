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
"""

from __future__ import annotations

from typing import Any

import numpy as np

N_MAX = 6  # float64 slots in a MAX collective
N_SUM = 6  # int64 slots in a SUM collective
_LIMBS = ((0, 22), (22, 22), (44, 20))  # (shift, bits) of the three limbs of step + 2**63


def max_slots(step: int) -> Any:
    """The float64 slots of ``step`` for an all_reduce(MAX): the step and its negation (exact up to 2**53), then its
    high and low 32 bits and their negations (exact for every int64)."""
    high, low = step >> 32, step & 0xFFFFFFFF
    return np.array([step, -step, high, low, -high, -low], dtype=np.float64)


def steps_of_max(slots: Any) -> tuple[int, int] | None:
    """``(lowest, highest)`` step of the ranks from the reduced MAX ``slots`` where they differ (exact where the
    steps share their high 32 bits, or are below 2**53), else None."""
    top, neg_bottom, high, low, neg_high, neg_low = (int(v) for v in slots)
    if top == -neg_bottom and high == -neg_high and low == -neg_low:
        return None
    if high == -neg_high:
        return (high << 32) + -neg_low, (high << 32) + low
    return -neg_bottom, top


def sum_slots(step: int) -> Any:
    """The int64 slots of ``step`` for an all_reduce(SUM): each limb, then its square."""
    unsigned = step + (1 << 63)
    limbs = [(unsigned >> shift) & ((1 << bits) - 1) for shift, bits in _LIMBS]
    return np.array([*limbs, *(limb * limb for limb in limbs)], dtype=np.int64)


def sums_agree(slots: Any, ranks: int) -> bool:
    """True when the reduced SUM ``slots`` of ``ranks`` ranks show that all sent the same step."""
    values = [int(v) for v in slots]
    n = len(_LIMBS)
    return all(ranks * values[n + i] == values[i] * values[i] for i in range(n))
