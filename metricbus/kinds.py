"""The reduction kinds: one lookup from tag to the function that reads a Summary.

The fixed kinds read the Summary's statistics. The distribution kinds read its sketch (:mod:`metricbus.sketch`):
``pNN`` (a quantile in percent: ``p50``, ``p90``, ``p99``, ``p99.9``; ``quantile(q)`` is the same kind written as a
fraction, ``quantile(0.999)`` == ``p99.9``) and ``hist`` (a :class:`~metricbus.histogram.Histogram`).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from types import MappingProxyType

from metricbus.histogram import HIST_BINS, HIST_QUANTILES, Histogram
from metricbus.sketch import Sketch, unknown
from metricbus.summary import Summary

Kind = Callable[[Summary], float]


def _count(s: Summary) -> float:
    return float(s.count)


KINDS: MappingProxyType[str, Kind] = MappingProxyType(
    {
        "mean": Summary.mean,
        "sum": Summary.sum,  # reads s.total: the correctly rounded exact sum (see summary's docstring)
        "min": lambda s: s.min,
        "max": lambda s: s.max,
        "first": lambda s: s.first,
        "last": lambda s: s.last,
        "count": _count,
        "std": Summary.std,
    }
)
HIST = "hist"
KIND_NAMES: tuple[str, ...] = tuple(KINDS)  # the kinds that read a Summary's statistics
KIND_HELP: tuple[str, ...] = (
    *KINDS,
    "p50",
    "p90",
    "p99",
    "pNN",
    "quantile(q)",
    HIST,
)  # every kind, as messages list them
_PERCENT = re.compile(r"p(\d+(?:\.\d+)?)")
_FRACTION = re.compile(r"quantile\(\s*([0-9.eE+-]+)\s*\)")


def quantile(q: float) -> str:
    """The kind of the ``q`` quantile (``0 <= q <= 1``): ``quantile(0.9)`` is ``"p90"``, usable in any spec. ``q`` is
    any real number but a bool: a numpy scalar is the decimal it prints as (``np.float32(0.9)`` is ``p90``)."""
    if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile(q) takes a real number 0 <= q <= 1, got {q!r}")
    try:  # the shortest decimal of its own type (repr(float(np.float32(0.9))) is 0.8999999761581421)
        fraction = Decimal(repr(float(q)) if isinstance(q, float) else str(q))
    except InvalidOperation:  # a Fraction, say
        fraction = Decimal(repr(float(q)))
    return _percent(fraction * 100)


def _percent(percent: Decimal) -> str:
    """``p`` and the percentage with every digit it has, no exponent and no trailing zero (``p99.99999``); -0 is
    ``p0`` (its sign would make ``p-0``, a second name for p0 that canonical() does not read back)."""
    return "p" + format(percent.normalize().copy_abs(), "f")


def canonical(kind: object) -> str | None:
    """The kind's tag (``"quantile(0.5)"`` -> ``"p50"``), or None if it is no kind."""
    if not isinstance(kind, str):
        return None
    if kind in KINDS or kind == HIST:
        return kind
    match = _FRACTION.fullmatch(kind)
    if match:
        try:
            q = Decimal(match.group(1))
        except InvalidOperation:
            return None
        return _percent(q * 100) if q.is_finite() and 0 <= q <= 1 else None
    match = _PERCENT.fullmatch(kind)
    if match and Decimal(match.group(1)) <= 100:
        return _percent(Decimal(match.group(1)))
    return None


def is_sketch(kind: str) -> bool:
    """True for the kinds that read a sketch (quantiles and ``hist``)."""
    return kind not in KINDS


@lru_cache(maxsize=256)
def kind_of(kind: str) -> Kind:
    """The function of a (canonical) kind."""
    held = KINDS.get(kind)
    if held is not None:
        return held
    if kind == HIST:
        return _histogram
    q = float(Decimal(kind[1:]) / 100)  # the fraction nearest to the decimal percentage
    return lambda s: _sketch_of(s).quantile(q)


def _sketch_of(s: Summary) -> Sketch:
    """The state's sketch; one without (records logged before their distribution spec reached that worker): its
    records unknown, so the quantiles are NaN."""
    return s.sketch if s.sketch is not None else unknown(s.count)


def _histogram(s: Summary) -> float:
    sketch = _sketch_of(s)
    edges, counts = sketch.histogram(bins=HIST_BINS)
    quantiles = tuple((name, sketch.quantile(q)) for name, q in HIST_QUANTILES)
    # the number is every record; NaN (and unknown) records have no bin, so the bins then hold fewer
    return Histogram(float(sketch.count), edges=edges, counts=counts, quantiles=quantiles)
