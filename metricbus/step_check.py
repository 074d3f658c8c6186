"""Whether every torch.distributed rank commits the same step, inside the commit's own collectives.

Each rank writes its own journal file under the step it was given, so ranks that commit different steps would
deliver one timeline live and replay another. The check costs a few slots of the collectives a commit runs anyway:

- in an ``all_reduce(MAX)`` of float64 (:func:`max_slots`): the step, its high and low 32 bits, and their
  negations, so the maxima say exactly whether all ranks sent one step, and which are the lowest and the highest
  (:func:`steps_of_max`);
- in a one-pass commit's ``all_reduce(SUM)`` of int64 (:func:`sum_slots`): ``d = step - base`` (``base``: the last
  step the ranks agreed on, the same on every rank), ``d²`` and a count of ranks whose ``|d|`` is too large for
  that (where ``d`` and ``d²`` are sent as 0). The ranks agree exactly when ``R·Σd² = (Σd)²`` (Cauchy-Schwarz, in
  exact integers: no sum can overflow) and no rank was too far; otherwise (:func:`sums_agree` False) every rank
  runs one more small MAX collective to learn the two steps, so all of them raise the same error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

N_MAX = 6  # float64 slots in a MAX collective
N_SUM = 3  # int64 slots in a SUM collective
_NEAR = 1 << 20  # |step - base| below this is sent as d and d² (R·d² stays far below 2**63 for R < 2**22)


def max_slots(step: int) -> Any:
    """The float64 slots of ``step`` for an all_reduce(MAX): the step and its negation (exact up to 2**53), then its
    high and low 32 bits and their negations (exact for every int64)."""
    high, low = step >> 32, step & 0xFFFFFFFF
    return np.array([step, -step, high, low, -high, -low], dtype=np.float64)


def steps_of_max(slots: Any) -> tuple[int, int] | None:
    """``(lowest, highest)`` step of the ranks from the reduced MAX ``slots`` where they differ (exact below 2**53,
    the nearest doubles beyond), else None."""
    top, neg_bottom, high, low, neg_high, neg_low = (int(v) for v in slots)
    if top == -neg_bottom and high == -neg_high and low == -neg_low:
        return None
    return -neg_bottom, top


def sum_slots(step: int, base: int) -> Any:
    """The int64 slots of ``step`` for an all_reduce(SUM), relative to the agreed ``base``."""
    d = step - base
    if -_NEAR < d < _NEAR:
        return np.array([d, d * d, 0], dtype=np.int64)
    return np.array([0, 0, 1], dtype=np.int64)


def sums_agree(slots: Any, ranks: int) -> bool:
    """True when the reduced SUM ``slots`` of ``ranks`` ranks show that all sent the same step."""
    total, squares, far = (int(v) for v in slots)
    return far == 0 and ranks * squares == total * total
