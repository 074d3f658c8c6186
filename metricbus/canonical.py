"""One NaN: every emitted NaN is ``math.nan`` (positive, quiet, no payload), so every path emits the same bits.

The journal keeps each NaN's bits as logged. But which NaN a sum of ``+inf`` and ``-inf`` makes depends on the
hardware (x86's is negative, ARM's positive), and the rank level writes ``math.nan`` for the NaN terms it counts
while a worker's own merge keeps the NaN its records hold: two paths to one NaN value could emit different bits.
The emitted metrics (live, ingest and replay alike) therefore hold ``math.nan`` wherever they hold a NaN.
"""

from __future__ import annotations

import math
from typing import Any

_NAN = math.nan


def nans(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with each NaN float replaced by ``math.nan`` (in place; returned)."""
    # NaN if any value is NaN (or +inf and -inf meet): then look. A Histogram is a float subclass: its value counts
    # here, and it is kept as it is below.
    total = sum(metrics.values())
    if total == total:  # noqa: PLR0124  (the cheapest not-NaN test)
        return metrics
    for name, value in metrics.items():
        if type(value) is float and value != value:  # noqa: PLR0124
            metrics[name] = _NAN
    return metrics


def canonical(value: Any) -> Any:
    """``value``, or ``math.nan`` where it is a NaN float (as :func:`nans` replaces it)."""
    return _NAN if type(value) is float and value != value else value  # noqa: PLR0124
