"""Per-metric micro-level accumulation: a small buffer folded into a Summary when full.

``log()`` appends to a plain list (near the cost of ``list.append``); memory stays O(metrics) because the buffer
is folded into the metric's Summary every ``FOLD_AT`` records and at commit.
"""

from __future__ import annotations

from metricbus.spec import NanPolicy, Spec
from metricbus.summary import EMPTY, Summary
from metricbus.values import drop_nonfinite

FOLD_AT = 256


class Accumulator:
    """The uncommitted records of one metric on one worker."""

    __slots__ = ("name", "nan", "spec", "state", "values", "weights")

    def __init__(self, *, name: str, spec: Spec, nan: NanPolicy) -> None:
        self.name = name
        self.spec = spec
        self.nan: NanPolicy = nan
        self.values: list[float] = []
        self.weights: list[float] | None = None
        self.state = EMPTY

    def add(self, values: list[float], weights: list[float] | None) -> None:
        """Append records; ``weights`` None means weight 1 each."""
        if weights is not None and self.weights is None:
            self.weights = [1.0] * len(self.values)
        self.values.extend(values)
        if self.weights is not None:
            self.weights.extend(weights if weights is not None else [1.0] * len(values))
        if len(self.values) >= FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Fold the buffer into the state (the buffer list object is kept: the bus's fast path holds it)."""
        values = self.values
        if not values:
            return
        weights = self.weights
        if self.nan == "ignore":
            values, weights = drop_nonfinite(values, weights)
        if values:
            self.state = self.state.merge(Summary.of_batch(values, weights))
        self.values.clear()
        if self.weights is not None:
            self.weights.clear()

    def take(self) -> Summary:
        """The folded state of everything since the last take, and reset."""
        values = self.values
        if values and self.weights is None and self.state.count == 0 and self.nan != "ignore":
            # The common commit: one unweighted buffer and nothing folded yet, so no merge is needed.
            state = Summary.of_batch(values, None)
            values.clear()
            return state
        self.fold()
        state, self.state = self.state, EMPTY
        return state

    @property
    def pending(self) -> bool:
        """True if records were added since the last take."""
        return bool(self.values) or self.state.count > 0
