"""``Histogram``: what the ``hist`` kind emits.

It is a float, the number of records it holds, so every path that carries emitted values (commit()'s return,
delivery, console, a backend without histograms) carries it unchanged; backends that draw histograms read
``edges`` and ``counts`` (TensorBoard's histogram plugin, ``wandb.Histogram``, jsonl), and one without them writes
``quantiles`` as metrics (MLflow). (A float subclass rather than a second value type: every emitted value stays a
float, which the adapters' ``write(step=, metrics=)`` protocol promises.)
"""

from __future__ import annotations

import struct
from typing import Any

HIST_BINS = 64  # the most bins an emitted histogram has (sketch buckets are grouped into them)
HIST_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))  # what a backend without histograms gets


class Histogram(float):
    """A histogram: ``float(h)`` is its number of records; ``edges`` (``len(counts) + 1`` increasing floats) and
    ``counts`` the bins; ``quantiles`` ``(("p50", v), ("p90", v), ("p99", v))``. Immutable."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]
    quantiles: tuple[tuple[str, float], ...]

    def __new__(
        cls,
        count: float,
        *,
        edges: tuple[float, ...],
        counts: tuple[int, ...],
        quantiles: tuple[tuple[str, float], ...],
    ) -> Histogram:
        if len(edges) != len(counts) + 1 and (edges or counts):
            raise ValueError(f"a histogram has one more edge than bins, got {len(edges)} edges and {len(counts)} bins")
        self = super().__new__(cls, count)
        object.__setattr__(self, "edges", tuple(edges))
        object.__setattr__(self, "counts", tuple(counts))
        object.__setattr__(self, "quantiles", tuple(quantiles))
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Histogram is immutable (setting {name!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (float(self), self.edges, self.counts, self.quantiles)

    def __repr__(self) -> str:
        return f"Histogram(count={float(self):g}, bins={len(self.counts)})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Histogram):  # bit for bit: a NaN quantile equals a NaN quantile
            return _bits(self) == _bits(other)
        return float.__eq__(self, other)

    def __hash__(self) -> int:
        return float.__hash__(self)


def _bits(h: Histogram) -> tuple[object, ...]:
    floats = (float(h), *h.edges, *(q for _, q in h.quantiles))
    return struct.pack(f"<{len(floats)}d", *floats), h.counts, tuple(name for name, _ in h.quantiles)


def _rebuild(
    count: float, edges: tuple[float, ...], counts: tuple[int, ...], quantiles: tuple[tuple[str, float], ...]
) -> Histogram:
    return Histogram(count, edges=edges, counts=counts, quantiles=quantiles)
